"""A recording session: configuration, workers in join order, validation, counters.

Plain Python and numpy. Refusals raise `RequestError` with a typed kind and a message that
names the field, what was expected and what arrived; a refused request changes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

from recorder_client import _wire
from recorder_client.status import SessionStatus, WorkerStatus

from .chunks import (
    Chunk,
    Schema,
    SessionConfig,
    check_schema,
    decode_chunk,
)
from .dataset.cursor import DatasetCursor
from .durability import records
from .episodes import Assembly, NoEpisodesError, StoredChunk, WorkerTimeline, assemble
from .errors import ErrorKind, RequestError
from .identity import (  # noqa: F401 - names and the sequence range, used from here too
    MAX_SEQUENCE,
    Identities,
    check_acked,
    check_session_name,
    check_worker_id,
    describe,
    dropped_error,
)
from .ingest import ChunkEpisodes, EpisodeFeeder
from .ingest.verify import VERIFIER
from .loss import LossCause
from .session_proofs import FrameProofs
from .session_store import StoreVerbs
from .store import TrajectoryCaptureProcessor, build_store

logger = logging.getLogger(__name__)

# Workers forgotten after leaving or expiring whose last sequence a session remembers, so
# that one joining again resumes where it was; the oldest go first beyond this many.
MAX_FORGOTTEN = 65536

# Appends one write-ahead log record (a list of buffers) before a change is acknowledged.
Journal = Callable[[list], None]


def append(journal: Journal, record: list) -> None:
    """Append a record to the log, or refuse the request that made it (STORAGE)."""
    try:
        journal(record)
    except OSError as exc:
        raise RequestError(
            ErrorKind.STORAGE,
            f"data directory: cannot append to the write-ahead log ({exc.strerror or exc})",
        ) from None


# Counter versions grow over the whole process, so a newer snapshot of any session's
# counters always has the higher version (a client keeps the highest it has seen).
_VERSIONS = itertools.count(1)


class Counters(NamedTuple):
    """What the acks carry: the session's counters, and the version of this snapshot."""

    version: int
    is_full: bool
    num_recorded_steps: int
    episodes_finished: int


class Applied(enum.Enum):
    """What a session did with a chunk."""

    STORED = "stored"
    DROPPED_FULL = "dropped_full"
    """Not stored: the session had reached max_episodes."""
    DUPLICATE = "duplicate"
    """Taken before (a resend): nothing changed."""


_shown = _wire.shown


class SessionMetrics:
    """The processor's metrics object: every value it logs carries the session label."""

    def __init__(self, metrics, session: str) -> None:
        self._metrics = metrics
        self._session = session

    def log_many(self, values: dict[str, float], step: int) -> None:
        self._metrics.log_many(values, step, session=self._session)


class Session(FrameProofs, StoreVerbs):
    """One recording: every worker that joined it, in join order."""

    def __init__(
        self,
        name: str,
        config: SessionConfig,
        metrics,
        *,
        max_workers: int = 1024,
        journal: Journal | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.metrics = metrics
        self.max_workers = max_workers
        self.journal = journal
        self.lock = threading.RLock()
        # Every worker whose chunks the session holds, and every active one, in join order.
        self.workers: dict[str, WorkerTimeline] = {}
        self.last_sequence: dict[str, int] = {}
        # worker -> sequence of its last chunk the counters count.
        self.counted: dict[str, int] = {}
        self._worker_locks: dict[str, threading.Lock] = {}
        self.last_seen: dict[str, float] = {}
        self.joined_at: dict[str, float] = {}  # wall clock of each worker's first join
        # Workers that count against max_workers: joined, and neither left nor expired.
        self.active: set[str] = set()
        # Last sequence of workers forgotten (left or expired without stored chunks).
        self.forgotten: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.sequences_lost: dict[str, int] = {}
        self.next_index = 0
        self.last_used = time.monotonic()
        self.dropped = False
        self.dropped_at = 0.0  # wall clock of the drop
        # Who holds each worker id, and who joined (identity.py).
        self.identity = Identities(name)
        # What recovery found may have cost acknowledged chunks (a torn tail, a fallback).
        self.loss_causes: list[LossCause] = []
        self.processor = TrajectoryCaptureProcessor(
            config.capture, SessionMetrics(metrics, name), build_store(config.capture)
        )
        # A weak reference: the feeder's held chunks must not keep a dropped session alive.
        proving = weakref.WeakMethod(self._verify_chunk)

        def prove(chunk: StoredChunk) -> None:
            method = proving()
            if method is not None:
                method(chunk)

        self.feeder = EpisodeFeeder(name, self.processor, metrics, queue_chunks=32, prove=prove)
        self.dataset = DatasetCursor()
        # Taken before self.lock by whatever writes this session's dataset (one at a time).
        self.dataset_lock = threading.Lock()
        # Called with the session lock held before a logged reset clears the chunks (the
        # dataset sink writes every finished episode first); None without a sink.
        self.before_reset: Callable[[Session], None] | None = None
        # Stored chunks whose action and state frames are not yet proved to decode.
        self._unverified: collections.deque[StoredChunk] = collections.deque()
        self._verify_lock = threading.Lock()
        # worker -> messages about its chunks found not to decode after their ack, for its
        # next ack.
        self._late: dict[str, list[str]] = {}
        self.clear_counters()

    def clear_counters(self) -> None:
        self.schema: Schema | None = None
        self.done_count = 0
        self.num_recorded_steps = 0
        self.env_steps = 0
        self.chunks_stored = 0
        self.chunks_dropped = 0
        self.publish_counters()

    def publish_counters(self) -> None:
        """Replace the counters snapshot (with the session lock held, or before any call)."""
        self.counters = Counters(
            next(_VERSIONS), self.is_full, self.num_recorded_steps, self.done_count
        )

    def counters_for(self, worker_id: str) -> tuple[Counters, int]:
        """The counters snapshot and the last of this worker's stored chunks it counts.

        Without the session lock: the worker's entry is read on both sides of the
        snapshot, and read again if a chunk of its was counted in between.
        """
        while True:
            before = self.counted.get(worker_id, 0)
            counters = self.counters
            if self.counted.get(worker_id, 0) == before:  # sequences only grow
                return counters, before

    def close(self) -> None:
        self.feeder.close()

    def touch(self) -> None:
        """The session was used now (--session-ttl counts from here)."""
        self.last_used = time.monotonic()

    # -- workers ---------------------------------------------------------
    def check_join(self, worker_id: str, config: SessionConfig) -> None:
        """Raise RequestError unless join(worker_id, config) would succeed."""
        check_worker_id(worker_id)
        with self.lock:
            if config != self.config:
                raise RequestError(
                    ErrorKind.SESSION_MISMATCH,
                    f"session mismatch: session {self.name!r} was created with "
                    f"{self.config.describe_difference(config)}",
                )
            if worker_id not in self.active and len(self.active) >= self.max_workers:
                raise RequestError(
                    ErrorKind.LIMIT,
                    f"workers: session {self.name!r} allows at most {self.max_workers} "
                    f"active workers, got one more ({_shown(worker_id)}); workers leave on "
                    "close() or after --worker-ttl",
                )

    def needs_log(self, worker_id: str, acked: int) -> bool:
        """Whether joining would change anything a restart must know."""
        with self.lock:
            return worker_id not in self.active or acked > self.last_sequence.get(worker_id, 0)

    def join(
        self,
        worker_id: str,
        config: SessionConfig,
        acked: int = 0,
        cause: LossCause | None = None,
    ) -> tuple[WorkerTimeline, int]:
        """Add (or resume) a worker; returns its timeline and the last sequence held.

        ``acked``: the highest sequence the client saw acknowledged. When the session holds
        less, the chunks in between were lost after their ack (``cause``: why, as the claim's
        check found it): they are counted, and the worker goes on from ``acked + 1``.
        """
        check_acked(acked)
        with self.lock:
            self.check_join(worker_id, config)
            timeline = self.workers.get(worker_id)
            if timeline is None:
                last = self.forgotten.pop(worker_id, 0)
                timeline = self.add_worker(worker_id, self.next_index, last)
            self.active.add(worker_id)
            self.last_seen[worker_id] = time.monotonic()
            self.touch()
        with self._worker_locks[worker_id]:
            held = self.last_sequence[worker_id]
            if acked > held:
                lost = acked - held
                self.last_sequence[worker_id] = acked
                self.sequences_lost[worker_id] = self.sequences_lost.get(worker_id, 0) + lost
                with self.lock:  # no episode is joined across the hole
                    timeline.cut()
                self.metrics.inc("Recorder/sequences_lost", lost, session=self.name)
                logger.warning(
                    "session %r, worker %r: chunks %d..%d were acknowledged but are not held "
                    "(%s); the worker goes on from %d",
                    self.name,
                    worker_id,
                    held + 1,
                    acked,
                    describe(cause) if cause is not None else "as the write-ahead log recorded",
                    acked + 1,
                )
        return timeline, held

    def add_worker(self, worker_id: str, index: int, last_sequence: int) -> WorkerTimeline:
        timeline = WorkerTimeline(worker_id, index)
        self.workers[worker_id] = timeline
        self.last_sequence[worker_id] = last_sequence
        self._worker_locks[worker_id] = threading.Lock()
        self.joined_at.setdefault(worker_id, time.time())
        self.next_index = max(self.next_index, index + 1)
        return timeline

    def leave(self, worker_id: str) -> bool:
        """The worker stops counting against max_workers; one without stored chunks is
        forgotten (its last sequence remembered). False when it was not active."""
        lock = self._worker_locks.get(worker_id)
        if lock is None:
            return False
        with lock, self.lock:
            if worker_id not in self.active:
                return False
            self.active.discard(worker_id)
            timeline = self.workers.get(worker_id)
            if timeline is not None and not timeline.chunks:
                self._forget(worker_id)
            return True

    def _forget(self, worker_id: str) -> None:
        # Call with the session lock held (and the worker's lock, unless it is inactive).
        del self.workers[worker_id]
        self._late.pop(worker_id, None)
        self.forgotten[worker_id] = self.last_sequence.pop(worker_id)
        self.forgotten.move_to_end(worker_id)
        while len(self.forgotten) > MAX_FORGOTTEN:
            self.forgotten.popitem(last=False)
        self._worker_locks.pop(worker_id, None)
        self.last_seen.pop(worker_id, None)
        self.joined_at.pop(worker_id, None)
        self.counted.pop(worker_id, None)
        self.metrics.forget(session=self.name, worker=worker_id)

    def idle_workers(self, now: float, ttl: float) -> list[str]:
        """Active workers that neither joined nor sent a chunk for ``ttl`` seconds."""
        with self.lock:
            # A worker restored from a checkpoint is seen first by the sweep.
            return [w for w in self.active if now - self.last_seen.setdefault(w, now) >= ttl]

    def worker(self, worker_id: str) -> WorkerTimeline:
        # Workers are added and forgotten under the lock; a lookup needs no lock.
        timeline = self.workers.get(worker_id)
        if timeline is None or worker_id not in self.active:
            raise self._not_joined(worker_id)
        return timeline

    def _not_joined(self, worker_id: str) -> RequestError:
        return RequestError(
            ErrorKind.NOT_JOINED,
            f"worker_id: expected a worker that joined session {self.name!r} (and did not "
            f"leave or expire), got {_shown(worker_id)}",
        )

    @property
    def is_full(self) -> bool:
        return self.config.max_episodes is not None and self.done_count >= self.config.max_episodes

    # -- ingest ----------------------------------------------------------
    def apply(self, worker_id: str, chunk: Chunk, *, log: bool = True) -> Applied:
        """Take one chunk of a worker. With a journal, the chunk is in the write-ahead log
        before anything changes (log=False when replaying that log)."""
        timeline = self.worker(worker_id)
        lock = self._worker_locks.get(worker_id)
        if lock is None:  # forgotten since the lookup
            raise self._not_joined(worker_id)
        with lock:
            if self.dropped:
                raise dropped_error(self.name, self.dropped_at)
            if self.workers.get(worker_id) is not timeline or worker_id not in self.active:
                raise self._not_joined(worker_id)
            seq = chunk.sequence
            last = self.last_sequence[worker_id]
            if seq <= last:
                return Applied.DUPLICATE
            if seq != last + 1:
                raise RequestError(
                    ErrorKind.SEQUENCE_GAP,
                    f"chunk.sequence: expected {last + 1} for worker {worker_id!r}, got {seq}",
                )
            # The sequence is consumed whatever happens next, so a refused chunk never
            # blocks the ones behind it.
            self.last_sequence[worker_id] = seq
            self.last_seen[worker_id] = self.last_used = time.monotonic()
            if self.is_full:
                return self._drop_full(worker_id, timeline, seq, log)
            try:
                if chunk.refused is not None:
                    raise chunk.refused
                decoded = decode_chunk(chunk, self.config, self.feeder.alloc, self._lazy)
            except RequestError:
                self._skip(worker_id, timeline, seq, log, cut=True)
                raise
            with self.lock:
                if self.dropped:
                    raise dropped_error(self.name, self.dropped_at)
                if self.is_full:
                    return self._drop_full(worker_id, timeline, seq, log)
                if chunk.cut_before:  # the client dropped chunks just before this one
                    timeline.cut()
                elif chunk.fresh_start:  # a new recorder instance's envs: new episodes
                    timeline.cut(fresh=True)
                try:
                    check_schema(self.schema, timeline.num_envs, decoded, timeline.open_empty())
                except RequestError:
                    self._skip(worker_id, timeline, seq, log, cut=True)
                    raise
                if log and self.journal is not None:
                    try:
                        self.journal(records.chunk(self.name, worker_id, chunk))
                    except OSError as exc:
                        # Not taken: the client keeps the chunk and resends it.
                        self.last_sequence[worker_id] = seq - 1
                        raise RequestError(
                            ErrorKind.STORAGE,
                            f"data directory: cannot append chunk {seq} of {worker_id!r} to the "
                            f"write-ahead log ({exc.strerror or exc}); nothing acknowledged is "
                            "affected, and the chunk is taken once space is freed",
                        ) from None
                stored = {k: a for k, a in chunk.arrays.items() if k != "outcome"}
                env, start, end, partial = timeline.add_chunk(
                    decoded.dones,
                    stored,
                    chunk.wire_bytes,
                    chunk.arrays.get("outcome"),
                    decoded.arrays.get("valid"),
                    chunk.parts,
                )
                kept = timeline.chunks[-1]
                kept.worker, kept.sequence = worker_id, seq  # named if a frame fails its proof
                if decoded.unverified:
                    kept.unverified = decoded.unverified
                    self._unverified.append(kept)
                if self.schema is None:
                    self.schema = decoded.schema
                self.done_count += int(env.size)
                self.num_recorded_steps += decoded.length
                self.publish_counters()
                # After the snapshot: whoever sees this entry sees a snapshot that counts it.
                self.counted[worker_id] = seq
                self.chunks_stored += 1
                steps_before = self.env_steps
                self.env_steps += decoded.length * decoded.num_envs
                # Under the session lock so the feeder sees chunks in apply order.
                needed = {k: a for k, a in decoded.arrays.items() if self.feeder.needs(k)}
                self.feeder.submit(
                    ChunkEpisodes(
                        timeline.index,
                        timeline.chunks[-1],
                        needed,
                        env,
                        start,
                        end,
                        timeline.oldest_open(),
                        steps_before,
                        partial,
                        chunk.parts,
                    )
                )
            raw = sum(a.nbytes for a in stored.values())
            self.metrics.inc_many(
                {
                    "Recorder/chunks": 1,
                    "Recorder/raw_bytes": raw,
                    "Recorder/wire_bytes": chunk.wire_bytes,
                    "Recorder/steps": decoded.length,
                    "Recorder/env_steps": decoded.length * decoded.num_envs,
                },
                session=self.name,
            )
            if decoded.unverified:
                VERIFIER.submit(self)
            return Applied.STORED

    # -- frames acknowledged on their headers (see ingest.verify) ---------
    def _lazy(self, key: str) -> bool:
        """Whether a chunk's array `key` is acknowledged before it is decoded: what the
        feeder does not read as it arrives (a stored episode that reads it later proves it
        first)."""
        return not self.feeder.needs(key)

    def queue_unverified(self) -> None:
        """Hand every stored chunk not yet proved to the background verifier (restored
        chunks)."""
        with self.lock:
            for timeline in self.workers.values():
                self._unverified.extend(c for c in timeline.chunks if c.unverified)
        if self._unverified:
            VERIFIER.submit(self)

    def _skip(
        self, worker_id: str, timeline: WorkerTimeline, seq: int, log: bool, *, cut: bool
    ) -> None:
        """Chunk ``seq`` took its sequence and is not stored (refused, or dropped on a full
        session): logged, so that a replay takes the sequence too and the worker's next
        chunk follows it. A refused chunk's steps are a hole (``cut``): no episode spans it.
        Call with the worker's lock held."""
        with self.lock:
            if log and self.journal is not None:
                try:
                    self.journal(records.skip(self.name, worker_id, seq, cut))
                except OSError as exc:
                    self.last_sequence[worker_id] = seq - 1  # not taken: it comes again
                    raise RequestError(
                        ErrorKind.STORAGE,
                        f"data directory: cannot log that chunk {seq} of {worker_id!r} is not "
                        f"stored ({exc.strerror or exc}); send it again once space is freed",
                    ) from None
            if cut:
                timeline.cut()

    def skip(self, worker_id: str, seq: int, *, cut: bool) -> None:
        """Replay a logged skip (`_skip`)."""
        timeline = self.worker(worker_id)
        with self._worker_locks[worker_id]:
            self.last_sequence[worker_id] = max(self.last_sequence[worker_id], seq)
            self._skip(worker_id, timeline, seq, False, cut=cut)

    def _drop_full(self, worker_id: str, timeline: WorkerTimeline, seq: int, log: bool) -> Applied:
        self._skip(worker_id, timeline, seq, log, cut=False)
        with self.lock:
            self.chunks_dropped += 1
            timeline.chunks_dropped += 1
        self.metrics.inc("Recorder/chunks_dropped_full", 1, session=self.name)
        return Applied.DROPPED_FULL

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Hold every worker's lock, then the session lock: no chunk is between taking its
        sequence and being stored, so a snapshot's sequences match its chunks."""
        with contextlib.ExitStack() as stack:
            for lock in list(self._worker_locks.values()):
                stack.enter_context(lock)
            stack.enter_context(self.lock)
            yield

    # -- results ---------------------------------------------------------
    def assemble(self, pad_incomplete: bool, include_partial: bool = False) -> Assembly:
        with self.lock:
            self.touch()
            try:
                return assemble(
                    list(self.workers.values()),
                    pad_incomplete=pad_incomplete,
                    include_partial=include_partial,
                    max_episodes=self.config.max_episodes,
                    schema=dict(self.schema or {}),
                    state_order=list(self.config.state_fields),
                )
            except NoEpisodesError as exc:
                raise RequestError(ErrorKind.NO_DATA, str(exc)) from None

    def reset(self, *, log: bool = True) -> None:
        """Drop every stored chunk and the counters; the configuration and workers stay."""
        with self.dataset_lock, self.lock:
            if log and self.before_reset is not None:
                self.before_reset(self)
            if log and self.journal is not None:
                self._journal(records.reset(self.name))
            self.dataset.reset()
            self.touch()
            self.feeder.reset()
            if self.processor.store is not None:
                # Stored episodes still read from this session's chunks: encoded first.
                self.processor.store.encode_deferred()
            for timeline in self.workers.values():
                timeline.clear()
            self._unverified.clear()
            self.clear_counters()
            # Workers that left or expired held a place only for their chunks.
            # (No worker lock: an inactive worker's chunk is refused before it changes
            # anything, and lock order is worker locks, then the session lock.)
            for worker_id in [w for w in self.workers if w not in self.active]:
                self._forget(worker_id)

    def status(self) -> SessionStatus:
        now = time.monotonic()
        with self.lock:
            workers = tuple(
                WorkerStatus(
                    worker_id=tl.worker_id,
                    worker_index=tl.index,
                    num_envs=tl.num_envs or 0,
                    last_sequence=self.last_sequence[tl.worker_id],
                    chunks_stored=len(tl.chunks),
                    chunks_dropped=tl.chunks_dropped,
                    steps=tl.t_total,
                    episodes_finished=tl.episodes_finished,
                    raw_bytes=tl.raw_bytes,
                    wire_bytes=tl.wire_bytes,
                    sequences_lost=self.sequences_lost.get(tl.worker_id, 0),
                    active=tl.worker_id in self.active,
                    idle_seconds=max(0.0, now - self.last_seen.get(tl.worker_id, now)),
                    joined_unix=self.joined_at.get(tl.worker_id, 0.0),
                )
                for tl in self.workers.values()
            )
            return SessionStatus(
                session=self.name,
                is_full=self.is_full,
                num_recorded_steps=self.num_recorded_steps,
                episodes_finished=self.done_count,
                chunks_stored=self.chunks_stored,
                chunks_dropped=self.chunks_dropped,
                raw_bytes=sum(w.raw_bytes for w in workers),
                wire_bytes=sum(w.wire_bytes for w in workers),
                max_episodes=self.config.max_episodes,
                record_states=self.config.record_states,
                state_fields=self.config.state_fields,
                workers=workers,
                sequences_lost=sum(self.sequences_lost.values()),
                idle_seconds=max(0.0, now - self.last_used),
            )

    def _journal(self, record: list) -> None:
        append(self.journal, record)

    def worker_lags(self, now: float) -> dict[str, float]:
        with self.lock:
            return {w: now - seen for w, seen in self.last_seen.items()}
