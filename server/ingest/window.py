"""The store path's per-step window: every held step's cell keys and reward, in place.

Worker w's environments are rows ``w.row ...`` (env-major: an episode's steps lie back to back
but for one wrap) of a ring of ``capacity`` steps, time t at column ``t % capacity``: cell-key
columns (F, R, C), rewards (R, C) and, once some step could not be keyed, a (R, C) flag of
such steps. One ring for the whole session, so that chunks of several workers are recorded
in one store call; the store reads finished episodes straight from it (`EpisodeWindow`).

Keys are stored in the narrowest of int16 / int32 / int64 that holds every key so far, and
rewards as float32 while every reward is exactly a float32 (else float64); never narrowed
back. Keys on a grid usually fit int16, which quarters the bytes the window writes and reads.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from recorder_client._wire import STATE_ALIASES

from ..store import TrajectoryStore, find_state, kernels

# Reward dtypes whose every value float32 holds exactly (stored as float32).
_FLOAT32_EXACT = frozenset(
    np.dtype(t) for t in (np.float32, np.float16, np.bool_, np.int8, np.uint8, np.int16, np.uint16)
)
# Key dtypes of the window, narrowest first.
_KEY_TYPES = (np.int16, np.int32, np.int64)
# State dtypes whose cell keys are written into the window in one compiled pass.
_RING_SOURCES = frozenset(np.dtype(t) for t in (np.int32, np.int64))


class Rows(Protocol):
    """A worker's place in the ring: rows ``row .. row + num_envs``, holding its steps from
    ``first`` (its oldest held step) up to ``end``."""

    row: int
    num_envs: int
    end: int

    @property
    def first(self) -> int: ...


class Ring:
    def __init__(self) -> None:
        self.rows = 0  # in use; the arrays may have more (never touched, so never faulted in)
        self.capacity = 0
        self.columns: np.ndarray | None = None
        self.rewards: np.ndarray | None = None
        self.flagged: np.ndarray | None = None

    def add_worker(self, worker: Rows) -> None:
        """Give a new worker its rows (the other workers' rows keep their steps)."""
        used = worker.row = self.rows
        self.rows += worker.num_envs
        if self.columns is None or self.rows <= self.rewards.shape[0]:
            return
        rows = max(self.rows, 2 * self.rewards.shape[0])
        self.columns = _with_rows(self.columns, rows, used)
        self.rewards = _with_rows(self.rewards, rows, used)
        if self.flagged is not None:
            self.flagged = _with_rows(self.flagged, rows, used)

    def write(
        self,
        store: TrajectoryStore,
        workers: Iterable[Rows],
        worker: Rows,
        t0: int,
        arrays: Mapping[str, np.ndarray],
    ) -> ValueError | None:
        """Key one chunk's steps (t0 .. t0+T) into ``worker``'s rows, growing or widening the
        ring as needed. Returns why some steps could not be keyed (they are flagged), or None.
        """
        rewards = np.asarray(arrays["reward"])
        length, num_envs = rewards.shape
        width = len(store.configuration.cell_fields)
        sources = key_sources(store, arrays)
        error = None
        if sources is None:
            columns, flagged, error = chunk_columns(store, arrays, length * num_envs)
            col_type, rew_type = self._types(columns, rewards)
        else:
            # Every cell field is an integer state: keyed straight into the ring below.
            columns = flagged = None
            col_type = _KEY_TYPES[0] if self.columns is None else self.columns.dtype.type
            rew_type = self._reward_type(rewards)
        span = t0 + length - worker.first
        if span > self.capacity:
            self._grow(workers, span, width, length, col_type, rew_type)
        else:
            if self.columns.dtype != col_type:
                self.columns = widened(self.columns, col_type)
            if self.rewards.dtype != rew_type:
                self.rewards = widened(self.rewards, rew_type)
        cap, rows = self.capacity, slice(worker.row, worker.row + num_envs)
        if columns is not None:
            columns = columns.reshape(width, length, num_envs).transpose(0, 2, 1)
        else:
            self._key(rows, sources, t0)
        rewards = rewards.T
        if flagged is not None:
            flagged = flagged.reshape(length, num_envs).T
            if self.flagged is None:
                self.flagged = np.zeros(self.rewards.shape, dtype=bool)
        for t, a, b in pieces(t0, t0 + length, cap):
            src = slice(t - t0, t - t0 + b - a)
            if columns is not None:
                self.columns[:, rows, a:b] = columns[:, :, src]
            self.rewards[rows, a:b] = rewards[:, src]
            if self.flagged is not None:
                self.flagged[rows, a:b] = False if flagged is None else flagged[:, src]
        worker.end = t0 + length
        return error

    def flagged_step(self, rows: np.ndarray, start: np.ndarray, lengths: np.ndarray) -> int | None:
        """The first flagged step (on the workers' time axes) of these episodes, or None."""
        if self.flagged is None:
            return None
        total = int(lengths.sum())
        bad = np.empty((1, total), dtype=bool)
        bad = kernels.gather_ring(self.flagged[None], rows, start, lengths, self.capacity, bad)[0]
        if not bad.any():
            return None
        offsets = np.cumsum(lengths) - lengths
        steps = np.repeat(start, lengths) + (
            np.arange(total, dtype=np.int64) - np.repeat(offsets, lengths)
        )
        return int(steps[int(np.argmax(bad))])

    def _grow(
        self, workers: Iterable[Rows], span: int, width: int, length: int, col_type, rew_type
    ) -> None:
        """Reallocate for at least ``span`` steps, keeping every worker's held steps."""
        old_cap = self.capacity
        # Episodes span many chunks: start roomy so warm-up does not regrow and copy often.
        cap = max(span, 2 * old_cap, 64 * length, 1)
        # Rows for workers joining later; rows never written are never faulted in.
        rows = max(self.rows, 0 if self.rewards is None else self.rewards.shape[0], 4 * self.rows)
        columns = small_pages((width, rows, cap), col_type)
        rewards = small_pages((rows, cap), rew_type)
        flagged = None if self.flagged is None else small_pages((rows, cap), bool)
        for worker in workers:
            first = worker.first
            if not old_cap or first >= worker.end:
                continue
            block = slice(worker.row, worker.row + worker.num_envs)
            for t, a, b in pieces(first, worker.end, old_cap):
                for u, c, d in pieces(t, t + b - a, cap):
                    src = slice(a + u - t, a + u - t + d - c)
                    columns[:, block, c:d] = self.columns[:, block, src]
                    rewards[block, c:d] = self.rewards[block, src]
                    if flagged is not None:
                        flagged[block, c:d] = self.flagged[block, src]
        self.capacity, self.columns, self.rewards, self.flagged = cap, columns, rewards, flagged

    def _key(self, rows: slice, sources: list[tuple], t0: int) -> None:
        """Key a chunk's steps into rows (columns t0...), widening the key dtype first when
        some key does not fit it."""
        while True:
            lows, highs = zip(
                *(
                    kernels.ring_keys(src, shift, bucket, self.columns[j, rows], t0, self.capacity)
                    for j, (src, shift, bucket) in enumerate(sources)
                ),
                strict=True,
            )
            key_type = self._key_type(min(lows), max(highs))
            if key_type == self.columns.dtype:
                return
            self.columns = widened(self.columns, key_type)  # then this chunk again

    def _key_type(self, low: int, high: int) -> type:
        """The narrowest key dtype, no narrower than the current one, holding low..high."""
        rank = 0 if self.columns is None else _KEY_TYPES.index(self.columns.dtype.type)
        while rank < len(_KEY_TYPES) - 1:
            info = np.iinfo(_KEY_TYPES[rank])
            if info.min <= low and high <= info.max:
                break
            rank += 1
        return _KEY_TYPES[rank]

    def _reward_type(self, rewards: np.ndarray) -> type:
        wide = self.rewards is not None and self.rewards.dtype == np.float64
        return np.float64 if wide or rewards.dtype not in _FLOAT32_EXACT else np.float32

    def _types(self, columns: np.ndarray, rewards: np.ndarray) -> tuple[type, type]:
        key_type = _KEY_TYPES[0] if self.columns is None else self.columns.dtype.type
        if key_type != _KEY_TYPES[-1] and columns.size:
            lows, highs = kernels.key_bounds(columns)
            key_type = self._key_type(int(lows.min()), int(highs.max()))
        return key_type, self._reward_type(rewards)


def key_sources(store: TrajectoryStore, arrays: Mapping[str, np.ndarray]) -> list[tuple] | None:
    """Per cell field, its (T, N) integer state column and (shift, bucket) for
    kernels.ring_keys; None when some field takes the general path (another dtype, or a
    field missing or misshapen: that path says what is wrong)."""
    states = {k[6:]: v for k, v in arrays.items() if k.startswith("state:")}
    sources = []
    for spec in store.configuration.cell_fields:
        arr = find_state(states, spec.state_field)
        if (
            arr is None
            or arr.dtype not in _RING_SOURCES
            or arr.ndim != 2 + len(spec.index)
            or any(i >= m for i, m in zip(spec.index, arr.shape[2:], strict=True))
        ):
            return None
        bucket = spec.bucket
        # Floor division by a power of two is an arithmetic shift.
        rule = (bucket.bit_length() - 1, 0) if bucket & (bucket - 1) == 0 else (0, bucket)
        sources.append((arr[(slice(None), slice(None), *spec.index)], *rule))
    return sources


def chunk_columns(
    store: TrajectoryStore, arrays: Mapping[str, np.ndarray], total: int
) -> tuple[np.ndarray, np.ndarray | None, ValueError | None]:
    """(F, T*N) cell-key columns of a chunk's steps, a (T*N,) flag of the steps that could not
    be keyed (None: all could) and why. Non-finite float cell fields flag only their steps
    (as if recorded per episode); anything else flags the whole chunk."""
    flat = {
        k[6:]: a.reshape(total, *a.shape[2:]) for k, a in arrays.items() if k.startswith("state:")
    }
    try:
        return store.step_columns(flat, total), None, None
    except ValueError as exc:
        error = exc
    flagged = np.zeros(total, dtype=bool)
    for spec in store.configuration.cell_fields:
        name = spec.state_field if spec.state_field in flat else STATE_ALIASES.get(spec.state_field)
        arr = flat.get(name) if name is not None else None
        if arr is None or arr.dtype.kind != "f" or arr.ndim != 1 + len(spec.index):
            continue
        if any(i >= m for i, m in zip(spec.index, arr.shape[1:], strict=True)):
            continue
        where = (slice(None), *spec.index)
        bad = ~np.isfinite(arr[where])
        if bad.any():
            arr = arr.copy()
            arr[where][bad] = 0
            flat[name] = arr
            flagged |= bad
    try:
        columns = store.step_columns(flat, total)
    except ValueError:
        columns = np.zeros((len(store.configuration.cell_fields), total), dtype=np.int64)
        flagged[:] = True
    return columns, flagged, error


def small_pages(shape: Sequence[int], dtype) -> np.ndarray:
    """A zeroed array in memory the kernel does not back with huge pages (where it can be
    told so). The ring takes a few hundred bytes per row per chunk across thousands of rows,
    so huge pages save it nothing, while numpy asks for them for arrays of 4 MiB and up: each
    first touch then zeroes 2 MiB, after compacting memory where it is fragmented. That took
    a fresh process's first store call (20 bench chunks) 180 ms instead of 60, with every
    chunk waiting behind it. Pages are faulted in, zeroed, only when first written."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if nbytes == 0 or advice is None:
        return np.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without transparent huge pages refuses the advice
        pass
    return np.frombuffer(region, dtype=dtype).reshape(shape)


def _with_rows(arr: np.ndarray, rows: int, used: int) -> np.ndarray:
    """``arr`` (..., R, C) reallocated with ``rows`` rows, the first ``used`` copied."""
    out = small_pages((*arr.shape[:-2], rows, arr.shape[-1]), arr.dtype)
    out[..., :used, :] = arr[..., :used, :]
    return out


def widened(arr: np.ndarray, dtype) -> np.ndarray:
    """``arr.astype(dtype)``, in memory from :func:`small_pages`."""
    out = small_pages(arr.shape, dtype)
    out[...] = arr
    return out


def pieces(lo: int, hi: int, cap: int) -> list[tuple[int, int, int]]:
    """Times [lo, hi) on a ring of ``cap`` columns as contiguous pieces (time, col_a, col_b)."""
    out = []
    t = lo
    while t < hi:
        a = t % cap
        b = min(cap, a + hi - t)
        out.append((t, a, b))
        t += b - a
    return out
