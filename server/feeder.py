"""Episode boundaries -> trajectory store and metrics, off the ack path.

Every finished episode reaches the capture processor (`record_episode`) and the
metrics, whether or not a trajectory store is configured. Without a store only
lengths, returns and outcomes are needed, computed per chunk with numpy; with a
store each step's cell keys and reward go into a window (the ring) read in place by the
store, and the chunks some open episode still needs are held: as the session keeps them
(encoded), the decode buffers then going straight back to the pool, and a stored episode
read back from them only when first needed; or, given only decoded arrays, those arrays
(an old chunk keeping only the columns of the environments that need it). With a store,
chunks that queued up meanwhile are recorded in one store call, in order: the store's
fixed costs per call are then shared, which is what lets the feeder catch up.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import mmap
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .capture import TrajectoryCaptureProcessor
from .episodes import StoredChunk
from .store import EpisodeArrays, EpisodeBatch, EpisodeWindow, kernels
from .store.cells import _ALIASES
from .store.repository import blob_bound

logger = logging.getLogger(__name__)


@dataclass
class ChunkEpisodes:
    """What the session hands over for one stored chunk."""

    worker: int
    t0: int
    # Decoded: action, reward, done, state:<name>, outcome? Handed over: with a store the
    # feeder empties the dict and recycles the buffers no one else refers to.
    arrays: dict[str, np.ndarray]
    env: np.ndarray
    start: np.ndarray
    end: np.ndarray
    env_steps_before: int  # session env steps before this chunk (the metrics step)
    # The chunk as the session holds it (encoded). When given, the store path keeps this
    # instead of the decoded arrays (their buffers go back to the pool at once), and the
    # episodes it stores are read from it only when first needed (see _HeldEpisode).
    stored: StoredChunk | None = None


class BufferPool:
    """Decode buffers handed back by the store path once no held chunk needs them, for the
    next chunks' decoding: the window keeps tens of decoded chunks per worker, and fresh
    buffers for every chunk would each be faulted in page by page."""

    def __init__(self, max_bytes: int = 128 << 20, stale_takes: int = 256) -> None:
        self.max_bytes = max_bytes
        # A shape no take asked for in this many takes is taken to be no longer sent.
        self.stale_takes = stale_takes
        self._free: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
        self._bytes = 0
        self._takes = 0
        self._last_take: dict[tuple[str, tuple[int, ...]], int] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (np.dtype(dtype).str, tuple(shape))
        with self._lock:
            self._takes += 1
            self._last_take[key] = self._takes
            free = self._free.get(key)
            if free:
                arr = free.pop()
                self._bytes -= arr.nbytes
                return arr
        return np.empty(shape, dtype=dtype)

    def give_all(self, arrays: dict[str, np.ndarray]) -> None:
        """Take every array out of ``arrays`` and keep those nothing else refers to."""
        while arrays:
            _, arr = arrays.popitem()
            # 2: this name and getrefcount's argument (a view or another holder adds more).
            if arr.base is not None or sys.getrefcount(arr) != 2 or not arr.flags.writeable:
                continue
            key = (arr.dtype.str, arr.shape)
            with self._lock:
                if self._bytes + arr.nbytes > self.max_bytes:
                    # Full: stale shapes go; warm buffers of the shapes in use stay for
                    # the next chunks (releases come in bursts), and this one goes.
                    self._drop_stale()
                    if self._bytes + arr.nbytes > self.max_bytes:
                        continue
                self._free.setdefault(key, []).append(arr)
                self._bytes += arr.nbytes

    def _drop_stale(self) -> None:
        oldest = self._takes - self.stale_takes
        for key in [k for k in self._free if self._last_take.get(k, 0) <= oldest]:
            self._bytes -= sum(a.nbytes for a in self._free.pop(key))
        for key in [k for k, t in self._last_take.items() if t <= oldest]:
            del self._last_take[key]


class _Held:
    """One chunk kept for the store path: decoded arrays or the encoded StoredChunk."""

    __slots__ = ("t0", "length", "arrays", "encoded", "nbytes", "error", "columns")

    def __init__(self, t0: int, length: int, arrays, encoded, nbytes: int) -> None:
        self.t0 = t0
        self.length = length
        self.arrays: dict[str, np.ndarray] | None = arrays
        self.encoded: dict | None = encoded
        self.nbytes = nbytes
        self.error: ValueError | None = None  # raised for episodes using flagged steps
        # None: arrays hold every environment; else env -> its column in arrays (-1: dropped,
        # no open episode needs this chunk), see EpisodeFeeder._compact.
        self.columns: np.ndarray | None = None

    def column(self, env: int) -> int:
        if self.columns is None:
            return env
        col = int(self.columns[env])
        if col < 0:
            raise RuntimeError(f"held chunk at t={self.t0}: environment {env} was dropped")
        return col


@dataclass
class _Part:
    """A chunk's finished episodes as the store path records them: rows of the session's
    ring, start times and lengths, a fetch of episode i's full arrays, and which of the
    chunk's episodes these are (kept[i] is False for one too long for the held tail)."""

    rows: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    fetch: Callable[[int], EpisodeArrays]
    kept: np.ndarray
    defer: Callable[[int], _HeldEpisode] | None = None


@dataclass
class _Finished:
    """One processed chunk, waiting to be recorded and logged."""

    item: ChunkEpisodes
    tails: _WorkerTails
    returns: np.ndarray
    lengths: np.ndarray
    outcomes: np.ndarray
    part: _Part | None


@dataclass
class _WorkerTails:
    """Per-environment state of the open episodes of one worker."""

    num_envs: int
    open_start: np.ndarray
    open_return: np.ndarray
    open_code: np.ndarray
    # Recent chunks, oldest first, kept for the store path (see _Held).
    chunks: collections.deque = field(default_factory=collections.deque)
    held_bytes: int = 0
    # The store path: this worker's environments are rows row..row+num_envs of the
    # session's _Ring, which holds its steps from chunks[0].t0 up to `end`.
    row: int = -1
    end: int = 0
    # Held chunks that are decoded arrays (not the session's encoded chunks).
    decoded_held: int = 0
    # The blob size bound of this worker's episodes (its fields are fixed by the session).
    bounds: _BoundCache | None = None

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.num_envs)


class _Ring:
    """The store path's per-step window over every worker's held chunks: worker w's
    environments are rows w.row... (env-major: an episode's steps lie back to back but for
    one wrap) of a ring of `capacity` steps, time t at column t % capacity. Cell-key columns
    (F, R, C), rewards (R, C) and, once some step could not be keyed, a (R, C) flag of such
    steps. One ring for the whole session, so that chunks of several workers are recorded
    in one store call."""

    def __init__(self) -> None:
        self.rows = 0  # in use; the arrays may have more (never touched, so never faulted in)
        self.capacity = 0
        self.columns: np.ndarray | None = None
        self.rewards: np.ndarray | None = None
        self.flagged: np.ndarray | None = None

    def add_worker(self, tails: _WorkerTails) -> None:
        """Give a new worker its rows (the columns of the other workers' rows are kept)."""
        used = tails.row = self.rows
        self.rows += tails.num_envs
        if self.columns is None or self.rows <= self.rewards.shape[0]:
            return
        rows = max(self.rows, 2 * self.rewards.shape[0])
        self.columns = _with_rows(self.columns, rows, used)
        self.rewards = _with_rows(self.rewards, rows, used)
        if self.flagged is not None:
            self.flagged = _with_rows(self.flagged, rows, used)

    def grow(self, workers, span: int, width: int, length: int, col_type, rew_type) -> None:
        """Reallocate for at least ``span`` steps, keeping every worker's held steps."""
        old_cap = self.capacity
        # Episodes span many chunks: start roomy so warm-up does not regrow and copy often.
        cap = max(span, 2 * old_cap, 64 * length, 1)
        # Rows for workers joining later; rows never written are never faulted in.
        rows = max(self.rows, 0 if self.rewards is None else self.rewards.shape[0], 4 * self.rows)
        columns = _small_pages((width, rows, cap), col_type)
        rewards = _small_pages((rows, cap), rew_type)
        flagged = None if self.flagged is None else _small_pages((rows, cap), bool)
        for tails in workers:
            if not old_cap or not tails.chunks or tails.chunks[0].t0 >= tails.end:
                continue
            block = tails.rows
            for t, a, b in _ring_pieces(tails.chunks[0].t0, tails.end, old_cap):
                for u, c, d in _ring_pieces(t, t + b - a, cap):
                    src = slice(a + u - t, a + u - t + d - c)
                    columns[:, block, c:d] = self.columns[:, block, src]
                    rewards[block, c:d] = self.rewards[block, src]
                    if flagged is not None:
                        flagged[block, c:d] = self.flagged[block, src]
        self.capacity, self.columns, self.rewards, self.flagged = cap, columns, rewards, flagged


def _with_rows(arr: np.ndarray, rows: int, used: int) -> np.ndarray:
    """``arr`` (..., R, C) reallocated with ``rows`` rows, the first ``used`` copied (the
    others zero)."""
    out = _small_pages((*arr.shape[:-2], rows, arr.shape[-1]), arr.dtype)
    out[..., :used, :] = arr[..., :used, :]
    return out


def _small_pages(shape: tuple[int, ...], dtype) -> np.ndarray:
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


def _widened(arr: np.ndarray, dtype) -> np.ndarray:
    """``arr.astype(dtype)``, in memory from :func:`_small_pages`."""
    out = _small_pages(arr.shape, dtype)
    out[...] = arr
    return out


class EpisodeFeeder:
    """A thread per session that turns finished episodes into store updates and metrics."""

    def __init__(
        self,
        session: str,
        processor: TrajectoryCaptureProcessor,
        metrics,
        *,
        queue_chunks: int = 32,
        max_tail_bytes: int = 256 << 20,
        max_batch: int = 32,
    ) -> None:
        self.session = session
        self.processor = processor
        self.metrics = metrics
        self.max_tail_bytes = max_tail_bytes
        self._queue: queue.Queue[ChunkEpisodes | None] = queue.Queue(maxsize=queue_chunks)
        self._workers: dict[int, _WorkerTails] = {}
        self._ring = _Ring()
        # With a store, up to this many queued chunks are recorded in one store call.
        self.max_batch = max_batch
        self._pending = 0
        self._idle = threading.Condition()
        # The store path recycles the decode buffers of the chunks it held.
        self.buffers = BufferPool() if self.keeps_arrays else None
        self.alloc = None if self.buffers is None else self.buffers.take
        self._csum: np.ndarray | None = None
        self.truncated_episodes = 0
        self._thread = threading.Thread(target=self._run, name=f"feeder-{session}", daemon=True)
        self._thread.start()

    @property
    def keeps_arrays(self) -> bool:
        return self.processor.store is not None

    # -- producer side -----------------------------------------------------
    def submit(self, item: ChunkEpisodes) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(item)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk has been processed."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def reset(self) -> None:
        self.drain()
        self._workers.clear()
        self._ring = _Ring()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def tails_state(self) -> dict[int, dict[str, np.ndarray]]:
        """Open-episode sums per worker (call drained)."""
        return {
            index: {
                "open_start": t.open_start,
                "open_return": t.open_return,
                "open_code": t.open_code,
            }
            for index, t in self._workers.items()
        }

    def restore_tails(self, state: dict[int, dict[str, np.ndarray]], timelines: list) -> None:
        """Inverse of tails_state; the store path re-decodes the chunks open episodes need."""
        self._workers.clear()
        self._ring = _Ring()
        by_index = {tl.index: tl for tl in timelines}
        for index, arrays in state.items():
            tails = _WorkerTails(
                int(arrays["open_start"].size),
                arrays["open_start"].astype(np.int64),
                arrays["open_return"].astype(np.float64),
                arrays["open_code"].astype(np.int64),
            )
            if self.keeps_arrays:
                self._ring.add_worker(tails)
            self._workers[index] = tails
            timeline = by_index.get(index)
            if self.keeps_arrays and timeline is not None and tails.open_start.size:
                oldest = int(tails.open_start.min())
                for chunk in timeline.chunks:
                    if chunk.t0 + chunk.length > oldest:
                        self._hold(tails, chunk.t0, None, chunk)

    # -- the thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            # With a store, a backlog is recorded in one store call: its fixed costs per call
            # are then paid once for several chunks.
            while self.keeps_arrays and items[-1] is not None and len(items) < self.max_batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = items[-1] is None
            if stop:
                items.pop()
            try:
                # NaN and inf rewards are data, not errors: returns just carry them.
                with np.errstate(all="ignore"):
                    self._process_batch(items)
            except Exception:  # a bad episode must not stop the session's metrics
                self._failed()
            finally:
                with self._idle:
                    self._pending -= len(items)
                    self._idle.notify_all()
            if stop:
                return

    def _failed(self) -> None:
        logger.exception("session %r: episode processing failed", self.session)
        self.metrics.inc("Recorder/feed_errors", 1, session=self.session)

    def _tails(self, worker: int, num_envs: int) -> _WorkerTails:
        tails = self._workers.get(worker)
        if tails is None:
            tails = _WorkerTails(
                num_envs,
                np.zeros(num_envs, dtype=np.int64),
                np.zeros(num_envs, dtype=np.float64),
                np.zeros(num_envs, dtype=np.int64),
            )
            if self.keeps_arrays:
                self._ring.add_worker(tails)
            self._workers[worker] = tails
        return tails

    def _process_batch(self, items: list[ChunkEpisodes]) -> None:
        """Chunks in submission order: each chunk's episodes are found and its open tails
        advanced, then all of them are recorded (with a store: in one call when every chunk's
        episodes are valid, else chunk by chunk) and logged, chunk by chunk."""
        finished = []
        for item in items:
            try:
                finished.append(self._finish(item))
            except Exception:
                self._failed()
        recorded = self._record([f for f in finished if f.item.env.size])
        labels = {"session": self.session}
        for f in recorded:
            lengths, returns = f.lengths, f.returns
            self.metrics.inc("Recorder/episodes_finished", float(lengths.size), **labels)
            self.metrics.log_many(
                {
                    "Episode/return_mean": float(returns.mean()),
                    "Episode/return_max": float(returns.max()),
                    "Episode/return_min": float(returns.min()),
                    "Episode/length_mean": float(lengths.mean()),
                    "Episode/length_max": float(lengths.max()),
                },
                f.item.env_steps_before,
                **labels,
            )
        if recorded:
            # The store's gauges once per call, at its last chunk's step.
            self.processor.log_metrics(recorded[-1].item.env_steps_before)
        if self.keeps_arrays:
            # After recording: the fetches read the held chunks this may release.
            for tails in {id(f.tails): f.tails for f in finished}.values():
                self._trim(tails)

    def _finish(self, item: ChunkEpisodes) -> _Finished:
        """One chunk's finished episodes (returns, lengths, outcomes and, with a store, where
        their steps are), with the worker's open tails advanced past the chunk."""
        rewards = item.arrays["reward"]
        length, num_envs = rewards.shape
        tails = self._tails(item.worker, num_envs)
        t0 = item.t0
        env, start, end = item.env, item.start, item.end
        # Returns: running sums of the open episodes plus in-chunk cumulative sums.
        csum = self._chunk_cumsum(rewards)  # csum[k] = sum of steps < k
        local_start = np.maximum(start - t0, 0)
        local_end = end - t0
        returns = csum[local_end, env] - csum[local_start, env]
        carried = start < t0
        returns[carried] += tails.open_return[env[carried]]
        codes = item.arrays.get("outcome")
        outcomes = self._outcomes(codes, tails, env, local_start, local_end, carried)
        lengths = end - start
        part = None
        if self.keeps_arrays:
            self._hold(tails, t0, item.arrays, item.stored)
            # The held chunk owns the arrays now (or, held encoded, nothing does): nothing
            # else may keep its buffers from going back to the pool.
            decoded, item.arrays = item.arrays, {}
            part = self._gather(tails, env, start, end)
            truncated = int(env.size - part.kept.sum())
            if truncated:
                # Longer than the held tail allows: counted, never stored half-recorded.
                self.truncated_episodes += truncated
                self.metrics.inc(
                    "Recorder/episodes_too_long_for_store", truncated, session=self.session
                )

        # Advance the open tails past this chunk.
        last_end = np.full(num_envs, -1, dtype=np.int64)
        if env.size:
            last_end[env] = local_end  # env-major, time-ordered: the last write wins
        ended = last_end >= 0
        tails.open_start[ended] = t0 + last_end[ended]
        tail_from = np.where(ended, last_end, 0)
        tail_sum = csum[length] - csum[tail_from, np.arange(num_envs)]
        tails.open_return = np.where(ended, tail_sum, tails.open_return + tail_sum)
        if codes is not None:
            steps = np.arange(length)[:, None]
            marked = (codes != 0) & (steps >= tail_from[None, :])
            last = np.where(marked, steps, -1).max(axis=0) if length else np.full(num_envs, -1)
            has = last >= 0
            new_code = np.where(has, codes[np.maximum(last, 0), np.arange(num_envs)], 0)
            tails.open_code = np.where(ended | has, new_code, tails.open_code)
        else:
            tails.open_code[ended] = 0
        if self.keeps_arrays and item.stored is not None:
            # Keyed into the ring and held encoded: the decode buffers are free again.
            del rewards, codes
            decoded.pop("done", None)  # not taken from the pool
            decoded.pop("outcome", None)
            self.buffers.give_all(decoded)
        return _Finished(item, tails, returns, lengths, outcomes, part)

    def _record(self, finished: list[_Finished]) -> list[_Finished]:
        """Record the chunks' episodes; returns the chunks whose episodes were recorded."""
        if not finished:
            return []
        if not self.keeps_arrays:
            # No store: only lengths and outcomes count, so no arrays are gathered.
            recorded = []
            for f in finished:
                total = int(f.lengths.sum())
                batch = EpisodeBatch(
                    np.zeros(total, np.int8), np.zeros(total, np.float32), {}, f.lengths
                )
                try:
                    self.processor.record_episodes(
                        batch, None, f.item.env_steps_before, outcomes=f.outcomes
                    )
                except Exception:
                    self._failed()
                else:
                    recorded.append(f)
            return recorded
        try:
            self._record_window(finished)
            return finished
        except Exception:
            if len(finished) == 1:
                self._failed()
                return []
        # The store validates a whole call before changing anything: now chunk by chunk,
        # so that only the chunks with an invalid episode are refused, as if sent alone.
        recorded = []
        for f in finished:
            try:
                self._record_window([f])
            except Exception:
                self._failed()
            else:
                recorded.append(f)
        return recorded

    def _record_window(self, finished: list[_Finished]) -> None:
        """One store call for the kept episodes of several chunks, in order."""
        parts = [f.part for f in finished]
        if len(parts) == 1:
            part = parts[0]
            rows, start, lengths, fetch = part.rows, part.start, part.lengths, part.fetch
            steps: int | np.ndarray = finished[0].item.env_steps_before
            outcomes = finished[0].outcomes[part.kept]
            defer = part.defer
        else:
            rows = np.concatenate([p.rows for p in parts])
            start = np.concatenate([p.start for p in parts])
            lengths = np.concatenate([p.lengths for p in parts])
            counts = [p.rows.size for p in parts]
            bounds = np.cumsum([0, *counts]).tolist()
            fetches = [p.fetch for p in parts]

            def fetch(i: int) -> EpisodeArrays:
                k = bisect.bisect_right(bounds, i) - 1
                return fetches[k](i - bounds[k])

            defer = None
            if all(p.defer is not None for p in parts):
                defers = [p.defer for p in parts]

                def defer(i: int) -> _HeldEpisode:
                    k = bisect.bisect_right(bounds, i) - 1
                    return defers[k](i - bounds[k])

            steps = np.repeat(
                np.array([f.item.env_steps_before for f in finished], dtype=np.int64), counts
            )
            outcomes = np.concatenate([f.outcomes[p.kept] for f, p in zip(finished, parts)])
        ring = self._ring
        window = EpisodeWindow(ring.columns, ring.rewards, rows, start, lengths, fetch, defer)
        self.processor.record_episodes(window, None, steps, outcomes=outcomes)

    def _chunk_cumsum(self, rewards: np.ndarray) -> np.ndarray:
        """(T+1, N) float64 running sums of a chunk's rewards over time, row 0 zeros (valid
        until the next call). With a store, its compiled loop into a reused buffer."""
        if (
            self.keeps_arrays
            and rewards.dtype in (np.float32, np.float64)
            and rewards.flags.c_contiguous
        ):
            shape = (rewards.shape[0] + 1, rewards.shape[1])
            if self._csum is None or self._csum.shape != shape:
                self._csum = np.empty(shape)
            return kernels.chunk_cumsum(rewards, self._csum)
        csum = np.cumsum(rewards, axis=0, dtype=np.float64)
        return np.concatenate([np.zeros((1, rewards.shape[1])), csum])

    @staticmethod
    def _outcomes(codes, tails, env, local_start, local_end, carried) -> np.ndarray:
        out = np.zeros(env.size, dtype=np.int64)
        if codes is None:
            return out
        for i in range(env.size):
            column = codes[local_start[i] : local_end[i], env[i]]
            nonzero = np.flatnonzero(column)
            if nonzero.size:
                out[i] = column[nonzero[-1]]
            elif carried[i]:
                out[i] = tails.open_code[env[i]]
        return out

    def _hold(
        self,
        tails: _WorkerTails,
        t0: int,
        arrays: dict[str, np.ndarray] | None,
        stored: StoredChunk | None,
    ) -> None:
        """Keep a chunk for the store path (encoded when the session's copy is given) and add
        its steps' cell-key columns and rewards to the worker's window."""
        if stored is not None:
            encoded = {k: a for k, a in stored.arrays.items() if k not in ("done", "outcome")}
            # The session holds the chunk anyway: what holding it costs here is its steps'
            # room in the ring (at most int64 keys and float64 rewards).
            width = len(self.processor.store.configuration.cell_fields)
            nbytes = stored.length * tails.num_envs * 8 * (width + 1)
            held = _Held(t0, stored.length, None, encoded, nbytes)
            if arrays is None:  # restoring: decode just what the window needs
                arrays = {
                    k: a.decode()
                    for k, a in encoded.items()
                    if k == "reward" or k.startswith("state:")
                }
        else:
            kept = {k: a for k, a in arrays.items() if k not in ("done", "outcome")}
            held = _Held(
                t0, kept["reward"].shape[0], kept, None, sum(a.nbytes for a in kept.values())
            )
        tails.chunks.append(held)
        tails.held_bytes += held.nbytes
        tails.decoded_held += held.encoded is None
        ring = self._ring
        length, num_envs = held.length, tails.num_envs
        sources = self._key_sources(arrays)
        if sources is None:
            columns, rewards, flagged = self._chunk_columns(held, arrays, length, num_envs)
            col_type, rew_type = _window_types(ring, columns, rewards)
        else:
            # Every cell field is an integer state: keyed straight into the ring below.
            columns = flagged = None
            rewards = np.asarray(arrays["reward"])
            col_type = _KEY_TYPES[0] if ring.columns is None else ring.columns.dtype.type
            rew_type = _reward_type(ring, rewards)
        width = len(self.processor.store.configuration.cell_fields)
        span = t0 + length - tails.chunks[0].t0
        if span > ring.capacity:
            ring.grow(self._workers.values(), span, width, length, col_type, rew_type)
        else:
            if ring.columns.dtype != col_type:
                ring.columns = _widened(ring.columns, col_type)
            if ring.rewards.dtype != rew_type:
                ring.rewards = _widened(ring.rewards, rew_type)
        cap, rows = ring.capacity, tails.rows
        if columns is not None:
            columns = columns.reshape(width, length, num_envs).transpose(0, 2, 1)
        else:
            _ring_keys(ring, rows, sources, t0)
        rewards = rewards.T
        if flagged is not None:
            flagged = flagged.reshape(length, num_envs).T
            if ring.flagged is None:
                ring.flagged = np.zeros(ring.rewards.shape, dtype=bool)
        for t, a, b in _ring_pieces(t0, t0 + length, cap):
            if columns is not None:
                ring.columns[:, rows, a:b] = columns[:, :, t - t0 : t - t0 + b - a]
            ring.rewards[rows, a:b] = rewards[:, t - t0 : t - t0 + b - a]
            if ring.flagged is not None:
                ring.flagged[rows, a:b] = (
                    False if flagged is None else flagged[:, t - t0 : t - t0 + b - a]
                )
        tails.end = t0 + length

    def _key_sources(self, arrays: dict[str, np.ndarray]) -> list[tuple] | None:
        """Per cell field, its (T, N) integer state column and (shift, bucket) for
        kernels.ring_keys; None when some field takes the general path (another dtype, or a
        field missing or misshapen: that path says what is wrong)."""
        sources = []
        for spec in self.processor.store.configuration.cell_fields:
            arr = arrays.get("state:" + spec.state_field)
            if arr is None and spec.state_field in _ALIASES:
                arr = arrays.get("state:" + _ALIASES[spec.state_field])
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

    def _chunk_columns(self, held: _Held, arrays: dict[str, np.ndarray], length: int, n: int):
        """(F, length * n) cell-key columns, (length, n) rewards (their own dtype) and None
        or a (length * n,) flag of the steps that could not be keyed (held.error says why)."""
        store = self.processor.store
        total = length * n
        flat = {
            k[6:]: a.reshape(total, *a.shape[2:])
            for k, a in arrays.items()
            if k.startswith("state:")
        }
        rewards = np.asarray(arrays["reward"])
        try:
            return store.step_columns(flat, total), rewards, None
        except ValueError as exc:
            held.error = exc
        # Non-finite float cell fields flag only their steps (as if recorded per episode);
        # anything else flags the whole chunk.
        flagged = np.zeros(total, dtype=bool)
        for spec in store.configuration.cell_fields:
            name = spec.state_field if spec.state_field in flat else _ALIASES.get(spec.state_field)
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
        return columns, rewards, flagged

    def _gather(
        self, tails: _WorkerTails, env: np.ndarray, start: np.ndarray, end: np.ndarray
    ) -> _Part:
        """The finished episodes as read in place from the ring (their cell-key columns and
        rewards); full arrays are fetched from the held chunks only for stored episodes.

        Episodes whose beginning was dropped under the tail cap are left out (kept[i]
        is False) rather than stored truncated.
        """
        held = list(tails.chunks)
        kept = start >= held[0].t0
        if not kept.all():
            env, start, end = env[kept], start[kept], end[kept]
        lengths = end - start
        total = int(lengths.sum())
        ring, rows = self._ring, env + tails.row
        if ring.flagged is not None:
            bad = np.empty((1, total), dtype=bool)
            bad = kernels.gather_ring(ring.flagged[None], rows, start, lengths, ring.capacity, bad)
            bad = bad[0]
            if bad.any():
                steps = np.repeat(start, lengths) + _positions(lengths)
                t = int(steps[int(np.argmax(bad))])
                for chunk in held:
                    if chunk.t0 <= t < chunk.t0 + chunk.length and chunk.error is not None:
                        raise chunk.error
                raise ValueError("states: a cell field could not be keyed")
        episodes = (env.tolist(), start.tolist(), end.tolist())
        if not tails.decoded_held:
            # Held encoded (as the session keeps them): stored episodes are read back only
            # when first needed; most are superseded before anything reads them.
            if tails.bounds is None:
                tails.bounds = _BoundCache(held[-1].encoded)
            bounds = tails.bounds
            starts: list[int] = []

            def defer(i: int) -> _HeldEpisode:
                if not starts:  # only a few episodes of a chunk are stored
                    starts.extend(chunk.t0 for chunk in held)
                e, s, t = episodes[0][i], episodes[1][i], episodes[2][i]
                lo = max(bisect.bisect_right(starts, s) - 1, 0)
                hi = bisect.bisect_left(starts, t, lo)
                return _HeldEpisode(tails, e, s, t, tuple(held[lo:hi]), bounds(t - s))

            return _Part(rows, start, lengths, lambda i: defer(i).fetch({}), kept, defer)

        starts = [chunk.t0 for chunk in held]

        def fetch(i: int) -> EpisodeArrays:
            e, s, t = episodes[0][i], episodes[1][i], episodes[2][i]
            pieces: dict[str, list[np.ndarray]] = {}
            # Only the chunks the episode spans (a worker holds tens, time-ordered).
            for chunk in held[max(bisect.bisect_right(starts, s) - 1, 0) :]:
                if chunk.t0 >= t:
                    break
                if chunk.t0 + chunk.length <= s:
                    continue
                arrays = chunk.arrays
                if arrays is None:  # held encoded (restored), among decoded ones
                    arrays = {k: a.decode() for k, a in chunk.encoded.items()}
                lo, hi = max(s, chunk.t0) - chunk.t0, min(t, chunk.t0 + chunk.length) - chunk.t0
                col = chunk.column(e)
                for k, a in arrays.items():
                    pieces.setdefault(k, []).append(a[lo:hi, col])
            return _joined(pieces)

        return _Part(rows, start, lengths, fetch, kept)

    def _trim(self, tails: _WorkerTails) -> None:
        oldest = int(tails.open_start.min()) if tails.open_start.size else 0
        while tails.chunks:
            chunk = tails.chunks[0]
            over = tails.held_bytes > self.max_tail_bytes and len(tails.chunks) > 1
            if chunk.t0 + chunk.length > oldest and not over:
                break
            tails.chunks.popleft()
            tails.held_bytes -= chunk.nbytes
            tails.decoded_held -= chunk.encoded is None
            if chunk.arrays is not None and chunk.columns is None and self.buffers is not None:
                arrays, chunk.arrays = chunk.arrays, None
                self.buffers.give_all(arrays)
        self._compact(tails)

    def _compact(self, tails: _WorkerTails) -> None:
        """Keep of each held chunk only the environments whose open episode reaches back into
        it, once that is at most an eighth of what it holds. An open episode is older than a few
        chunks in only some environments, so a chunk's whole arrays are needed only while it
        is recent: this returns its decode buffers to the pool for the next chunks (fresh
        buffers are page-faulted in) and keeps the held window to about the steps that open
        episodes still need. A chunk is copied once at most 1/8 of it is needed, and again
        only when that part is down to an eighth, so copies add up to ~1/7 of a chunk."""
        open_start = tails.open_start
        for chunk in tails.chunks:
            if chunk.arrays is None:
                continue
            need = np.flatnonzero(open_start < chunk.t0 + chunk.length)
            held = chunk.arrays["reward"].shape[1]
            if 8 * need.size > held:
                continue
            whole = chunk.columns is None
            source = need if whole else chunk.columns[need]
            kept = {k: a.take(source, axis=1) for k, a in chunk.arrays.items()}
            columns = np.full(tails.num_envs, -1, dtype=np.int64)
            columns[need] = np.arange(need.size)
            released, chunk.arrays, chunk.columns = chunk.arrays, kept, columns
            nbytes = sum(a.nbytes for a in kept.values())
            tails.held_bytes += nbytes - chunk.nbytes
            chunk.nbytes = nbytes
            if whole and self.buffers is not None:
                self.buffers.give_all(released)


class _BoundCache:
    """repository.blob_bound for a worker's episodes by length (its chunks' fields)."""

    def __init__(self, encoded: dict) -> None:
        self.fields = []
        for key, arr in encoded.items():
            name = _EPISODE_NAMES.get(key, "state/" + key[6:])
            per_step = arr.dtype.itemsize * math.prod(arr.shape[2:])
            self.fields.append((name, arr.dtype.str, tuple(arr.shape[2:]), per_step))

    def __call__(self, length: int) -> int:
        return blob_bound(self.fields, length)


_EPISODE_NAMES = {"action": "actions", "reward": "rewards"}


class _HeldEpisode:
    """A stored episode not encoded yet (repository.DeferredEpisode): environment ``env``'s
    steps ``start..end-1`` of a worker, read from the encoded chunks it spans (the session's
    own, kept for finish(), so holding them costs nothing more)."""

    __slots__ = ("group", "env", "first", "end", "chunks", "bound")

    def __init__(self, group, env: int, start: int, end: int, chunks, bound: int) -> None:
        self.group, self.env, self.first, self.end = group, env, start, end
        self.chunks, self.bound = chunks, bound

    @property
    def length(self) -> int:
        return self.end - self.first

    def fetch(self, cache: dict) -> EpisodeArrays:
        """The episode's arrays; ``cache`` keeps decoded chunks by start step for the fetches
        after this one (in start order), which never need a chunk that ends before them."""
        for t0 in [t0 for t0, (end, _) in cache.items() if end <= self.first]:
            del cache[t0]
        pieces: dict[str, list[np.ndarray]] = {}
        for chunk in self.chunks:
            hit = cache.get(chunk.t0)
            if hit is None:
                hit = cache[chunk.t0] = (
                    chunk.t0 + chunk.length,
                    {k: a.decode() for k, a in chunk.encoded.items()},
                )
            lo = max(self.first, chunk.t0) - chunk.t0
            hi = min(self.end, chunk.t0 + chunk.length) - chunk.t0
            for k, a in hit[1].items():
                pieces.setdefault(k, []).append(a[lo:hi, self.env])
        return _joined(pieces)


def _joined(pieces: dict[str, list[np.ndarray]]) -> EpisodeArrays:
    """An episode from its pieces per chunk array (action, reward, state:<name>)."""
    joined = {k: v[0].copy() if len(v) == 1 else np.concatenate(v) for k, v in pieces.items()}
    states = {k[6:]: v for k, v in joined.items() if k.startswith("state:")}
    return EpisodeArrays(joined["action"], joined["reward"], states)


# Reward dtypes whose every value float32 holds exactly (the window stores those as float32).
_FLOAT32_EXACT = frozenset(
    np.dtype(t) for t in (np.float32, np.float16, np.bool_, np.int8, np.uint8, np.int16, np.uint16)
)
# Key dtypes of the window, narrowest first.
_KEY_TYPES = (np.int16, np.int32, np.int64)


# State dtypes whose cell keys the feeder writes into its window in one compiled pass.
_RING_SOURCES = frozenset(np.dtype(t) for t in (np.int32, np.int64))


def _ring_keys(ring: _Ring, rows: slice, sources: list[tuple], t0: int) -> None:
    """Key a chunk's steps into a worker's rows of the ring (columns t0...), widening the
    ring's dtype first when some key does not fit it."""
    while True:
        lows, highs = zip(
            *(
                kernels.ring_keys(src, shift, bucket, ring.columns[j, rows], t0, ring.capacity)
                for j, (src, shift, bucket) in enumerate(sources)
            ),
            strict=True,
        )
        key_type = _key_type(ring, min(lows), max(highs))
        if key_type == ring.columns.dtype:
            return
        ring.columns = _widened(ring.columns, key_type)  # then this chunk again


def _key_type(ring: _Ring, low: int, high: int) -> type:
    """The narrowest window key dtype, no narrower than the current one, holding low..high."""
    rank = 0 if ring.columns is None else _KEY_TYPES.index(ring.columns.dtype.type)
    while rank < len(_KEY_TYPES) - 1:
        info = np.iinfo(_KEY_TYPES[rank])
        if info.min <= low and high <= info.max:
            break
        rank += 1
    return _KEY_TYPES[rank]


def _reward_type(ring: _Ring, rewards: np.ndarray) -> type:
    """float32 while every reward so far is exactly a float32, else float64 (for good)."""
    wide = ring.rewards is not None and ring.rewards.dtype == np.float64
    return np.float64 if wide or rewards.dtype not in _FLOAT32_EXACT else np.float32


def _window_types(ring: _Ring, columns: np.ndarray, rewards: np.ndarray):
    """The window's dtypes once this chunk is in: cell keys in the narrowest of int16 / int32
    / int64 that holds every key so far, rewards as float32 while every reward is exactly a
    float32 (else float64); never narrowed back. Keys on a grid usually fit int16, which
    quarters the keys' memory and the bytes the window writes and reads per step."""
    key_type = _KEY_TYPES[0] if ring.columns is None else ring.columns.dtype.type
    if key_type != _KEY_TYPES[-1] and columns.size:
        lows, highs = kernels.key_bounds(columns)
        key_type = _key_type(ring, int(lows.min()), int(highs.max()))
    return key_type, _reward_type(ring, rewards)


def _positions(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ..., n-1 for each n in ``lengths``, back to back."""
    offsets = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets, lengths)


def _ring_pieces(lo: int, hi: int, cap: int) -> list[tuple[int, int, int]]:
    """Times [lo, hi) on a ring of ``cap`` rows as contiguous pieces (time, row_a, row_b)."""
    pieces = []
    t = lo
    while t < hi:
        a = t % cap
        b = min(cap, a + hi - t)
        pieces.append((t, a, b))
        t += b - a
    return pieces
