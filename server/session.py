"""A recording session: configuration, workers in join order, validation, counters.

Plain Python and numpy. Refusals raise `RequestError` with a typed kind and a message that
names the field, what was expected and what arrived; a refused request changes nothing.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from collections.abc import Callable

from recorder_client.capture_types import EpisodeOutcome, TrajectorySliceReference
from recorder_client.status import SessionStatus, WorkerStatus

from .chunks import Chunk, Schema, SessionConfig, SubmittedEpisode, check_schema, decode_chunk
from .durability import records
from .durability.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .episodes import Assembly, NoEpisodesError, WorkerTimeline, assemble
from .errors import ErrorKind, RequestError, invalid
from .ingest import ChunkEpisodes, EpisodeFeeder
from .store import EpisodeArrays, TrajectoryCaptureProcessor, build_store

SESSION_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")

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


class Applied(enum.Enum):
    """What a session did with a chunk."""

    STORED = "stored"
    DROPPED_FULL = "dropped_full"
    """Not stored: the session had reached max_episodes."""
    DUPLICATE = "duplicate"
    """Taken before (a resend): nothing changed."""


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 64 else f"{text[:64]!r}... ({len(text)} characters)"


def check_session_name(name: str) -> str:
    if not SESSION_NAME.fullmatch(name or ""):
        raise invalid(
            "session: expected 1-128 characters from [A-Za-z0-9._-] not starting with '.', "
            f"got {_shown(name)}"
        )
    return name


def check_worker_id(worker_id: str) -> str:
    if not worker_id or len(worker_id) > 128 or not worker_id.isprintable():
        raise invalid(f"worker_id: expected 1-128 printable characters, got {_shown(worker_id)}")
    return worker_id


class SessionMetrics:
    """The processor's metrics object: every value it logs carries the session label."""

    def __init__(self, metrics, session: str) -> None:
        self._metrics = metrics
        self._session = session

    def log_many(self, values: dict[str, float], step: int) -> None:
        self._metrics.log_many(values, step, session=self._session)


class Session:
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
        self.workers: dict[str, WorkerTimeline] = {}
        self.last_sequence: dict[str, int] = {}
        self._worker_locks: dict[str, threading.Lock] = {}
        self.last_seen: dict[str, float] = {}
        self.processor = TrajectoryCaptureProcessor(
            config.capture, SessionMetrics(metrics, name), build_store(config.capture)
        )
        self.feeder = EpisodeFeeder(name, self.processor, metrics, queue_chunks=32)
        self.clear_counters()

    def clear_counters(self) -> None:
        self.schema: Schema | None = None
        self.done_count = 0
        self.num_recorded_steps = 0
        self.env_steps = 0
        self.chunks_stored = 0
        self.chunks_dropped = 0

    def close(self) -> None:
        self.feeder.close()

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
            if worker_id not in self.workers and len(self.workers) >= self.max_workers:
                raise RequestError(
                    ErrorKind.LIMIT,
                    f"workers: session {self.name!r} allows at most {self.max_workers} "
                    f"workers, got one more ({_shown(worker_id)})",
                )

    def join(self, worker_id: str, config: SessionConfig) -> WorkerTimeline:
        with self.lock:
            self.check_join(worker_id, config)
            timeline = self.workers.get(worker_id)
            if timeline is None:
                timeline = self.add_worker(worker_id, len(self.workers), 0)
            return timeline

    def add_worker(self, worker_id: str, index: int, last_sequence: int) -> WorkerTimeline:
        timeline = WorkerTimeline(worker_id, index)
        self.workers[worker_id] = timeline
        self.last_sequence[worker_id] = last_sequence
        self._worker_locks[worker_id] = threading.Lock()
        return timeline

    def worker(self, worker_id: str) -> WorkerTimeline:
        # Workers are only ever added (under the lock); a lookup needs no lock.
        timeline = self.workers.get(worker_id)
        if timeline is None:
            raise RequestError(
                ErrorKind.NOT_JOINED,
                f"worker_id: expected a worker that joined session {self.name!r}, "
                f"got {_shown(worker_id)}",
            )
        return timeline

    @property
    def is_full(self) -> bool:
        return self.config.max_episodes is not None and self.done_count >= self.config.max_episodes

    # -- ingest ----------------------------------------------------------
    def apply(self, worker_id: str, chunk: Chunk, *, log: bool = True) -> Applied:
        """Take one chunk of a worker. With a journal, the chunk is in the write-ahead log
        before anything changes (log=False when replaying that log)."""
        timeline = self.worker(worker_id)
        with self._worker_locks[worker_id]:
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
            self.last_seen[worker_id] = time.monotonic()
            if self.is_full:
                return self._drop_full(timeline)
            if chunk.refused is not None:
                raise chunk.refused
            decoded = decode_chunk(chunk, self.config, self.feeder.alloc)
            with self.lock:
                if self.is_full:
                    return self._drop_full(timeline)
                check_schema(self.schema, timeline.num_envs, decoded)
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
                env, start, end = timeline.add_chunk(decoded.dones, stored, chunk.wire_bytes)
                if self.schema is None:
                    self.schema = decoded.schema
                self.done_count += int(env.size)
                self.num_recorded_steps += decoded.length
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
                    )
                )
            raw = sum(a.nbytes for a in stored.values())
            labels = {"session": self.name}
            self.metrics.inc("Recorder/chunks", 1, **labels)
            self.metrics.inc("Recorder/raw_bytes", raw, **labels)
            self.metrics.inc("Recorder/wire_bytes", chunk.wire_bytes, **labels)
            self.metrics.inc("Recorder/steps", decoded.length, **labels)
            self.metrics.inc("Recorder/env_steps", decoded.length * decoded.num_envs, **labels)
            return Applied.STORED

    def _drop_full(self, timeline: WorkerTimeline) -> Applied:
        with self.lock:
            self.chunks_dropped += 1
            timeline.chunks_dropped += 1
        self.metrics.inc("Recorder/chunks_dropped_full", 1, session=self.name)
        return Applied.DROPPED_FULL

    # -- results ---------------------------------------------------------
    def assemble(self, pad_incomplete: bool) -> Assembly:
        with self.lock:
            try:
                return assemble(
                    list(self.workers.values()),
                    pad_incomplete=pad_incomplete,
                    max_episodes=self.config.max_episodes,
                    schema=dict(self.schema or {}),
                    state_order=list(self.config.state_fields),
                )
            except NoEpisodesError as exc:
                raise RequestError(ErrorKind.NO_DATA, str(exc)) from None

    def reset(self, *, log: bool = True) -> None:
        """Drop every stored chunk and the counters; the configuration and workers stay."""
        with self.lock:
            if log and self.journal is not None:
                self._journal(records.reset(self.name))
            self.feeder.reset()
            if self.processor.store is not None:
                # Stored episodes still read from this session's chunks: encoded first.
                self.processor.store.encode_deferred()
            for timeline in self.workers.values():
                timeline.clear()
            self.clear_counters()

    def status(self) -> SessionStatus:
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
            )

    # -- trajectory store ------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the store and metrics reflect every chunk taken so far."""
        return self.feeder.drain(timeout)

    def submit_episode(self, episode: SubmittedEpisode, *, log: bool = True) -> int:
        """Record one whole episode (emulator-style producers); returns the episodes captured."""
        self.drain()
        try:
            outcome = EpisodeOutcome(episode.outcome)
        except ValueError:
            raise invalid(
                f"outcome: expected 0..{max(EpisodeOutcome)}, got {episode.outcome}"
            ) from None
        try:
            arrays = EpisodeArrays(
                episode.arrays["actions"].decode("episode.actions"),
                episode.arrays["rewards"].decode("episode.rewards"),
                {
                    k[len("state:") :]: a.decode(f"episode.states[{k[6:]!r}]")
                    for k, a in episode.arrays.items()
                    if k.startswith("state:")
                },
            )
        except (KeyError, ValueError) as exc:
            raise invalid(f"episode: {exc}") from None
        reference = None
        if episode.start_reference is not None:
            reference = TrajectorySliceReference(*episode.start_reference)
        with self.lock:
            if log and self.journal is not None:
                self._journal(records.episode(self.name, episode))
            try:
                self.processor.record_episode(
                    arrays,
                    dict(episode.episode_data),
                    episode.step,
                    outcome=outcome,
                    start_reference=reference,
                )
            except ValueError as exc:
                raise invalid(f"episode: {exc}") from None
        self.processor.log_metrics(episode.step)
        return self.processor.runtime_state_dict()["counters"]["episodes_captured"]

    def require_store(self, verb: str) -> None:
        if self.processor.store is None:
            raise RequestError(
                ErrorKind.NO_STORE,
                f"{verb}: session {self.name!r} has no trajectory store (it was created "
                "without capture=)",
            )

    def sample_start(self) -> tuple[TrajectorySliceReference, EpisodeArrays] | None:
        self.drain()
        return self.processor.sample_start()

    def snapshot_potential(self, utility_key: str, field_names: list[str]) -> dict:
        self.drain()
        try:
            return self.processor.snapshot_potential(utility_key, field_names)
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def store_checkpoint(self, compress: bool, step: int) -> tuple[str, bytes] | None:
        """The store as (file name, bytes in the checksummed checkpoint format), or None
        without a store."""
        self.drain()
        file = self.processor.trajectory_store_checkpoint_file(compress, checkpoint_step=step)
        if file is None:
            return None
        return file.name, encode_checkpoint(file.data, compress=False)

    def load_store_checkpoint(self, data: bytes) -> None:
        """Replace the store with one from store_checkpoint (of any server)."""
        self.require_store("store checkpoint")
        self.drain()
        try:
            payload = decode_checkpoint(data, source="store checkpoint")
            self.processor.load_trajectory_store_checkpoint_data(payload)
        except (CheckpointError, ValueError) as exc:
            raise invalid(f"store checkpoint: {exc}") from None

    def _journal(self, record: list) -> None:
        append(self.journal, record)

    def worker_lags(self, now: float) -> dict[str, float]:
        with self.lock:
            return {w: now - seen for w, seen in self.last_seen.items()}
