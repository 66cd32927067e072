"""TrajectoryStore: StoreState (store_state.py) plus the writes: recording episodes, sampling
starts, metrics and checkpoints, each applied under the one writer lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from recorder_client.capture_types import (
    EpisodeOutcome,
    TrajectoryKey,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
)

from . import curriculum as curriculum_mod
from .archive import CellArchive
from .arguments import _batch_args, _check_step, _resolve_outcomes
from .cells import cell_keys, field_column
from .repository import TrajectoryRepository, decode_episode, encode_episode
from .results import BatchResult, CellInfo, EpisodeRecord
from .sources import EpisodeArrays, EpisodeList, EpisodeSource, as_source
from .store_checkpoint import (
    CHECKPOINT_FORMAT,
    _check_refcounts,
    decode_checkpoint_state,
    encode_checkpoint_state,
)
from .store_state import StoreState
from .utilities import UtilityTable

# Re-exported: these names are imported from this module.
__all__ = [
    "CHECKPOINT_FORMAT",
    "BatchResult",
    "CellInfo",
    "EpisodeRecord",
    "TrajectoryStore",
    "decode_checkpoint_state",
    "encode_checkpoint_state",
]

logger = logging.getLogger(__name__)

# sample_start remembers this many handed-out starts so that the episode run from one can be
# credited to its cell without decoding the trajectory again.
_MAX_PENDING_STARTS = 1 << 16
# metrics(): archives above this many cells recompute their O(cells) gauges at most once per
# this many seconds (at 100,000 cells they cost ~2 ms, about the rest of a chunk's store work).
_GAUGE_CELLS = 10_000
_GAUGE_PERIOD = 1.0


class TrajectoryStore(StoreState):
    """Go-Explore-style trajectory store (see DESIGN.md, "Trajectory store")."""

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

    def encode_deferred(self) -> None:
        """Encode every stored trajectory still read from a session's chunks (before those
        chunks go: a session reset)."""
        with self._lock:
            self._repository.encode_deferred()

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
