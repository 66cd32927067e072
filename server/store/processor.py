"""TrajectoryCaptureProcessor: finished episodes -> trajectory-store updates and metrics.

API from ``seeds/trajectory_capture_processor_api.txt``. With trajectory training disabled
(``store is None``) the processor still counts every episode it is given and still emits the
``Trajectories/*`` capture counters from :meth:`log_metrics`; :meth:`snapshot_potential` then
returns ``{}``, :meth:`sample_start` ``None``, and the checkpoint file is ``None``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zstandard

from recorder_client._wire import shown
from recorder_client.capture_types import (
    CheckpointFile,
    EpisodeOutcome,
    TrajectoryKey,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
)

from . import codec
from .curriculum import start_weights
from .sources import EpisodeArrays, EpisodeSource, as_source
from .store import TrajectoryStore, decode_checkpoint_state, encode_checkpoint_state

logger = logging.getLogger(__name__)

RUNTIME_FORMAT = "recorder.capture_runtime.v1"
METRIC_PREFIX = "Trajectories/"


class MetricsLogger(Protocol):
    """The one method the processor calls on its metrics object."""

    def log_many(self, values: dict[str, float], step: int) -> None: ...


def build_store(
    configuration: TrajectoryTrainingConfiguration | None, *, seed: int | None = None
) -> TrajectoryStore | None:
    """A store for the configuration, or None when trajectory training is disabled."""
    return None if configuration is None else TrajectoryStore(configuration, seed=seed)


def _new_counters() -> dict[str, int]:
    counters = {"episodes_captured": 0, "steps_captured": 0, "midpoint_start_episodes": 0}
    counters.update({f"outcome_{o.name.lower()}": 0 for o in EpisodeOutcome})
    return counters


class TrajectoryCaptureProcessor:
    """Converts finished episodes into store updates; see the module docstring."""

    def __init__(
        self,
        configuration: TrajectoryTrainingConfiguration | None,
        metrics: MetricsLogger,
        store: TrajectoryStore | None,
    ) -> None:
        if store is not None:
            if configuration is None:
                configuration = store.configuration
            elif configuration != store.configuration:
                raise ValueError(
                    "configuration: differs from the store's configuration "
                    f"({configuration!r} != {store.configuration!r})"
                )
        self._configuration = configuration
        self._metrics = metrics
        self._store = store
        self._lock = threading.Lock()
        self._counters = _new_counters()

    @property
    def store(self) -> TrajectoryStore | None:
        """The shared trajectory store, or None when trajectory training is disabled."""
        return self._store

    @property
    def configuration(self) -> TrajectoryTrainingConfiguration | None:
        return self._configuration

    def record_episode(
        self,
        trajectory_file: EpisodeArrays | Mapping[str, Any],
        episode_data: dict[str, float],
        step: int,
        *,
        outcome: EpisodeOutcome | int | str,
        start_reference: TrajectorySliceReference | None = None,
    ) -> None:
        """Record one finished episode (EpisodeArrays, or a mapping of actions/rewards/states).

        ``episode_data`` is accepted for API compatibility and not interpreted. An UNKNOWN
        outcome goes through the configured OutcomeRule. Invalid input raises ValueError before
        any counter moves. (A batch of one: see :meth:`record_episodes`.)
        """
        if episode_data is not None and not isinstance(episode_data, Mapping):
            raise ValueError(f"episode_data: expected a mapping, got {type(episode_data)}")
        if self._store is None:
            self.record_episodes(
                [trajectory_file],
                step,
                outcomes=[outcome],
                start_references=None if start_reference is None else [start_reference],
            )
            return
        episode = EpisodeArrays.coerce(trajectory_file)
        record = self._store.record_episode(
            episode, step=step, outcome=outcome, start_reference=start_reference
        )
        codes = np.array([int(record.outcome)], dtype=np.int64)
        self._count(1, episode.length, codes, int(start_reference is not None))

    def record_episodes(
        self,
        episodes: EpisodeSource | Sequence[EpisodeArrays | Mapping[str, Any]],
        steps: int | Sequence[int] | np.ndarray,
        *,
        outcomes: Sequence[EpisodeOutcome | int | str] | np.ndarray | EpisodeOutcome | int | str,
        start_references: Sequence[TrajectorySliceReference | None] | None = None,
    ) -> int | None:
        """Record several finished episodes: the batch twin of :meth:`record_episode`, with
        store contents and counters identical to calling it for each episode in order.
        Returns the store's trajectory id of the first episode (the others follow it in
        order), or None without a store.

        ``episodes`` is any EpisodeSource (an EpisodeWindow or EpisodeColumns fetch the full
        arrays only of the episodes the repository keeps: the cheapest forms) or a sequence
        of episodes. ``steps`` and ``outcomes`` give one value for all episodes or one per
        episode (outcomes may be an int array of codes); ``start_references`` is None or one
        (optional) reference per episode. The whole batch is validated before anything is
        recorded or counted (ValueError). Without a store only the counters move, with O(1)
        work per episode.
        """
        source = as_source(episodes)
        count = len(source)
        midpoints = 0
        if start_references is not None:
            if not isinstance(start_references, Sequence) or len(start_references) != count:
                raise ValueError(
                    f"start_references: expected None or {count} entries (one per episode)"
                )
            midpoints = sum(r is not None for r in start_references)
        first = None
        if self._store is None:
            codes = self._resolve_without_store(source, steps, outcomes)
        else:
            result = self._store.record(
                source, steps=steps, outcomes=outcomes, start_references=start_references
            )
            codes, first = result.codes, result.first_trajectory_id
        self._count(count, int(source.offsets[-1]), codes, midpoints)
        return first

    def count_episodes(self, lengths: np.ndarray, outcomes: np.ndarray) -> None:
        """Without a store (so without an outcome rule): count finished episodes by their
        lengths and int outcome codes, as record_episodes would, without their arrays."""
        if self._store is not None or self._configuration is not None:
            raise ValueError("count_episodes: expected a processor without a store")
        codes = np.asarray(outcomes).astype(np.int64, copy=False).reshape(-1)
        if codes.size != lengths.size:
            raise ValueError(f"outcomes: expected {lengths.size} codes, got {codes.size}")
        bad = (codes < 0) | (codes >= len(EpisodeOutcome))
        if bad.any():
            EpisodeOutcome.coerce(int(codes[bad][0]))  # raises with the usual message
        self._count(int(lengths.size), int(lengths.sum()), codes, 0)

    def _count(self, episodes: int, steps: int, codes: np.ndarray, midpoints: int) -> None:
        """Add recorded episodes to the capture counters (``codes``: their outcome codes)."""
        per_outcome = np.bincount(codes, minlength=len(EpisodeOutcome)).tolist()
        with self._lock:
            c = self._counters
            c["episodes_captured"] += episodes
            c["steps_captured"] += steps
            for o, n in zip(EpisodeOutcome, per_outcome, strict=True):
                if n:
                    c[f"outcome_{o.name.lower()}"] += n
            c["midpoint_start_episodes"] += midpoints

    def _resolve_without_store(
        self, source: EpisodeSource, steps: Any, outcomes: Any
    ) -> np.ndarray:
        """Without a store: validate the steps and outcomes as the store would and return the
        (E,) int64 outcome codes after the configured rule (numpy work for an int array of
        codes, a few Python operations per episode otherwise)."""
        count = len(source)
        if isinstance(steps, np.ndarray) and steps.dtype.kind in "iu" and steps.shape == (count,):
            pass
        elif isinstance(steps, Sequence) and not isinstance(steps, str):
            if len(steps) != count:
                raise ValueError(f"steps: expected an int or {count} ints (one per episode)")
            for one in steps:
                _check_int_step(one)
        else:
            _check_int_step(steps)
        if isinstance(outcomes, np.ndarray) and outcomes.dtype.kind in "iu":
            codes = outcomes.astype(np.int64).reshape(-1)
            if codes.shape[0] != count:
                raise ValueError(f"outcomes: expected {count} codes, got {codes.shape[0]}")
            bad = (codes < 0) | (codes >= len(EpisodeOutcome))
            if bad.any():
                EpisodeOutcome.coerce(int(codes[bad][0]))  # raises with the usual message
        elif isinstance(outcomes, (EpisodeOutcome, int, str, np.integer)):
            one = EpisodeOutcome.coerce(
                int(outcomes) if isinstance(outcomes, np.integer) else outcomes
            )
            codes = np.full(count, int(one), dtype=np.int64)
        elif isinstance(outcomes, Sequence) and len(outcomes) == count:
            codes = np.fromiter(
                (EpisodeOutcome.coerce(o) for o in outcomes), dtype=np.int64, count=count
            )
        else:
            raise ValueError(f"outcomes: expected an outcome or {count} (one per episode)")
        rule = None if self._configuration is None else self._configuration.outcome_rule
        if rule is not None and rule.kind != "none":
            for i in np.flatnonzero(codes == EpisodeOutcome.UNKNOWN).tolist():
                rewards = source.episode(i).rewards
                episode_return = float(np.sum(rewards, dtype=np.float64))
                codes[i] = rule.resolve(EpisodeOutcome.UNKNOWN, episode_return)
        return codes

    def sample_start(self) -> tuple[TrajectorySliceReference, EpisodeArrays] | None:
        """A curriculum start (reference + prefix); None without a store or cells."""
        return None if self._store is None else self._store.sample_start()

    def archive_table(self) -> dict[str, np.ndarray] | None:
        """The cell archive as numpy columns, one row per cell in first-seen order; None
        without a store. Keys: ``cell:<field name>`` (int64) per cell-key field, ``visits``,
        ``times_chosen``, ``first_seen_step`` (the step passed with the episode that first
        reached the cell), ``midpoint_starts`` (int64); ``best_return`` (float64, the
        cumulative reward up to and including the best reference's step),
        ``best_length`` (int64, steps of that prefix: ``best_step + 1``),
        ``best_trajectory_id`` and ``best_step`` (the best reference, int64);
        ``selection_probability`` (float64, the chance sample_start picks the cell now) and
        ``utility:<name>`` (float64, the utility's net value: sum / visits) per utility."""
        store = self._store
        if store is None:
            return None
        cols = store.archive_columns()
        keys = cols["keys"]
        visits = cols["visits"]
        times = cols["times_chosen"]
        table = {f"cell:{name}": keys[:, i].copy() for i, name in enumerate(store.key_names)}
        table["visits"] = visits
        table["times_chosen"] = times
        table["first_seen_step"] = cols["first_seen_step"]
        table["best_return"] = cols["best_return"]
        table["best_length"] = cols["best_step"] + 1
        table["best_trajectory_id"] = cols["best_trajectory"]
        table["best_step"] = cols["best_step"]
        table["midpoint_starts"] = cols["midpoint_starts"]
        weights = start_weights(times, store.configuration.selection_power)
        total = weights.sum()
        table["selection_probability"] = weights / total if total > 0 else weights
        divisor = np.maximum(visits, 1).astype(np.float64)
        for name in store.utility_names:
            table[f"utility:{name}"] = cols[f"utility/{name}"] / divisor
        return table

    def log_metrics(self, step: int) -> None:
        """Emit every ``Trajectories/*`` metric in one ``metrics.log_many`` call."""
        self._metrics.log_many(self.metric_values(), step)

    def metric_values(self) -> dict[str, float]:
        """Every ``Trajectories/*`` metric by its tag: what `log_metrics` logs."""
        with self._lock:
            values = {METRIC_PREFIX + k: float(v) for k, v in self._counters.items()}
        values[METRIC_PREFIX + "store_enabled"] = float(self._store is not None)
        if self._store is not None:
            values.update({METRIC_PREFIX + k: v for k, v in self._store.metrics().items()})
        return values

    def snapshot_potential(
        self, utility_key: str, field_names: list[str]
    ) -> dict[tuple[int, ...], float]:
        """``{(field values): net value}`` fresh dict (see TrajectoryStore.snapshot_potential);
        ``{}`` when the store is None."""
        if self._store is None:
            return {}
        return self._store.snapshot_potential(utility_key, field_names)

    def runtime_state_dict(self) -> dict[str, Any]:
        """JSON-able capture counters and curriculum state (generator, start count)."""
        with self._lock:
            counters = dict(self._counters)
        curriculum = None if self._store is None else self._store.curriculum_state()
        return {"format": RUNTIME_FORMAT, "counters": counters, "curriculum": curriculum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`runtime_state_dict` output, checked like live input (ValueError
        naming the field): known counter names only (a missing one starts at zero), each an
        int in [0, 2**63), and a well-formed generator state. Curriculum state is ignored
        when this processor has no store."""
        if not isinstance(state, Mapping) or state.get("format") != RUNTIME_FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"state: expected format {RUNTIME_FORMAT!r}, got {shown(got)}")
        saved = state.get("counters") or {}
        if not isinstance(saved, Mapping):
            raise ValueError(f"state.counters: expected a mapping, got {type(saved).__name__}")
        counters = _new_counters()
        unknown = sorted(str(name) for name in saved if name not in counters)
        if unknown:
            raise ValueError(
                f"state.counters: expected names from {sorted(counters)}, got {shown(unknown[0])}"
            )
        for name, value in saved.items():
            counters[name] = _count(value, f"state.counters.{name}")
        curriculum = state.get("curriculum")
        if curriculum is not None:
            _check_curriculum(curriculum)
        if self._store is not None and curriculum is not None:
            self._store.load_curriculum_state(curriculum)
        with self._lock:
            self._counters = counters

    def trajectory_store_checkpoint_file(
        self,
        compress: bool,
        *,
        checkpoint_step: int,
        midpoint_start_episode_cell_counts: dict[TrajectoryKey, int] | None = None,
    ) -> CheckpointFile | None:
        """The store as one CheckpointFile (bytes in ``data``); None without a store.

        ``midpoint_start_episode_cell_counts``, when given, is written instead of the store's
        own per-cell midpoint-start counts.
        """
        if self._store is None:
            return None
        if isinstance(checkpoint_step, bool) or not isinstance(checkpoint_step, int):
            raise ValueError(f"checkpoint_step: expected an int, got {checkpoint_step!r}")
        state = self._store.checkpoint_state(midpoint_start_episode_cell_counts)
        data = encode_checkpoint_state(state, bool(compress))
        name = f"trajectory_store-step{checkpoint_step:012d}.bin" + (".zst" if compress else "")
        return CheckpointFile(
            name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest(), data=data
        )

    def load_trajectory_store_checkpoint_data(
        self, state: dict[str, Any] | bytes | CheckpointFile, *, max_bytes: int | None = None
    ) -> None:
        """Restore the store from a checkpoint: the decoded dict, the file's bytes (compressed
        or not), or a CheckpointFile (``data`` or ``path``; size and sha256 are checked).
        ``max_bytes`` bounds the file's bytes as given and as decompressed (checked before
        anything is inflated). Without a store this logs a warning and does nothing."""
        if self._store is None:
            logger.warning("trajectory store checkpoint ignored: trajectory training is disabled")
            return
        if isinstance(state, CheckpointFile):
            data = state.data if state.data is not None else _read(state.path)
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != state.size or digest != state.sha256:
                raise ValueError(
                    f"checkpoint file {shown(state.name)}: expected {state.size} bytes with "
                    f"sha256 {state.sha256}, got {len(data)} bytes with sha256 {digest}"
                )
            state = data
        if isinstance(state, (bytes, bytearray, memoryview)):
            if max_bytes is not None:
                check_checkpoint_size(state, max_bytes)
            state = decode_checkpoint_state(state)
        self._store.load_checkpoint_state(state)


def check_checkpoint_size(data: bytes | bytearray | memoryview, max_bytes: int) -> None:
    """ValueError unless a store checkpoint file's bytes, and its content when they are one
    zstd frame, are at most ``max_bytes`` (read from the frame header, nothing inflated)."""
    if len(data) > max_bytes:
        raise ValueError(
            f"trajectory store checkpoint: expected at most {max_bytes} bytes, got {len(data)}"
        )
    if bytes(data[:4]) != codec.ZSTD_MAGIC:
        return
    try:
        declared = zstandard.frame_content_size(bytes(data[:18]))
    except zstandard.ZstdError as exc:
        raise ValueError(f"trajectory store checkpoint: corrupt zstd frame ({exc})") from None
    if not 0 <= declared <= max_bytes:
        got = "no size" if declared < 0 else f"{declared} bytes"
        raise ValueError(
            f"trajectory store checkpoint: expected a zstd frame of at most {max_bytes} bytes, "
            f"it declares {got}"
        )


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{what}: expected an int in [0, 2**63), got {shown(value)}")
    return value


def _check_curriculum(state: Any) -> None:
    """ValueError naming the field unless ``state`` is a curriculum runtime state whose every
    value is in range (the generator would otherwise take or choke on it)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state.curriculum: expected a mapping, got {type(state).__name__}")
    _count(state.get("starts"), "state.curriculum.starts")
    _count(
        state.get("unresolved_midpoint_starts", 0), "state.curriculum.unresolved_midpoint_starts"
    )
    rng = state.get("rng")
    if not isinstance(rng, Mapping) or rng.get("bit_generator") != "PCG64":
        raise ValueError(
            f"state.curriculum.rng: expected a PCG64 generator state, got {shown(rng)}"
        )
    for name in ("state", "inc"):
        text = rng.get(name)
        if not isinstance(text, str) or not text.isdigit() or len(text) > 39 or int(text) >> 128:
            raise ValueError(
                f"state.curriculum.rng.{name}: expected a decimal string of an int in "
                f"[0, 2**128), got {shown(text)}"
            )
    for name, bound in (("has_uint32", 2), ("uinteger", 1 << 32)):
        value = rng.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
            raise ValueError(
                f"state.curriculum.rng.{name}: expected an int in [0, {bound}), got {shown(value)}"
            )


def _check_int_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(f"step: expected an int, got {step!r}")


def _read(path: str | None) -> bytes:
    if path is None:
        raise ValueError("checkpoint file: has neither data nor path")
    return Path(path).read_bytes()
