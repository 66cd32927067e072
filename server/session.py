"""A recording session: configuration, workers in join order, validation, counters.

Plain Python and numpy; the gRPC servicer translates to and from messages.
Errors raise `SessionError` with a gRPC status code name and a message that
names the field, what was expected and what arrived.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recorder_client import codec
from recorder_client._proto import recorder_pb2 as pb
from recorder_client.capture_types import TrajectoryTrainingConfiguration

from .capture import TrajectoryCaptureProcessor, build_store
from .durability import KIND_CHUNK, encode_record, is_disk_full
from .episodes import Assembly, EncodedArray, WorkerTimeline, assemble
from .feeder import ChunkEpisodes, EpisodeFeeder

SESSION_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class SessionError(Exception):
    """A refused request: `code` is a grpc.StatusCode name; `kind` a stable tag."""

    def __init__(self, code: str, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


def check_session_name(name: str) -> str:
    if not SESSION_NAME.fullmatch(name or ""):
        raise SessionError(
            "INVALID_ARGUMENT",
            f"session: expected 1-128 characters from [A-Za-z0-9._-] not starting with '.', "
            f"got {name!r}",
        )
    return name


def check_worker_id(worker_id: str) -> str:
    if not worker_id or len(worker_id) > 128 or not worker_id.isprintable():
        raise SessionError(
            "INVALID_ARGUMENT",
            f"worker_id: expected 1-128 printable characters, got {worker_id!r}",
        )
    return worker_id


@dataclass(frozen=True)
class SessionConfig:
    max_episodes: int | None
    record_states: bool
    state_fields: tuple[str, ...]
    capture: TrajectoryTrainingConfiguration | None = None

    @classmethod
    def from_proto(cls, msg: pb.SessionConfig) -> SessionConfig:
        max_episodes = msg.max_episodes if msg.HasField("max_episodes") else None
        if max_episodes is not None and max_episodes < 0:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"config.max_episodes: expected a non-negative integer or unset, got {max_episodes}",
            )
        from recorder_client.naming import check_state_fields

        try:
            fields = tuple(check_state_fields(list(msg.state_fields)))
        except ValueError as exc:
            raise SessionError("INVALID_ARGUMENT", f"config.{exc}") from None
        capture = None
        if msg.capture_config_json:
            try:
                capture = TrajectoryTrainingConfiguration.from_dict(
                    json.loads(msg.capture_config_json)
                )
            except (ValueError, TypeError) as exc:
                raise SessionError(
                    "INVALID_ARGUMENT", f"config.capture_config_json: {exc}"
                ) from None
        return cls(max_episodes, msg.record_states, fields, capture)

    def to_proto(self) -> pb.SessionConfig:
        msg = pb.SessionConfig(record_states=self.record_states, state_fields=self.state_fields)
        if self.max_episodes is not None:
            msg.max_episodes = self.max_episodes
        if self.capture is not None:
            msg.capture_config_json = json.dumps(self.capture.to_dict(), sort_keys=True)
        return msg

    def describe_difference(self, other: SessionConfig) -> str:
        diffs = [
            f"{name}={getattr(self, name)!r} (this worker asked for {getattr(other, name)!r})"
            for name in ("max_episodes", "record_states", "state_fields", "capture")
            if getattr(self, name) != getattr(other, name)
        ]
        return ", ".join(diffs)


@dataclass
class DecodedChunk:
    """A validated chunk: its done flags, its arrays as they came, and their schema."""

    sequence: int
    length: int
    num_envs: int
    dones: np.ndarray
    arrays: dict[str, np.ndarray]
    encoded: dict[str, EncodedArray]
    schema: dict[str, tuple[np.dtype, tuple[int, ...]]]
    wire_bytes: int


# (shape, dtype) -> a C-contiguous array to decode into.
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


def decode_chunk(
    chunk: pb.Chunk, config: SessionConfig, max_raw: int, alloc: Allocator | None = None
) -> DecodedChunk:
    """Check one chunk on its own (shapes agree, dtypes allowed, frames intact). ``alloc``
    gives the buffers the arrays are decoded into (default: fresh ones)."""
    try:
        return _decode_chunk(chunk, config, max_raw, alloc)
    except codec.ArrayDecodeError as exc:
        raise SessionError("INVALID_ARGUMENT", str(exc)) from None


def _decode_chunk(
    chunk: pb.Chunk, config: SessionConfig, max_raw: int, alloc: Allocator | None
) -> DecodedChunk:
    for name in ("action", "reward", "done"):
        if not chunk.HasField(name):
            raise SessionError("INVALID_ARGUMENT", f"chunk.{name}: expected an array, got none")
    a_dtype, a_shape = codec.declared(chunk.action, "chunk.action", max_raw)
    if len(a_shape) not in (2, 3):
        raise SessionError(
            "INVALID_ARGUMENT",
            f"chunk.action: expected shape (T, N) or (T, N, P), got {list(a_shape)}",
        )
    length, n = a_shape[:2]
    expected_tn = [length, n]
    for name in ("reward", "done"):
        msg = getattr(chunk, name)
        _, shape = codec.declared(msg, f"chunk.{name}", max_raw)
        if list(shape) != expected_tn:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"chunk.{name}: expected shape {expected_tn} (T, N) like chunk.action, "
                f"got {list(shape)}",
            )
    if chunk.done.dtype != "|b1":
        raise SessionError(
            "INVALID_ARGUMENT", f"chunk.done.dtype: expected '|b1' (bool), got {chunk.done.dtype!r}"
        )
    allowed = set(config.state_fields) if config.record_states else set()
    seen: set[str] = set()
    for named in chunk.states:
        what = f"chunk.states[{named.name!r}]"
        if named.name not in allowed:
            expected = sorted(allowed) if allowed else "none (record_states is off)"
            raise SessionError(
                "INVALID_ARGUMENT",
                f"chunk.states: expected fields from {expected}, got {named.name!r}",
            )
        if named.name in seen:
            raise SessionError("INVALID_ARGUMENT", f"{what}: field sent twice")
        seen.add(named.name)
        _, shape = codec.declared(named.array, what, max_raw)
        if list(shape[:2]) != expected_tn or len(shape) < 2:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"{what}: expected shape starting with {expected_tn} (T, N), got {list(shape)}",
            )
    if config.capture is not None:
        # The store keys cells on state fields; a chunk without them cannot feed it.
        sent = sorted(seen)
        for cell in config.capture.cell_fields:
            if cell.state_field not in seen:
                raise SessionError(
                    "INVALID_ARGUMENT",
                    f"chunk.states: expected the cell-key field {cell.state_field!r} of the "
                    f"session's capture configuration (record it with record_states=True), "
                    f"got fields {sent}",
                )
    arrays: dict[str, np.ndarray] = {}
    if chunk.HasField("outcome"):
        o_dtype, o_shape = codec.declared(chunk.outcome, "chunk.outcome", max_raw)
        if list(o_shape) != expected_tn or o_dtype.kind not in "iu":
            raise SessionError(
                "INVALID_ARGUMENT",
                f"chunk.outcome: expected integer codes of shape {expected_tn} (T, N), "
                f"got {o_dtype} {list(o_shape)}",
            )
        arrays["outcome"] = codec.decode_array(chunk.outcome, "chunk.outcome", max_raw)
    wire = 0
    encoded: dict[str, EncodedArray] = {}
    schema: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    pairs = [("action", chunk.action), ("reward", chunk.reward), ("done", chunk.done)]
    pairs += [(f"state:{s.name}", s.array) for s in chunk.states]
    for key, msg in pairs:
        # Decoding proves the frame is intact before the ack promises anything.
        if alloc is None or key == "done":
            arr = codec.decode_array(msg, f"chunk.{key}", max_raw)
        else:
            dtype, shape = codec.declared(msg, f"chunk.{key}", max_raw)
            arr = alloc(shape, dtype)
            codec.decode_into(msg, arr, f"chunk.{key}")
        arrays[key] = arr
        if key != "done":
            schema[key] = (arr.dtype, arr.shape[2:])
        encoded[key] = EncodedArray(arr.dtype, arr.shape, msg.codec, msg.data)
        wire += len(msg.data)
    return DecodedChunk(chunk.sequence, length, n, arrays["done"], arrays, encoded, schema, wire)


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
        self, name: str, config: SessionConfig, metrics, *, max_workers: int = 1024
    ) -> None:
        self.name = name
        self.config = config
        self.metrics = metrics
        self.max_workers = max_workers
        self.lock = threading.RLock()
        self.workers: dict[str, WorkerTimeline] = {}
        self.last_sequence: dict[str, int] = {}
        self.worker_locks: dict[str, threading.Lock] = {}
        self.last_seen: dict[str, float] = {}
        self.processor = TrajectoryCaptureProcessor(
            config.capture, SessionMetrics(metrics, name), build_store(config.capture)
        )
        # With a store, the chunks queued behind the feeder are recorded in one store call.
        self.feeder = EpisodeFeeder(name, self.processor, metrics, queue_chunks=32)
        # Appends a log record before a change is acknowledged; None without a log.
        self.journal: Callable[[bytes], None] | None = None
        self._clear()

    def _clear(self) -> None:
        self.schema: dict[str, tuple[np.dtype, tuple[int, ...]]] | None = None
        self.done_count = 0
        self.num_recorded_steps = 0
        self.env_steps = 0
        self.chunks_stored = 0
        self.chunks_dropped = 0

    def close(self) -> None:
        self.feeder.close()

    # -- workers ---------------------------------------------------------
    def check_join(self, worker_id: str, config: SessionConfig) -> None:
        """Raise SessionError unless join(worker_id, config) would succeed."""
        check_worker_id(worker_id)
        with self.lock:
            if config != self.config:
                raise SessionError(
                    "FAILED_PRECONDITION",
                    f"session mismatch: session {self.name!r} was created with "
                    f"{self.config.describe_difference(config)}",
                    kind="session_mismatch",
                )
            if worker_id not in self.workers and len(self.workers) >= self.max_workers:
                raise SessionError(
                    "RESOURCE_EXHAUSTED",
                    f"workers: session {self.name!r} allows at most {self.max_workers} "
                    f"workers, got one more ({worker_id!r})",
                )

    def join(self, worker_id: str, config: SessionConfig) -> WorkerTimeline:
        with self.lock:
            self.check_join(worker_id, config)
            timeline = self.workers.get(worker_id)
            if timeline is None:
                timeline = WorkerTimeline(worker_id, len(self.workers))
                self.workers[worker_id] = timeline
                self.last_sequence[worker_id] = 0
                self.worker_locks[worker_id] = threading.Lock()
            return timeline

    def worker(self, worker_id: str) -> WorkerTimeline:
        with self.lock:
            timeline = self.workers.get(worker_id)
        if timeline is None:
            raise SessionError(
                "FAILED_PRECONDITION",
                f"worker_id: expected a worker that joined session {self.name!r}, "
                f"got {worker_id!r}",
            )
        return timeline

    @property
    def is_full(self) -> bool:
        return self.config.max_episodes is not None and self.done_count >= self.config.max_episodes

    # -- ingest ----------------------------------------------------------
    def apply(self, worker_id: str, chunk: pb.Chunk, max_raw: int, *, log: bool = True) -> int:
        """Take one chunk; returns a RecordAck.Result value. Raises SessionError.

        With a journal, the chunk is in the write-ahead log before anything
        changes (log=False when replaying that log).
        """
        timeline = self.worker(worker_id)
        with self.worker_locks[worker_id]:
            seq = chunk.sequence
            last = self.last_sequence[worker_id]
            if seq <= last:
                return pb.RecordAck.DUPLICATE
            if seq != last + 1:
                raise SessionError(
                    "FAILED_PRECONDITION",
                    f"chunk.sequence: expected {last + 1} for worker {worker_id!r}, got {seq}",
                )
            # The sequence is consumed whatever happens next, so a refused chunk
            # never blocks the ones behind it.
            self.last_sequence[worker_id] = seq
            self.last_seen[worker_id] = time.monotonic()
            if self.is_full:
                return self._drop_full(timeline)
            decoded = decode_chunk(chunk, self.config, max_raw, self.feeder.alloc)
            with self.lock:
                if self.is_full:
                    return self._drop_full(timeline)
                self._check_schema(timeline, decoded)
                if log and self.journal is not None:
                    try:
                        self.journal(
                            encode_record(
                                KIND_CHUNK, self.name, worker_id, chunk.SerializeToString()
                            )
                        )
                    except OSError as exc:
                        # Not taken: the client keeps the chunk and resends it.
                        self.last_sequence[worker_id] = seq - 1
                        raise SessionError(
                            "RESOURCE_EXHAUSTED",
                            f"data directory: cannot append chunk {seq} of {worker_id!r} to the "
                            f"write-ahead log ({exc.strerror or exc}); nothing acknowledged is "
                            "affected, and the chunk is taken once space is freed",
                            kind="disk_full" if is_disk_full(exc) else "",
                        ) from None
                t0 = timeline.t_total
                env, start, end = timeline.add_chunk(
                    decoded.dones, decoded.encoded, decoded.wire_bytes
                )
                if self.schema is None:
                    self.schema = decoded.schema
                self.done_count += int(env.size)
                self.num_recorded_steps += decoded.length
                self.chunks_stored += 1
                steps_before = self.env_steps
                self.env_steps += decoded.length * decoded.num_envs
                # Under the session lock so the feeder sees chunks in apply order.
                self.feeder.submit(
                    ChunkEpisodes(
                        timeline.index,
                        t0,
                        decoded.arrays,
                        env,
                        start,
                        end,
                        steps_before,
                        timeline.chunks[-1],
                    )
                )
            raw = sum(a.nbytes for a in decoded.encoded.values())
            labels = {"session": self.name}
            self.metrics.inc("Recorder/chunks", 1, **labels)
            self.metrics.inc("Recorder/raw_bytes", raw, **labels)
            self.metrics.inc("Recorder/wire_bytes", decoded.wire_bytes, **labels)
            self.metrics.inc("Recorder/steps", decoded.length, **labels)
            self.metrics.inc("Recorder/env_steps", decoded.length * decoded.num_envs, **labels)
            return pb.RecordAck.STORED

    def _drop_full(self, timeline: WorkerTimeline) -> int:
        with self.lock:
            self.chunks_dropped += 1
            timeline.chunks_dropped += 1
        self.metrics.inc("Recorder/chunks_dropped_full", 1, session=self.name)
        return pb.RecordAck.DROPPED_FULL

    def _check_schema(self, timeline: WorkerTimeline, chunk: DecodedChunk) -> None:
        if timeline.num_envs is not None and chunk.num_envs != timeline.num_envs:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"chunk.N: expected {timeline.num_envs} environments like this worker's "
                f"earlier chunks, got {chunk.num_envs}",
            )
        if self.schema is None:
            return
        expected_states = sorted(k[6:] for k in self.schema if k.startswith("state:"))
        got_states = sorted(k[6:] for k in chunk.schema if k.startswith("state:"))
        if expected_states != got_states:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"chunk.states: expected fields {expected_states} like the session's earlier "
                f"chunks, got {got_states}",
            )
        for key, (dtype, trailing) in self.schema.items():
            got_dtype, got_trailing = chunk.schema[key]
            label = "action" if key == "action" else key
            if got_dtype != dtype:
                raise SessionError(
                    "INVALID_ARGUMENT",
                    f"chunk.{label}.dtype: expected {dtype} like the session's earlier chunks, "
                    f"got {got_dtype}",
                )
            if got_trailing != trailing:
                raise SessionError(
                    "INVALID_ARGUMENT",
                    f"chunk.{label}.shape: expected trailing shape {list(trailing)} after (T, N) "
                    f"like the session's earlier chunks, got {list(got_trailing)}",
                )

    # -- results ---------------------------------------------------------
    def assemble(self, pad_incomplete: bool) -> Assembly:
        with self.lock:
            timelines = list(self.workers.values())
            schema = dict(self.schema or {})
            return assemble(
                timelines,
                pad_incomplete=pad_incomplete,
                max_episodes=self.config.max_episodes,
                schema=schema,
                state_order=list(self.config.state_fields),
            )

    def reset(self) -> None:
        with self.lock:
            self.feeder.reset()
            if self.processor.store is not None:
                # Stored episodes still read from this session's chunks: encoded before the
                # chunks go.
                self.processor.store.encode_deferred()
            for timeline in self.workers.values():
                timeline.clear()
            self._clear()

    def status(self) -> pb.StatusReply:
        with self.lock:
            reply = pb.StatusReply(
                session=self.name,
                config=self.config.to_proto(),
                is_full=self.is_full,
                num_recorded_steps=self.num_recorded_steps,
                episodes_finished=self.done_count,
                chunks_stored=self.chunks_stored,
                chunks_dropped=self.chunks_dropped,
            )
            for tl in self.workers.values():
                reply.raw_bytes += tl.raw_bytes
                reply.wire_bytes += tl.wire_bytes
                reply.workers.append(
                    pb.WorkerStatus(
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
                )
            return reply
