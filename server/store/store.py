"""TrajectoryStore: the archive, repository, curriculum and utilities behind one writer lock.

Readers never see a half-applied episode: every method that reads more than one field copies
what it needs under the lock and builds its (fresh, plain) result after releasing it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from recorder_client.capture_types import (
    EpisodeOutcome,
    TrajectoryKey,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
)

from . import codec
from . import curriculum as curriculum_mod
from .archive import CellArchive
from .cells import EpisodeArrays, cell_keys, group_episode
from .curriculum import Curriculum
from .repository import TrajectoryRepository, decode_episode, encode_episode
from .utilities import UtilityTable, aggregate

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "recorder.trajectory_store.v1"
# sample_start remembers this many handed-out starts so that the episode run from one can be
# credited to its cell without decoding the trajectory again.
_MAX_PENDING_STARTS = 1 << 16


@dataclass(frozen=True)
class EpisodeRecord:
    """What the store did with one episode."""

    trajectory_id: int
    """The id the episode got (ids advance for every episode, stored or not)."""
    stored: bool
    """Whether the repository kept it (it became some cell's best reference)."""
    outcome: EpisodeOutcome
    """The outcome recorded, after the configured rule."""
    new_cells: int
    """Cells first seen in this episode."""
    improved_cells: int
    """Cells whose best reference moved to this episode (new cells included)."""


@dataclass(frozen=True)
class CellInfo:
    """A copy of one cell's archive entry."""

    key: TrajectoryKey
    visits: int
    """Steps spent in the cell over all recorded episodes."""
    first_seen_step: int
    """The ``step`` passed to record_episode for the episode that first reached the cell."""
    first_seen_offset: int
    """The 0-based step within that episode at which it first reached the cell."""
    times_chosen: int
    """Times sample_start chose the cell."""
    best_reference: TrajectorySliceReference
    best_return: float
    """Cumulative reward (float64) of the best reference, up to and including its step."""
    midpoint_starts: int
    """Episodes recorded with a start_reference into this cell."""


class TrajectoryStore:
    """Go-Explore-style trajectory store (see DESIGN.md, "Trajectory store")."""

    def __init__(self, configuration: TrajectoryTrainingConfiguration, *, seed: int | None = None):
        if not isinstance(configuration, TrajectoryTrainingConfiguration):
            raise ValueError(
                f"configuration: expected a TrajectoryTrainingConfiguration, got {configuration!r}"
            )
        self._config = configuration
        self._lock = threading.Lock()
        self._archive = CellArchive(len(configuration.cell_fields))
        self._repository = TrajectoryRepository(configuration.repository_capacity_bytes)
        self._utilities = UtilityTable(configuration.utilities)
        self._curriculum = Curriculum(configuration.selection_power, seed)
        self._pending: OrderedDict[tuple[int, int], TrajectoryKey] = OrderedDict()
        self._counters = {"episodes": 0, "steps": 0, "last_new_cells": 0, "last_improved": 0}

    # -- configuration -------------------------------------------------------------------------

    @property
    def configuration(self) -> TrajectoryTrainingConfiguration:
        return self._config

    @property
    def key_names(self) -> tuple[str, ...]:
        """Names of the cell-key fields, in key order."""
        return self._config.key_names

    @property
    def utility_names(self) -> tuple[str, ...]:
        return self._utilities.names

    def __len__(self) -> int:
        """Number of cells in the archive."""
        return len(self._archive)

    # -- writing -------------------------------------------------------------------------------

    def record_episode(
        self,
        episode: EpisodeArrays,
        *,
        step: int,
        outcome: EpisodeOutcome | int | str = EpisodeOutcome.UNKNOWN,
        start_reference: TrajectorySliceReference | None = None,
    ) -> EpisodeRecord:
        """Fold one finished episode into the archive, repository and utilities.

        ``step`` is the caller's global step; it becomes ``first_seen_step`` of new cells.
        An UNKNOWN outcome goes through the configured OutcomeRule first.
        """
        episode = EpisodeArrays.coerce(episode)
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"step: expected an int, got {step!r}")
        step = int(step)
        cumulative = np.cumsum(episode.rewards, dtype=np.float64)
        if cumulative.size and not np.isfinite(cumulative).all():
            raise ValueError("rewards: episode has non-finite rewards or return")
        outcome = self._config.outcome_rule.resolve(
            EpisodeOutcome.coerce(outcome), float(cumulative[-1]) if cumulative.size else 0.0
        )
        if start_reference is not None and not isinstance(
            start_reference, TrajectorySliceReference
        ):
            raise ValueError(
                f"start_reference: expected a TrajectorySliceReference, got {start_reference!r}"
            )
        length = episode.length
        cells = None
        if length:
            keys = cell_keys(self._config.cell_fields, episode.states, length)
            cells = group_episode(keys, cumulative)
        with self._lock:
            tid = self._repository.allocate_id()
            new = improved = 0
            if cells is not None:
                update = self._archive.apply_episode(cells, tid, step)
                new, improved = update.new_cells, int(update.improved.sum())
                self._repository.release(update.released)
                blob = encode_episode(episode) if improved else b""
                self._repository.add(tid, blob, length, improved)
                self._utilities.apply_episode(
                    update.cell_ids, cells.inverse, outcome, len(self._archive)
                )
            if start_reference is not None:
                self._curriculum.count_midpoint_start(self._start_cell(start_reference))
            c = self._counters
            c["episodes"] += 1
            c["steps"] += length
            c["last_new_cells"], c["last_improved"] = new, improved
        return EpisodeRecord(tid, improved > 0, outcome, new, improved)

    def _start_cell(self, ref: TrajectorySliceReference) -> TrajectoryKey | None:
        """The cell a start reference points into (lock held)."""
        key = self._pending.pop((ref.trajectory_id, ref.step), None)
        if key is not None:
            return key
        blob = self._repository.blob(ref.trajectory_id)
        if blob is None:
            logger.debug("midpoint start %s: trajectory no longer stored", ref)
            return None
        episode = decode_episode(blob)
        if ref.step >= episode.length:
            logger.debug("midpoint start %s: step beyond trajectory length", ref)
            return None
        states = {k: v[ref.step : ref.step + 1] for k, v in episode.states.items()}
        return tuple(cell_keys(self._config.cell_fields, states, 1)[0].tolist())

    def sample_start(self) -> tuple[TrajectorySliceReference, EpisodeArrays] | None:
        """Choose a start cell (weight ``1/(times_chosen+1)**selection_power``), count the
        choice, and return its best reference with the recorded prefix (steps 0..ref.step).
        None when the archive is empty."""
        with self._lock:
            n = len(self._archive)
            if n == 0:
                return None
            times = self._archive.view("times_chosen")
            i = self._curriculum.choose(times)
            times[i] += 1
            tid = int(self._archive.view("best_trajectory")[i])
            step = int(self._archive.view("best_step")[i])
            blob = self._repository.blob(tid)
            self._pending[(tid, step)] = tuple(self._archive.keys[i].tolist())
            self._pending.move_to_end((tid, step))
            while len(self._pending) > _MAX_PENDING_STARTS:
                self._pending.popitem(last=False)
        if blob is None:
            raise RuntimeError(f"trajectory store: cell {i} references missing trajectory {tid}")
        return TrajectorySliceReference(tid, step), decode_episode(blob).prefix(step)

    # -- reading -------------------------------------------------------------------------------

    def _field_columns(self, field_names: Any) -> list[int]:
        names = self.key_names
        if isinstance(field_names, str):
            raise ValueError(
                f"field_names: expected a list of names, got the string {field_names!r}"
            )
        cols = []
        for f in field_names:
            if f not in names:
                raise ValueError(
                    f"field_names: unknown field {f!r}; cell key fields are {list(names)}"
                )
            if names.index(f) in cols:
                raise ValueError(f"field_names: field {f!r} given twice")
            cols.append(names.index(f))
        return cols

    def snapshot_potential(
        self, utility_key: str, field_names: list[str]
    ) -> dict[tuple[int, ...], float]:
        """``{(values of field_names): net value}`` as a fresh dict; fields left out are merged
        (total sum / total visits over the merged cells)."""
        u = self._utilities.index(utility_key)
        cols = self._field_columns(field_names)
        with self._lock:
            n = len(self._archive)
            keys = self._archive.keys[:n][:, cols]
            sums = self._utilities.sums[u, :n].copy()
            visits = self._archive.view("visits").astype(np.float64)
        distinct = sorted(cols) == list(range(len(self.key_names)))
        return aggregate(keys, sums, visits, distinct=distinct)

    def start_probabilities(self) -> dict[TrajectoryKey, float]:
        """The current start distribution ``{cell key: probability}``."""
        with self._lock:
            keys = self._archive.view("keys").copy()
            times = self._archive.view("times_chosen").copy()
        if not len(times):
            return {}
        w = curriculum_mod.start_weights(times, self._config.selection_power)
        return dict(zip(map(tuple, keys.tolist()), (w / w.sum()).tolist(), strict=True))

    def midpoint_start_counts(self) -> dict[TrajectoryKey, int]:
        with self._lock:
            return dict(self._curriculum.midpoint_counts)

    def cell(self, key: TrajectoryKey) -> CellInfo | None:
        """A copy of one cell's entry, or None when the archive lacks it."""
        key = tuple(int(k) for k in key)
        with self._lock:
            i = self._archive.lookup(key)
            if i is None:
                return None
            col = {name: self._archive.view(name)[i].item() for name in self._archive.cols}
            mid = self._curriculum.midpoint_counts.get(key, 0)
        return CellInfo(
            key=key,
            visits=col["visits"],
            first_seen_step=col["first_seen_step"],
            first_seen_offset=col["first_seen_offset"],
            times_chosen=col["times_chosen"],
            best_reference=TrajectorySliceReference(col["best_trajectory"], col["best_step"]),
            best_return=col["best_return"],
            midpoint_starts=mid,
        )

    def cell_keys(self) -> list[TrajectoryKey]:
        """Every cell key, in first-seen order."""
        with self._lock:
            return list(map(tuple, self._archive.view("keys").tolist()))

    def trajectory(self, trajectory_id: int) -> EpisodeArrays | None:
        """A stored trajectory decoded, or None when not (or no longer) stored."""
        with self._lock:
            blob = self._repository.blob(trajectory_id)
        return None if blob is None else decode_episode(blob)

    def trajectory_ids(self) -> list[int]:
        with self._lock:
            return self._repository.ids()

    def metrics(self) -> dict[str, float]:
        """Store-derived metric values (tag suffixes, without the ``Trajectories/`` prefix)."""
        with self._lock:
            times = self._archive.view("times_chosen").copy()
            visits = self._archive.view("visits").astype(np.float64)
            sums = self._utilities.sums[:, : len(visits)].copy()
            out = {
                "archive_cells": float(len(visits)),
                "archive_new_cells_last_episode": float(self._counters["last_new_cells"]),
                "archive_improved_cells_last_episode": float(self._counters["last_improved"]),
                "store_episodes": float(self._counters["episodes"]),
                "store_steps": float(self._counters["steps"]),
                "curriculum_starts": float(self._curriculum.starts),
                "curriculum_midpoint_starts": float(sum(self._curriculum.midpoint_counts.values())),
                "curriculum_midpoint_start_cells": float(len(self._curriculum.midpoint_counts)),
                "curriculum_unresolved_midpoint_starts": float(
                    self._curriculum.unresolved_midpoint_starts
                ),
                **self._repository.stats(),
            }
        out["curriculum_start_entropy"] = curriculum_mod.entropy(
            times, self._config.selection_power
        )
        for u, name in enumerate(self._utilities.names):
            values = sums[u] / visits if len(visits) else np.zeros(1)
            out[f"utility/{name}/mean"] = float(values.mean())
            out[f"utility/{name}/max"] = float(values.max())
        return out

    # -- state ---------------------------------------------------------------------------------

    def curriculum_state(self) -> dict[str, Any]:
        """JSON-able runtime state of the curriculum (generator, start counter)."""
        with self._lock:
            return self._curriculum.runtime_state()

    def load_curriculum_state(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._curriculum.load_runtime_state(state)

    def checkpoint_state(
        self, midpoint_start_episode_cell_counts: dict[TrajectoryKey, int] | None = None
    ) -> dict[str, Any]:
        """Everything needed to rebuild the store: ``{"format", "configuration", "counters",
        "arrays": {name: ndarray}}``. The given midpoint counts, when not None, are written
        instead of the store's own."""
        with self._lock:
            n = len(self._archive)
            arrays = {f"archive/{k}": v for k, v in self._archive.state_arrays().items()}
            arrays.update(
                {f"repository/{k}": v for k, v in self._repository.state_arrays().items()}
            )
            arrays.update(self._utilities.state_arrays(n))
            mid = dict(self._curriculum.midpoint_counts)
            counters = dict(self._counters)
            counters["unresolved_midpoint_starts"] = self._curriculum.unresolved_midpoint_starts
        if midpoint_start_episode_cell_counts is not None:
            mid = dict(midpoint_start_episode_cell_counts)
        width = len(self.key_names)
        for key, count in mid.items():
            bad_count = isinstance(count, bool) or not isinstance(count, (int, np.integer))
            if bad_count or len(tuple(key)) != width:
                raise ValueError(
                    f"midpoint_start_episode_cell_counts: bad entry {key!r}: {count!r} "
                    f"(expected {width}-int keys and int counts)"
                )
        arrays["midpoint/keys"] = np.array(list(mid), dtype=np.int64).reshape(len(mid), width)
        arrays["midpoint/counts"] = np.array(list(mid.values()), dtype=np.int64)
        return {
            "format": CHECKPOINT_FORMAT,
            "configuration": self._config.to_dict(),
            "counters": counters,
            "arrays": arrays,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Replace the archive, repository, utilities and midpoint counts with a checkpoint's.

        The checkpoint's cell fields must equal this store's; utilities are matched by name
        (configured ones absent from the checkpoint start at zero). The repository keeps this
        store's capacity and evicts down to it.
        """
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"trajectory store checkpoint: expected format {CHECKPOINT_FORMAT!r}, got {got!r}"
            )
        missing_keys = sorted({"configuration", "arrays"} - set(state))
        if missing_keys:
            raise ValueError(f"trajectory store checkpoint: missing {missing_keys}")
        saved = TrajectoryTrainingConfiguration.from_dict(state["configuration"])
        if saved.cell_fields != self._config.cell_fields:
            raise ValueError(
                f"trajectory store checkpoint: cell_fields {saved.key_names} differ from the "
                f"configured {self.key_names}"
            )
        arrays = state["arrays"]
        width = len(self.key_names)
        sub = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("archive/")}
        archive = CellArchive.from_state_arrays(width, sub)
        sub = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("repository/")}
        repository = TrajectoryRepository.from_state_arrays(
            self._config.repository_capacity_bytes, sub
        )
        _check_refcounts(archive, repository)
        utilities = UtilityTable(self._config.utilities)
        missing = utilities.load_state_arrays(arrays, len(archive))
        if missing:
            logger.warning("trajectory store checkpoint has no sums for utilities %s", missing)
        saved_utils = {u.name: u for u in saved.utilities}
        changed = [u.name for u in self._config.utilities if saved_utils.get(u.name, u) != u]
        if changed:
            logger.warning(
                "trajectory store checkpoint: utilities %s were configured "
                "differently when saved; keeping their sums",
                changed,
            )
        if "midpoint/keys" not in arrays or "midpoint/counts" not in arrays:
            raise ValueError("trajectory store checkpoint: lacks the midpoint-start counts")
        keys = np.asarray(arrays["midpoint/keys"], dtype=np.int64).reshape(-1, width)
        counts = np.asarray(arrays["midpoint/counts"], dtype=np.int64)
        midpoint = dict(zip(map(tuple, keys.tolist()), counts.tolist(), strict=True))
        counters = {k: int(v) for k, v in state.get("counters", {}).items()}
        repository.evict_to_capacity()
        with self._lock:
            self._archive, self._repository, self._utilities = archive, repository, utilities
            self._curriculum.midpoint_counts = midpoint
            self._curriculum.unresolved_midpoint_starts = counters.pop(
                "unresolved_midpoint_starts", 0
            )
            self._counters.update({k: v for k, v in counters.items() if k in self._counters})
            self._pending.clear()


def _check_refcounts(archive: CellArchive, repository: TrajectoryRepository) -> None:
    best = archive.view("best_trajectory")
    if len(best) and best.min() < 0:
        raise ValueError("trajectory store checkpoint: a cell has no best reference")
    tids, counts = np.unique(best, return_counts=True)
    expected = dict(zip(tids.tolist(), counts.tolist(), strict=True))
    for tid in repository.ids():
        if repository.refcount(tid) != expected.pop(tid, 0):
            raise ValueError(f"trajectory store checkpoint: refcount of trajectory {tid} is wrong")
    if expected:
        raise ValueError(
            f"trajectory store checkpoint: cells reference missing trajectories {sorted(expected)}"
        )


def encode_checkpoint_state(state: dict[str, Any], compress: bool) -> bytes:
    """A :meth:`TrajectoryStore.checkpoint_state` dict as bytes (zstd frame when compress)."""
    meta = {k: v for k, v in state.items() if k != "arrays"}
    raw = codec.pack_arrays(state["arrays"], meta)
    return codec.compress(raw) if compress else raw


def decode_checkpoint_state(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_checkpoint_state` (compressed or not, detected by magic)."""
    arrays, meta = codec.unpack_arrays(codec.maybe_decompress(data))
    if not isinstance(meta, dict):
        raise ValueError(f"trajectory store checkpoint: expected a dict header, got {meta!r}")
    return {**meta, "arrays": arrays}
