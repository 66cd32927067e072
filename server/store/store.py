"""TrajectoryStore: the archive, repository, curriculum and utilities behind one writer lock.

Readers never see a half-applied episode: every method that reads more than one field copies
what it needs under the lock and builds its (fresh, plain) result after releasing it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from recorder_client.capture_types import (
    EpisodeOutcome,
    OutcomeRule,
    TrajectoryKey,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
)

from . import codec, kernels
from . import curriculum as curriculum_mod
from .archive import CellArchive
from .cells import cell_keys, field_column
from .curriculum import Curriculum
from .repository import TrajectoryRepository, decode_episode, encode_episode
from .sources import EpisodeArrays, EpisodeList, EpisodeSource, as_source
from .utilities import UtilityTable, aggregate

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "recorder.trajectory_store.v1"
# sample_start remembers this many handed-out starts so that the episode run from one can be
# credited to its cell without decoding the trajectory again.
_MAX_PENDING_STARTS = 1 << 16
# metrics(): archives above this many cells recompute their O(cells) gauges at most once per
# this many seconds (at 100,000 cells they cost ~2 ms, about the rest of a chunk's store work).
_GAUGE_CELLS = 10_000
_GAUGE_PERIOD = 1.0
_OUTCOMES = tuple(EpisodeOutcome(i) for i in range(len(EpisodeOutcome)))


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


@dataclass(frozen=True, eq=False)
class BatchResult:
    """What the store did with a batch of episodes, one entry per episode, in order."""

    first_trajectory_id: int
    """The id of the batch's first episode; episode i got ``first_trajectory_id + i``."""
    codes: np.ndarray
    """(E,) int64 outcome codes recorded, after the configured rule."""
    new_cells: np.ndarray
    """(E,) int64 cells first seen in each episode."""
    improved_cells: np.ndarray
    """(E,) int64 cells whose best reference moved to each episode (new cells included); an
    episode was stored exactly when its count is non-zero."""

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def records(self) -> list[EpisodeRecord]:
        """One EpisodeRecord per episode."""
        first = self.first_trajectory_id
        return [
            EpisodeRecord(first + i, n > 0, _OUTCOMES[o], k, n)
            for i, (o, k, n) in enumerate(
                zip(
                    self.codes.tolist(),
                    self.new_cells.tolist(),
                    self.improved_cells.tolist(),
                    strict=True,
                )
            )
        ]


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
        # Per utility: the sign of each outcome code; gamma -> cached gamma ** k table.
        self._sign_tables = [[u.sign(o) for o in EpisodeOutcome] for u in configuration.utilities]
        self._power_tables: dict[float, np.ndarray] = {}
        # (monotonic time, values) of the per-cell gauges last computed (see metrics()).
        self._gauges: tuple[float, dict[str, float]] | None = None
        kernels.warm_up()

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

    def record(
        self,
        episodes: EpisodeSource | Sequence[EpisodeArrays | Mapping[str, Any]],
        *,
        steps: Sequence[int] | np.ndarray | int,
        outcomes: Sequence[EpisodeOutcome | int | str] | np.ndarray | EpisodeOutcome | int | str,
        start_references: Sequence[TrajectorySliceReference | None] | None = None,
    ) -> BatchResult:
        """Record several finished episodes, with results identical to calling
        :meth:`record_episode` for each in order (trajectory ids, archive cells and their ids,
        visits, first-seen steps, best references and their tie-breaks, repository contents,
        refcounts and evictions, utilities, midpoint starts, counters), vectorised over the
        whole batch.

        ``episodes`` is any :class:`EpisodeSource`, or a sequence of episodes (EpisodeArrays or
        anything :meth:`EpisodeArrays.coerce` takes). ``steps`` and ``outcomes`` give one value
        per episode, or one value for all; ``start_references`` is None or one (optional)
        reference per episode. The whole batch is validated first: on invalid input nothing is
        recorded (ValueError), where sequential calls would have recorded the episodes before
        the bad one.
        """
        source = as_source(episodes)
        step_array, codes, refs = _batch_args(steps, outcomes, start_references, len(source))
        return self._record(source, step_array, codes, refs)

    def record_episode(
        self,
        episode: EpisodeArrays | Mapping[str, Any],
        *,
        step: int,
        outcome: EpisodeOutcome | int | str = EpisodeOutcome.UNKNOWN,
        start_reference: TrajectorySliceReference | None = None,
    ) -> EpisodeRecord:
        """Fold one finished episode into the archive, repository and utilities.

        ``step`` is the caller's global step; it becomes ``first_seen_step`` of new cells.
        An UNKNOWN outcome goes through the configured OutcomeRule first. (:meth:`record` with
        one episode.)
        """
        episode = EpisodeArrays.coerce(episode)
        step = _check_step(step, "step")
        outcome = EpisodeOutcome.coerce(outcome)
        if start_reference is not None and not isinstance(
            start_reference, TrajectorySliceReference
        ):
            raise ValueError(
                f"start_reference: expected a TrajectorySliceReference, got {start_reference!r}"
            )
        return self._record(
            EpisodeList((episode,)),
            np.array([step], dtype=np.int64),
            np.array([int(outcome)], dtype=np.int64),
            [start_reference],
        ).records()[0]

    def step_columns(self, states: Mapping[str, np.ndarray], length: int) -> np.ndarray:
        """The (F, length) int64 cell-key columns of ``length`` steps of state arrays (each
        (length, ...)), as the store computes them for recorded episodes."""
        specs = self._config.cell_fields
        out = np.empty((len(specs), length), dtype=np.int64)
        for j, spec in enumerate(specs):
            out[j] = field_column(spec, states, length)
        return out

    def _powers(self, gamma: float, length: int) -> np.ndarray:
        """``gamma ** [0, 1, ...]`` (float64, at least ``length`` entries), cached."""
        table = self._power_tables.get(gamma)
        if table is None or table.shape[0] < length:
            n = max(length, 1024 if table is None else 2 * table.shape[0])
            table = np.power(gamma, np.arange(n, dtype=np.float64))
            self._power_tables[gamma] = table
        return table

    def _utility_powers(self, length: int) -> np.ndarray:
        """(U, length) float64 ``gamma ** k`` (k < length) of every utility."""
        table = np.empty((len(self._config.utilities), length))
        for u, config in enumerate(self._config.utilities):
            table[u] = self._powers(config.gamma, length)[:length]
        return table

    def _record(
        self,
        source: EpisodeSource,
        step_array: np.ndarray,
        outcomes: np.ndarray,
        refs: list[TrajectorySliceReference | None],
    ) -> BatchResult:
        """The one write path: a source and its validated per-episode arguments."""
        lengths, offsets = source.lengths, source.offsets
        count = lengths.shape[0]
        cells, returns, bad = source.group(self._config.cell_fields, self._utility_powers)
        if bad >= 0:
            where = f" (episode {int(np.searchsorted(offsets, bad, 'right')) - 1} of the batch)"
            where = where if count > 1 else ""
            raise ValueError(f"rewards: episode has non-finite rewards or return{where}")
        codes = _resolve_outcomes(self._config.outcome_rule, outcomes, returns)
        signs = self._utilities_signs(codes)
        pair_sums: list[np.ndarray | None] = []
        if cells is not None:
            for u, (config, sign) in enumerate(zip(self._config.utilities, signs, strict=True)):
                if sign is None:
                    pair_sums.append(None)
                    continue
                table = self._powers(config.gamma, int(lengths.max()))
                pair_sums.append(cells.discounted_sums(u, table))
        # Episodes that start from a sample_start reference (counted under the lock).
        with_ref = [i for i, ref in enumerate(refs) if ref is not None]
        with self._lock:
            first_tid = self._repository.next_id
            self._repository.next_id += count
            improved = new = np.zeros(count, dtype=np.int64)
            released_ep = rel_tid = rel_count = np.zeros(0, dtype=np.int64)
            if cells is not None:
                update = self._archive.apply_batch(cells, first_tid, step_array)
                new, improved = update.new_cells, update.improved
                self._utilities.apply_batch(
                    update.cell_ids,
                    cells.pair_ep,
                    cells.pair_cell,
                    pair_sums,
                    signs,
                    len(self._archive),
                )
                released_ep, rel_tid = update.released_ep, update.released_tid
                rel_count = update.released_count
            repository = self._repository
            # Only episodes that release or keep a trajectory, or start from a reference, do
            # anything here; every other non-empty one is just counted as discarded.
            nonempty = lengths > 0
            active = nonempty & (improved > 0)
            active[released_ep] = True
            active[with_ref] = True
            repository.discard(int(np.count_nonzero(nonempty & (improved == 0))))
            rel_bounds = np.searchsorted(released_ep, np.arange(count + 1)).tolist()
            rel_tid, rel_count = rel_tid.tolist(), rel_count.tolist()
            improved_list, length_list = improved.tolist(), lengths.tolist()
            for i in np.flatnonzero(active).tolist():
                length = length_list[i]
                if length:
                    a, b = rel_bounds[i], rel_bounds[i + 1]
                    if b > a:
                        repository.release(dict(zip(rel_tid[a:b], rel_count[a:b], strict=True)))
                    n = improved_list[i]
                    if n:
                        deferred = source.deferred(i)
                        if deferred is not None:
                            repository.add_deferred(first_tid + i, deferred, length, n)
                        else:
                            blob = encode_episode(
                                source.episode(i), compressor=repository.compressor
                            )
                            repository.add(first_tid + i, blob, length, n)
                ref = refs[i]
                if ref is not None:
                    self._curriculum.count_midpoint_start(self._start_cell(ref))
            c = self._counters
            c["episodes"] += count
            c["steps"] += int(offsets[-1])
            if count:
                c["last_new_cells"], c["last_improved"] = int(new[-1]), int(improved[-1])
        return BatchResult(first_tid, codes, new, improved)

    def _utilities_signs(self, codes: np.ndarray) -> list[np.ndarray | None]:
        """Per utility, the (E,) sign of each episode's outcome, or None when all are 0."""
        out: list[np.ndarray | None] = []
        for table in self._sign_tables:
            signs = np.asarray(table, dtype=np.float64)[codes]
            out.append(signs if signs.any() else None)
        return out

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
            cell = self._pending[(tid, step)] = tuple(self._archive.keys[i].tolist())
            self._pending.move_to_end((tid, step))
            while len(self._pending) > _MAX_PENDING_STARTS:
                self._pending.popitem(last=False)
        if blob is None:
            raise RuntimeError(f"trajectory store: cell {i} references missing trajectory {tid}")
        return TrajectorySliceReference(tid, step, cell), decode_episode(blob).prefix(step)

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

    def archive_columns(self) -> dict[str, np.ndarray]:
        """Copies of the archive, one row per cell in first-seen order, taken under one lock:
        ``keys`` (N, F), the per-cell columns (``visits``, ``times_chosen``,
        ``first_seen_step``, ``best_trajectory``, ``best_step``, ``best_return``...),
        ``utility/<name>`` sums, and ``midpoint_starts``."""
        with self._lock:
            n = len(self._archive)
            out = self._archive.state_arrays()
            out.update(self._utilities.state_arrays(n))
            keys = out["keys"]
            counts = self._curriculum.midpoint_counts
            mid = [counts.get(k, 0) for k in map(tuple, keys.tolist())] if counts else []
        out["midpoint_starts"] = np.array(mid, dtype=np.int64) if mid else np.zeros(n, np.int64)
        return out

    def cell_keys(self) -> list[TrajectoryKey]:
        """Every cell key, in first-seen order."""
        with self._lock:
            return list(map(tuple, self._archive.view("keys").tolist()))

    def trajectory(self, trajectory_id: int) -> EpisodeArrays | None:
        """A stored trajectory decoded, or None when not (or no longer) stored."""
        with self._lock:
            blob = self._repository.blob(trajectory_id)
        return None if blob is None else decode_episode(blob)

    def encode_deferred(self) -> None:
        """Encode every stored trajectory still read from a session's chunks (before those
        chunks go: a session reset)."""
        with self._lock:
            self._repository.encode_deferred()

    def trajectory_ids(self) -> list[int]:
        with self._lock:
            return self._repository.ids()

    def metrics(self) -> dict[str, float]:
        """Store-derived metric values (tag suffixes, without the ``Trajectories/`` prefix).

        The per-cell gauges (start entropy, utility mean and max) cost O(cells) and this runs at
        every episode boundary: above _GAUGE_CELLS cells they are recomputed at most once per
        _GAUGE_PERIOD seconds and repeated in between; everything else is always current."""
        with self._lock:
            out = {
                "archive_cells": float(len(self._archive)),
                "archive_new_cells_last_episode": float(self._counters["last_new_cells"]),
                "archive_improved_cells_last_episode": float(self._counters["last_improved"]),
                "store_episodes": float(self._counters["episodes"]),
                "store_steps": float(self._counters["steps"]),
                "curriculum_starts": float(self._curriculum.starts),
                "curriculum_midpoint_starts": float(self._curriculum.midpoint_total),
                "curriculum_midpoint_start_cells": float(len(self._curriculum.midpoint_counts)),
                "curriculum_unresolved_midpoint_starts": float(
                    self._curriculum.unresolved_midpoint_starts
                ),
                **self._repository.stats(),
            }
            now = time.monotonic()
            cached = self._gauges
            fresh = (
                cached is None
                or len(self._archive) <= _GAUGE_CELLS
                or now - cached[0] >= _GAUGE_PERIOD
            )
            if fresh:
                times = self._archive.view("times_chosen").copy()
                visits = self._archive.view("visits").astype(np.float64)
                sums = self._utilities.sums[:, : len(visits)].copy()
        if fresh:
            gauges = {
                "curriculum_start_entropy": curriculum_mod.entropy(
                    times, self._config.selection_power
                )
            }
            for u, name in enumerate(self._utilities.names):
                values = sums[u] / visits if len(visits) else np.zeros(1)
                gauges[f"utility/{name}/mean"] = float(values.mean())
                gauges[f"utility/{name}/max"] = float(values.max())
            self._gauges = cached = (now, gauges)
        out.update(cached[1])
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
            self._curriculum.set_midpoint_counts(midpoint)
            self._gauges = None  # a loaded archive's gauges are computed afresh
            self._curriculum.unresolved_midpoint_starts = counters.pop(
                "unresolved_midpoint_starts", 0
            )
            self._counters.update({k: v for k, v in counters.items() if k in self._counters})
            self._pending.clear()


def _resolve_outcomes(rule: OutcomeRule, codes: np.ndarray, returns: np.ndarray) -> np.ndarray:
    """(E,) int64 codes of :meth:`OutcomeRule.resolve` applied to every episode's code, given
    their returns (0.0 for an empty episode), for the whole batch at once."""
    if rule.kind == "none":
        return codes
    unknown = codes == EpisodeOutcome.UNKNOWN
    if unknown.any():
        derived = np.where(
            returns > rule.threshold,
            int(EpisodeOutcome.WIN),
            np.where(returns < -rule.threshold, int(EpisodeOutcome.LOSS), int(EpisodeOutcome.DRAW)),
        )
        codes = np.where(unknown, derived, codes)
    return codes


def _check_step(step: Any, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(f"{where}: expected an int, got {step!r}")
    return int(step)


def _batch_args(
    steps: Any, outcomes: Any, start_references: Any, count: int
) -> tuple[np.ndarray, np.ndarray, list[TrajectorySliceReference | None]]:
    """A batch's per-episode arguments, checked: (steps (E,), outcome codes (E,), references)."""
    return (
        _batch_steps(steps, count),
        _batch_outcomes(outcomes, count),
        _batch_references(start_references, count),
    )


def _batch_steps(steps: Any, count: int) -> np.ndarray:
    """(E,) int64 global steps from one int or one per episode."""
    if isinstance(steps, (int, np.integer)) and not isinstance(steps, bool):
        return np.full(count, int(steps), dtype=np.int64)
    if isinstance(steps, np.ndarray) and steps.dtype.kind in "iu" and steps.ndim == 1:
        values = steps.astype(np.int64)
    elif isinstance(steps, Sequence) and not isinstance(steps, str):
        if count == 1 and len(steps) == 1:
            return np.array([_check_step(steps[0], "step")], dtype=np.int64)
        values = np.array(
            [_check_step(s, f"steps[{i}]") for i, s in enumerate(steps)], dtype=np.int64
        )
    else:
        raise ValueError(f"steps: expected an int or one int per episode, got {steps!r}")
    if values.shape[0] != count:
        raise ValueError(f"steps: expected {count} values (one per episode), got {len(values)}")
    return values


def _batch_outcomes(outcomes: Any, count: int) -> np.ndarray:
    """(E,) int64 outcome codes, one per episode, from one outcome (enum, code or name) or a
    sequence (or int array) of them; each checked as EpisodeOutcome.coerce checks it."""
    if isinstance(outcomes, (EpisodeOutcome, int, str, np.integer)):
        value = int(outcomes) if isinstance(outcomes, np.integer) else outcomes
        return np.full(count, int(EpisodeOutcome.coerce(value)), dtype=np.int64)
    if isinstance(outcomes, np.ndarray):
        if outcomes.ndim == 1 and outcomes.dtype.kind in "iu" and outcomes.shape[0] == count:
            # Int codes: a range check (out-of-range codes take the checked path).
            if not count or (outcomes.min() >= 0 and outcomes.max() < len(_OUTCOMES)):
                return outcomes.astype(np.int64)
        outcomes = outcomes.tolist()
    if not isinstance(outcomes, Sequence):
        raise ValueError(f"outcomes: expected an outcome or one per episode, got {outcomes!r}")
    if len(outcomes) != count:
        raise ValueError(
            f"outcomes: expected {count} values (one per episode), got {len(outcomes)}"
        )
    coerce = EpisodeOutcome.coerce
    return np.fromiter(
        (o if type(o) is EpisodeOutcome else coerce(o) for o in outcomes),
        dtype=np.int64,
        count=count,
    )


def _batch_references(refs: Any, count: int) -> list[TrajectorySliceReference | None]:
    if refs is None:
        return [None] * count
    if not isinstance(refs, Sequence) or isinstance(refs, (str, TrajectorySliceReference)):
        raise ValueError(f"start_references: expected None or one per episode, got {refs!r}")
    if len(refs) != count:
        raise ValueError(
            f"start_references: expected {count} values (one per episode), got {len(refs)}"
        )
    for ref in refs:
        if ref is not None and not isinstance(ref, TrajectorySliceReference):
            raise ValueError(f"start_reference: expected a TrajectorySliceReference, got {ref!r}")
    return list(refs)


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
