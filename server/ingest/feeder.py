"""Finished episodes -> trajectory store and metrics, on a thread per session, off the ack path.

Every finished episode reaches the capture processor (`record_episodes`) and the metrics,
whether or not a trajectory store is configured. Without a store only lengths, returns and
outcomes are needed (`tails`). With a store, each chunk's steps are keyed into the session's
window (`window`), the chunk is held while an open episode needs it (`held`), and the chunks
that queued up meanwhile are recorded in one store call, in order: the store's fixed costs per
call are then shared, which is what lets the feeder catch up.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from recorder_client._wire import STATE_ALIASES

from ..episodes import StoredChunk, WorkerTimeline
from ..store import EpisodeWindow, TrajectoryCaptureProcessor
from .buffers import BufferPool
from .held import HeldChunks, HeldEpisode, Part
from .tails import EpisodeSums, Finished, cumsum
from .window import Ring

# How long the thread waits, once woken, for more chunks to batch with (acks do not wait).
_LINGER_S = 0.002

logger = logging.getLogger(__name__)


_local = threading.local()
# Bytes of scratch buffers one thread keeps.
_SCRATCH_BYTES = 64 << 20


def scratch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A buffer of this thread's to decode into and drop: the next call may reuse it."""
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    key = (np.dtype(dtype).str, tuple(shape))
    arr = cache.get(key)
    if arr is None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes > _SCRATCH_BYTES:  # a rare big chunk: its buffer goes with it
            return np.empty(shape, dtype=dtype)
        if sum(a.nbytes for a in cache.values()) + nbytes > _SCRATCH_BYTES:
            cache.clear()
        arr = cache[key] = np.empty(shape, dtype=dtype)
    return arr


@dataclass
class ChunkEpisodes:
    """What the session hands over for one stored chunk."""

    worker: int
    chunk: StoredChunk
    """The chunk as the session holds it (encoded)."""
    arrays: dict[str, np.ndarray]
    """Decoded: the arrays the feeder needs (`EpisodeFeeder.needs`). Handed over: with a store
    the feeder gives the buffers back to the pool once the chunk is keyed."""
    env: np.ndarray
    start: np.ndarray
    end: np.ndarray
    """The episodes the chunk finished, on the worker's time axis."""
    oldest_open: int
    """The first step some open episode of the worker needs, after this chunk."""
    env_steps_before: int
    """The session's env steps before this chunk (the metrics step)."""
    partial: np.ndarray | None = None
    """Per finished episode: its partial flags (non-zero: a sequence gap hid its start);
    such an episode reaches neither the store nor the metrics."""
    parts: tuple[int, ...] = ()
    """T of each record() call the chunk joins (`Chunk.parts`); () for one call."""


@dataclass
class _Worker:
    sums: EpisodeSums
    held: HeldChunks | None
    oldest_open: int = 0
    corrupt: list[tuple[int, int]] = field(default_factory=list)
    """Steps [t0, t1) of held chunks whose frames did not decode: no episode over them
    reaches the store."""


@dataclass
class _Closed:
    """One processed chunk, waiting to be recorded and logged."""

    item: ChunkEpisodes
    finished: Finished
    part: Part | None
    step_after: int
    """The session's env steps after this chunk: the step its episodes' metrics carry."""
    first_id: int | None = None
    """The store's trajectory id of this chunk's first kept episode, once recorded."""
    whole: np.ndarray | None = None
    """Indexes of the chunk's episodes that `finished` and `part` hold (the others are
    partial: a gap hid their start, or they read corrupt frames); None: all."""
    calls: np.ndarray | None = None
    """For a chunk joined from several calls: each episode of `finished`'s call (ascending),
    and the session's env steps before and after each call."""
    call_before: np.ndarray | None = None
    call_after: np.ndarray | None = None

    def metric_batches(self) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(returns, lengths, step) of the episodes each call finished, at its step."""
        f = self.finished
        if self.calls is None or self.call_after is None:
            return [(f.returns, f.lengths, self.step_after)]
        cuts = np.searchsorted(self.calls, np.arange(self.call_after.size + 1)).tolist()
        return [
            (f.returns[a:b], f.lengths[a:b], int(self.call_after[k]))
            for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))
            if b > a
        ]

    def store_steps(self) -> int | np.ndarray:
        """The env steps before each kept episode's chunk (its call's, for a joined one)."""
        if self.calls is None or self.call_before is None or self.part is None:
            return self.item.env_steps_before
        return self.call_before[self.calls[self.part.kept]]


class EpisodeFeeder:
    """A thread per session that turns finished episodes into store updates and metrics."""

    def __init__(
        self,
        session: str,
        processor: TrajectoryCaptureProcessor,
        metrics,
        *,
        queue_chunks: int = 32,
        max_tail_bytes: int = 128 << 20,
        max_batch: int = 32,
        prove: Callable[[StoredChunk], None] | None = None,
    ) -> None:
        """`prove(chunk)`: proves a stored chunk's frames decode before a stored episode
        reads them (`Session.verify`)."""
        self.session = session
        self.prove = prove
        self.processor = processor
        self.metrics = metrics
        self.max_tail_bytes = max_tail_bytes
        self.store = processor.store
        # Up to this many queued chunks are taken at once (with a store: in one store call).
        self.max_batch = max_batch
        self._queue: queue.Queue[ChunkEpisodes | None] = queue.Queue(maxsize=queue_chunks)
        self._workers: dict[int, _Worker] = {}
        self._ring = Ring()
        self._pending = 0
        self._idle = threading.Condition()
        # The store path decodes into pooled buffers and gives them back once keyed.
        self.buffers = BufferPool() if self.store is not None else None
        self._csum = np.empty((0, 0)) if self.store is not None else None
        # The decoded arrays the feeder reads: done, reward, outcome and, with a store, the
        # state fields its cells are keyed on (under either spelling of a renamed field).
        self._needs = {"done", "reward", "outcome"}
        if self.store is not None:
            for spec in self.store.configuration.cell_fields:
                name = spec.state_field
                self._needs |= {f"state:{name}", f"state:{STATE_ALIASES.get(name, name)}"}
        self.truncated_episodes = 0
        # Per worker index: the store's trajectory id of each finished episode, in the order
        # of the worker's episode table (-1: not in the store), so that the dataset can name
        # the episodes the store's references point at.
        self.trajectory_ids: dict[int, list[np.ndarray]] = {}
        self._ids_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"feeder-{session}", daemon=True)
        self._thread.start()

    def needs(self, key: str) -> bool:
        """Whether the feeder reads a chunk's decoded array ``key`` (the others are decoded
        only to prove their frames intact)."""
        return key in self._needs

    def alloc(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A buffer to decode a chunk's array into: pooled for the arrays the store path
        keys and gives back, scratch (reused by this thread) for those nobody reads."""
        if key not in self._needs:
            return scratch(shape, dtype)
        if self.buffers is None or key in ("done", "outcome"):
            return np.empty(shape, dtype=dtype)
        return self.buffers.take(shape, dtype)

    # -- producer side -----------------------------------------------------
    def submit(self, item: ChunkEpisodes) -> None:
        """Queue a chunk (blocks while the queue is full: backpressure on ingest)."""
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
        self._ring = Ring()
        self.trajectory_ids.clear()

    def trajectory_id_table(self, worker: int) -> np.ndarray:
        """The store's trajectory id of each of a worker's finished episodes, in its episode
        table's order (-1: not in the store); call drained."""
        with self._ids_lock:
            parts = self.trajectory_ids.get(worker)
            if not parts:
                return np.zeros(0, dtype=np.int64)
            if len(parts) > 1:
                parts[:] = [np.concatenate(parts)]
            return parts[0]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def held_chunks(self, worker: int) -> list[tuple[int, int]]:
        """(first step, length) of each chunk held for a worker's open episodes (call
        drained): what the store path keeps in its window."""
        held = self._workers.get(worker)
        if held is None or held.held is None:
            return []
        return [(c.t0, c.length) for c in held.held.chunks]

    def state(self) -> dict[int, dict[str, np.ndarray]]:
        """Each worker's open-episode sums, by worker index (call drained)."""
        return {index: w.sums.state() for index, w in self._workers.items()}

    def restore(
        self, state: dict[int, dict[str, np.ndarray]], timelines: list[WorkerTimeline]
    ) -> None:
        """Inverse of `state`, given the restored timelines: the store path keys the held
        chunks that open episodes still need back into the window."""
        self._workers.clear()
        self._ring = Ring()
        by_index = {tl.index: tl for tl in timelines}
        for index, sums in sorted(state.items()):
            timeline = by_index.get(index)
            worker = self._add(index, EpisodeSums.from_state(sums))
            if timeline is None or worker.held is None or not worker.sums.num_envs:
                continue
            worker.oldest_open = timeline.oldest_open()
            # The newest chunks open episodes need, as many as the tail budget holds (what
            # trim() would have kept): only those are decoded.
            width = len(self.store.configuration.cell_fields)
            kept, cost = [], 0
            for chunk in reversed(timeline.chunks):
                if chunk.t0 + chunk.length <= worker.oldest_open:
                    break
                cost += chunk.length * worker.sums.num_envs * 8 * (width + 1)
                if kept and cost > self.max_tail_bytes:
                    break
                kept.append(chunk)
            for chunk in reversed(kept):
                if chunk.unverified and self.prove is not None:
                    self.prove(chunk)
                if chunk.corrupt:  # no episode over it reaches the store
                    worker.corrupt.append((chunk.t0, chunk.t0 + chunk.length))
                # What the window keys (the reward and the cell fields).
                arrays = {
                    k: a.decode()
                    for k, a in chunk.arrays.items()
                    if k in self._needs and (k == "reward" or k.startswith("state:"))
                }
                self._hold(worker, chunk, arrays)

    # -- the thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            if items[0] is not None and self._queue.empty():
                # Woken by one chunk: the ones arriving meanwhile come in the same batch,
                # so that many small chunks cost one wake-up of this thread, not one each.
                time.sleep(_LINGER_S)
            # A backlog is taken at once (with a store: recorded in one store call).
            while items[-1] is not None and len(items) < self.max_batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = items[-1] is None
            if stop:
                items.pop()
            try:
                self.feed(items)
            except Exception:  # a bad episode must not stop the session's metrics
                self._failed()
            finally:
                with self._idle:
                    self._pending -= len(items)
                    self._idle.notify_all()
            if stop:
                return

    def feed(self, items: list[ChunkEpisodes]) -> None:
        """Process chunks in submission order on this thread, their episodes recorded in one
        store call when every one is valid (else chunk by chunk), then logged chunk by chunk.
        (The feeder's thread calls this with whatever is queued.)"""
        # NaN and inf rewards are data, not errors: returns just carry them.
        with np.errstate(all="ignore"):
            self._feed(items)

    def _feed(self, items: list[ChunkEpisodes]) -> None:
        closed = []
        for item in items:
            try:
                closed.append(self._close(item))
            except Exception:
                self._failed()
        recorded = self._record([c for c in closed if c.finished.lengths.size])
        if self.store is not None:
            self._note_ids(items, closed)
        if recorded:
            # One tracker call per batch: the counter; every episode, for the histograms and
            # the sinks' summaries, stamped with the env steps after the chunk that finished
            # it; and the store's gauges, at the batch's last chunk's step.
            finished = sum(c.finished.lengths.size for c in recorded)
            self.metrics.observe_feed(
                {"Recorder/episodes_finished": float(finished)},
                [batch for c in recorded for batch in c.metric_batches()],
                self.processor.metric_values(),
                recorded[-1].step_after,
                session=self.session,
            )
        # After recording: the episodes just recorded may read the chunks this drops.
        if self.store is not None:
            for index in {item.worker for item in items}:
                worker = self._workers.get(index)
                if worker is not None:
                    worker.held.trim(worker.oldest_open, self.max_tail_bytes)

    def _note_ids(self, items: list[ChunkEpisodes], closed: list[_Closed]) -> None:
        """Append each chunk's episodes' store ids to its worker's table (-1 where a chunk
        failed or an episode was too long for the store)."""
        by_item = {id(c.item): c for c in closed}
        for item in items:
            if not item.env.size:
                continue
            ids = np.full(item.env.size, -1, dtype=np.int64)
            c = by_item.get(id(item))
            if c is not None and c.first_id is not None and c.part is not None:
                kept = np.flatnonzero(c.part.kept)
                if c.whole is not None:
                    kept = c.whole[kept]
                ids[kept] = c.first_id + np.arange(kept.size)
            with self._ids_lock:
                self.trajectory_ids.setdefault(item.worker, []).append(ids)

    def _failed(self) -> None:
        logger.exception("session %r: episode processing failed", self.session)
        self.metrics.inc("Recorder/feed_errors", 1, session=self.session)

    def _add(self, index: int, sums: EpisodeSums) -> _Worker:
        held = None
        if self.store is not None:
            held = HeldChunks(sums.num_envs, self.prove)
            self._ring.add_worker(held)
        worker = self._workers[index] = _Worker(sums, held)
        return worker

    def _hold(self, worker: _Worker, chunk: StoredChunk, arrays: dict[str, np.ndarray]) -> None:
        """Hold a chunk and key its steps into the window."""
        held = worker.held.hold(chunk, len(self.store.configuration.cell_fields))
        rows = [w.held for w in self._workers.values()]
        held.error = self._ring.write(self.store, rows, worker.held, chunk.t0, arrays)

    def _close(self, item: ChunkEpisodes) -> _Closed:
        """One chunk's finished episodes (returns, lengths, outcomes and, with a store, where
        their steps are in the window), with the worker's open episodes carried past it."""
        arrays, item.arrays = item.arrays, {}
        num_envs = arrays["reward"].shape[1]
        worker = self._workers.get(item.worker) or self._add(item.worker, EpisodeSums(num_envs))
        env, start, end = item.env, item.start, item.end
        whole = None if item.partial is None or not item.partial.any() else item.partial == 0
        part = None
        if self.store is not None:
            self._csum = csum = cumsum(arrays["reward"], self._csum)
            self._hold(worker, item.chunk, arrays)
            whole = self._readable(worker, item, whole)
            if whole is not None:
                env, start, end = env[whole], start[whole], end[whole]
            part = worker.held.gather(self._ring.flagged_step, env, start, end)
            truncated = int(env.size - part.kept.sum())
            if truncated:
                # Longer than the held tail allows: counted, never stored half-recorded.
                self.truncated_episodes += truncated
                self.metrics.inc(
                    "Recorder/episodes_too_long_for_store", truncated, session=self.session
                )
        else:
            csum = cumsum(arrays["reward"])
        # Over every episode (partial ones too), so that the open sums restart at each end.
        finished = worker.sums.close(
            csum, arrays.get("outcome"), item.chunk.t0, item.env, item.start, item.end
        )
        if whole is not None:
            finished = Finished(
                finished.returns[whole], finished.lengths[whole], finished.outcomes[whole]
            )
            whole = np.flatnonzero(whole)
        calls = call_before = call_after = None
        if item.parts:  # a chunk joined from several calls: their episodes are call-major
            ends = np.cumsum(np.asarray(item.parts, dtype=np.int64))
            calls = np.searchsorted(ends, item.end - item.chunk.t0, side="left")
            calls = calls if whole is None else calls[whole]
            call_after = item.env_steps_before + ends * num_envs
            call_before = call_after - np.asarray(item.parts, dtype=np.int64) * num_envs
        worker.oldest_open = item.oldest_open
        if self.buffers is not None:
            # Keyed into the window and held encoded: the decode buffers are free again.
            arrays.pop("done", None)  # not taken from the pool
            arrays.pop("outcome", None)
            self.buffers.give_all(arrays)
        step_after = item.env_steps_before + item.chunk.length * num_envs
        return _Closed(
            item,
            finished,
            part,
            step_after,
            whole=whole,
            calls=calls,
            call_before=call_before,
            call_after=call_after,
        )

    def _readable(
        self, worker: _Worker, item: ChunkEpisodes, whole: np.ndarray | None
    ) -> np.ndarray | None:
        """``whole`` without the episodes over a chunk whose frames do not decode: the chunk
        is proved here, before the store reads its episodes (zeros never reach it)."""
        chunk = item.chunk
        if chunk.unverified and self.prove is not None:
            self.prove(chunk)
        if chunk.corrupt:
            worker.corrupt.append((chunk.t0, chunk.t0 + chunk.length))
        if not worker.corrupt:
            return whole
        ok = np.ones(item.env.size, dtype=bool) if whole is None else whole.copy()
        for lo, hi in worker.corrupt:
            ok &= ~((item.start < hi) & (lo < item.end))
        # An episode still to finish starts at or after the oldest open step.
        worker.corrupt = [r for r in worker.corrupt if r[1] > item.oldest_open]
        return None if ok.all() else ok

    def _record(self, closed: list[_Closed]) -> list[_Closed]:
        """Record the chunks' episodes; returns the chunks whose episodes were recorded."""
        if not closed:
            return []
        if self.store is None:
            # No store: only lengths and outcomes count, so no episode arrays are built.
            recorded = []
            for c in closed:
                try:
                    self.processor.count_episodes(c.finished.lengths, c.finished.outcomes)
                except Exception:
                    self._failed()
                    continue
                recorded.append(c)
            return recorded
        for c in closed:
            if c.part.error is not None:
                logger.error(
                    "session %r: chunk at step %d of worker %d not recorded: %s",
                    self.session,
                    c.item.chunk.t0,
                    c.item.worker,
                    c.part.error,
                )
                self.metrics.inc("Recorder/feed_errors", 1, session=self.session)
        valid = [c for c in closed if c.part.error is None]
        if len(valid) > 1 and self._try_record(valid, quiet=True):
            return valid
        # The store validates a whole call before changing anything: now chunk by chunk, so
        # that only the chunks with an invalid episode are refused, as if sent alone.
        return [c for c in valid if self._try_record([c])]

    def _try_record(self, closed: list[_Closed], *, quiet: bool = False) -> bool:
        try:
            self._record_window(closed)
        except Exception:
            if not quiet:
                self._failed()
            return False
        return True

    def _record_window(self, closed: list[_Closed]) -> None:
        """One store call for the kept episodes of several chunks, in order."""
        parts = [c.part for c in closed]
        outcomes = [c.finished.outcomes[p.kept] for c, p in zip(closed, parts, strict=True)]
        if len(parts) == 1:
            part = parts[0]
            rows, start, lengths, defer = part.rows, part.start, part.lengths, part.defer
            steps: int | np.ndarray = closed[0].store_steps()
            codes = outcomes[0]
        else:
            rows = np.concatenate([p.rows for p in parts])
            start = np.concatenate([p.start for p in parts])
            lengths = np.concatenate([p.lengths for p in parts])
            counts = [p.rows.size for p in parts]
            bounds = np.cumsum([0, *counts]).tolist()
            defers = [p.defer for p in parts]

            def defer(i: int) -> HeldEpisode:
                k = bisect.bisect_right(bounds, i) - 1
                return defers[k](i - bounds[k])

            steps = np.concatenate(
                [
                    np.broadcast_to(np.asarray(c.store_steps(), np.int64), (n,))
                    for c, n in zip(closed, counts)
                ]
            )
            codes = np.concatenate(outcomes)
        ring = self._ring
        window = EpisodeWindow(ring.columns, ring.rewards, rows, start, lengths, defer)
        first = self.processor.record_episodes(window, steps, outcomes=codes)
        if first is not None:
            for c, p in zip(closed, parts, strict=True):
                c.first_id = first
                first += int(p.rows.size)
