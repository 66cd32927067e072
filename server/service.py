"""The gRPC servicer: translates messages and status codes, nothing more."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from recorder_client import codec
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_client.capture_types import EpisodeOutcome, TrajectorySliceReference

from .episodes import NoEpisodesError
from .metrics import MetricsTracker
from .session import Session, SessionConfig, SessionError, check_session_name
from .store import EpisodeArrays

logger = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 4 << 20
FILE_PART_BYTES = 1 << 20


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds on what one server accepts."""

    max_sessions: int = 64
    max_workers_per_session: int = 1024
    # Largest raw size of one array in a chunk.
    max_array_bytes: int = 1 << 31


class RecorderService(pb_grpc.RecorderServicer):
    def __init__(
        self, limits: ServiceLimits | None = None, metrics: MetricsTracker | None = None
    ) -> None:
        self.limits = limits or ServiceLimits()
        self.metrics = metrics or MetricsTracker()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def close(self) -> None:
        for session in self.sessions():
            session.close()

    # -- helpers ---------------------------------------------------------
    @staticmethod
    def _abort(context: grpc.ServicerContext, err: SessionError) -> None:
        if err.kind:
            context.set_trailing_metadata((("rr-error-kind", err.kind),))
        context.abort(getattr(grpc.StatusCode, err.code), str(err))

    def session(self, name: str) -> Session:
        check_session_name(name)
        with self._lock:
            session = self._sessions.get(name)
        if session is None:
            raise SessionError(
                "NOT_FOUND", f"session: expected a session that was joined, got {name!r}"
            )
        return session

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    # -- rpcs ------------------------------------------------------------
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            name = check_session_name(request.session)
            config = SessionConfig.from_proto(request.config)
            with self._lock:
                session = self._sessions.get(name)
                if session is None:
                    if len(self._sessions) >= self.limits.max_sessions:
                        raise SessionError(
                            "RESOURCE_EXHAUSTED",
                            f"session: this server allows at most {self.limits.max_sessions} "
                            f"sessions, got a new one ({name!r})",
                        )
                    session = Session(
                        name, config, self.metrics, max_workers=self.limits.max_workers_per_session
                    )
                    self._sessions[name] = session
                    logger.info("session %r created: %s", name, config)
            timeline = session.join(request.worker_id, config)
            return pb.JoinReply(
                worker_index=timeline.index,
                last_sequence=session.last_sequence[request.worker_id],
                status=session.status(),
            )
        except SessionError as err:
            self._abort(context, err)
            raise  # unreachable: abort raises

    def Record(
        self, request_iterator: Iterator[pb.RecordRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.RecordAck]:
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        try:
            if first.WhichOneof("kind") != "open":
                raise SessionError(
                    "INVALID_ARGUMENT", "Record: expected `open` as the first message, got a chunk"
                )
            session = self.session(first.open.session)
            worker_id = first.open.worker_id
            session.worker(worker_id)
        except SessionError as err:
            self._abort(context, err)
            return
        for request in request_iterator:
            if request.WhichOneof("kind") != "chunk":
                self._abort(
                    context,
                    SessionError("INVALID_ARGUMENT", "Record: expected a chunk, got `open` again"),
                )
                return
            chunk = request.chunk
            ack = pb.RecordAck(sequence=chunk.sequence)
            began = time.perf_counter()
            try:
                ack.result = session.apply(worker_id, chunk, self.limits.max_array_bytes)
            except SessionError as err:
                if err.code == "FAILED_PRECONDITION" and "sequence" in str(err):
                    # A gap: the client resends from the last sequence taken.
                    context.abort(grpc.StatusCode.ABORTED, str(err))
                    return
                ack.result = pb.RecordAck.REJECTED
                ack.error_code = err.code
                ack.error_message = str(err)
                self.metrics.inc("Recorder/chunks_rejected", 1, session=session.name)
                logger.info("chunk %d of %r refused: %s", chunk.sequence, worker_id, err)
            self.metrics.set(
                "Recorder/ack_latency_seconds",
                time.perf_counter() - began,
                session=session.name,
                worker=worker_id,
            )
            ack.is_full = session.is_full
            ack.num_recorded_steps = session.num_recorded_steps
            yield ack

    def Finish(
        self, request: pb.FinishRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FinishPart]:
        try:
            session = self.session(request.session)
            plan = session.assemble(request.pad_incomplete)
        except SessionError as err:
            self._abort(context, err)
            return
        except NoEpisodesError as err:
            self._abort(context, SessionError("FAILED_PRECONDITION", str(err), kind="no_data"))
            return
        header = pb.FinishHeader(
            num_episodes=plan.num_episodes,
            max_length=plan.max_length,
            lengths=plan.lengths.tolist(),
            workers=plan.workers.tolist(),
            envs=plan.envs.tolist(),
            starts=plan.starts.tolist(),
            done=plan.done.tolist(),
            worker_ids=[tl for tl in session.workers],
        )
        for spec in plan.fields:
            shape = (plan.num_episodes, plan.max_length, *spec.trailing)
            header.fields.append(pb.FieldSpec(name=spec.name, dtype=spec.dtype.str, shape=shape))
        yield pb.FinishPart(header=header)
        part_bytes = request.max_part_bytes or DEFAULT_PART_BYTES
        for index, spec in enumerate(plan.fields):
            full = plan.build_field(spec)
            row_bytes = max(1, full[:1].nbytes)
            rows = max(1, part_bytes // row_bytes)
            for start in range(0, plan.num_episodes, rows):
                yield pb.FinishPart(
                    array=pb.ArrayPart(
                        field=index,
                        row_start=start,
                        array=codec.encode_array(full[start : start + rows]),
                    )
                )
            del full

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetReply:
        try:
            session = self.session(request.session)
        except SessionError as err:
            self._abort(context, err)
            raise
        session.reset()
        logger.info("session %r reset", session.name)
        return pb.ResetReply(status=session.status())

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        try:
            return self.session(request.session).status()
        except SessionError as err:
            self._abort(context, err)
            raise

    def GetMetrics(
        self, request: pb.MetricsRequest, context: grpc.ServicerContext
    ) -> pb.MetricsReply:
        now = time.monotonic()
        for session in self.sessions():
            with session.lock:
                held = sum(tl.wire_bytes for tl in session.workers.values())
                for worker_id, seen in session.last_seen.items():
                    self.metrics.set(
                        "Recorder/worker_lag_seconds",
                        now - seen,
                        session=session.name,
                        worker=worker_id,
                    )
            self.metrics.set("Recorder/held_wire_bytes", held, session=session.name)
        return pb.MetricsReply(
            values=self.metrics.snapshot(),
            sessions=[s.status() for s in self.sessions()],
            uptime_s=now - self._started,
        )

    # -- trajectory store ------------------------------------------------
    def _store_session(self, name: str, context: grpc.ServicerContext) -> Session:
        session = self.session(name)
        session.feeder.drain()  # answers reflect every chunk acknowledged so far
        return session

    def SubmitEpisode(
        self, request: pb.SubmitEpisodeRequest, context: grpc.ServicerContext
    ) -> pb.SubmitEpisodeReply:
        try:
            session = self._store_session(request.session, context)
            episode = episode_from_proto(request.episode, self.limits.max_array_bytes)
            try:
                outcome = EpisodeOutcome(request.outcome)
            except ValueError:
                raise SessionError(
                    "INVALID_ARGUMENT",
                    f"outcome: expected 0..{max(EpisodeOutcome)}, got {request.outcome}",
                ) from None
            reference = None
            if request.HasField("start_reference"):
                reference = TrajectorySliceReference(
                    request.start_reference.trajectory_id, request.start_reference.step
                )
            try:
                session.processor.record_episode(
                    episode,
                    dict(request.episode_data),
                    int(request.step),
                    outcome=outcome,
                    start_reference=reference,
                )
            except ValueError as exc:
                raise SessionError("INVALID_ARGUMENT", f"episode: {exc}") from None
            session.processor.log_metrics(int(request.step))
            counters = session.processor.runtime_state_dict()["counters"]
            return pb.SubmitEpisodeReply(episodes_captured=counters["episodes_captured"])
        except SessionError as err:
            self._abort(context, err)
            raise

    def SampleStart(
        self, request: pb.SampleStartRequest, context: grpc.ServicerContext
    ) -> pb.SampleStartReply:
        try:
            session = self._store_session(request.session, context)
        except SessionError as err:
            self._abort(context, err)
            raise
        sampled = session.processor.sample_start()
        if sampled is None:
            return pb.SampleStartReply(found=False)
        reference, prefix = sampled
        return pb.SampleStartReply(
            found=True,
            reference=pb.SliceReference(trajectory_id=reference.trajectory_id, step=reference.step),
            prefix=episode_to_proto(prefix),
        )

    def SnapshotPotential(
        self, request: pb.SnapshotPotentialRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotPotentialReply:
        try:
            session = self._store_session(request.session, context)
            try:
                values = session.processor.snapshot_potential(
                    request.utility_key, list(request.field_names)
                )
            except ValueError as exc:
                raise SessionError("INVALID_ARGUMENT", str(exc)) from None
        except SessionError as err:
            self._abort(context, err)
            raise
        reply = pb.SnapshotPotentialReply(key_width=len(request.field_names))
        for key, value in values.items():
            reply.keys.extend(int(k) for k in key)
            reply.values.append(float(value))
        return reply

    def GetStoreCheckpoint(
        self, request: pb.StoreCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FilePart]:
        try:
            session = self._store_session(request.session, context)
        except SessionError as err:
            self._abort(context, err)
            return
        from .checkpoint import encode_checkpoint

        file = session.processor.trajectory_store_checkpoint_file(
            request.compress, checkpoint_step=int(request.checkpoint_step)
        )
        if file is None:
            yield pb.FilePart(session=session.name, empty=True)
            return
        # The store payload travels in the versioned, checksummed checkpoint format.
        data = encode_checkpoint(file.data, compress=False)
        yield from file_parts(session.name, file.name, data)

    def LoadStoreCheckpoint(
        self, request_iterator: Iterator[pb.FilePart], context: grpc.ServicerContext
    ) -> pb.LoadReply:
        from .checkpoint import CheckpointError, decode_checkpoint

        try:
            name, data = receive_file(request_iterator)
            session = self._store_session(name, context)
            if session.processor.store is None:
                raise SessionError(
                    "FAILED_PRECONDITION",
                    f"session {name!r}: expected a trajectory configuration to load a store "
                    "into, got none (capture_config is off)",
                )
            try:
                payload = decode_checkpoint(data, source="store checkpoint")
                session.processor.load_trajectory_store_checkpoint_data(payload)
            except (CheckpointError, ValueError) as exc:
                raise SessionError("INVALID_ARGUMENT", f"store checkpoint: {exc}") from None
            return pb.LoadReply(status=session.status())
        except SessionError as err:
            self._abort(context, err)
            raise


def episode_from_proto(msg: pb.EpisodeArrays, max_raw: int) -> EpisodeArrays:
    try:
        actions = codec.decode_array(msg.actions, "episode.actions", max_raw)
        rewards = codec.decode_array(msg.rewards, "episode.rewards", max_raw)
        states = {
            s.name: codec.decode_array(s.array, f"episode.states[{s.name!r}]", max_raw)
            for s in msg.states
        }
        return EpisodeArrays(actions, rewards, states)
    except ValueError as exc:
        raise SessionError("INVALID_ARGUMENT", str(exc)) from None


def episode_to_proto(episode: EpisodeArrays) -> pb.EpisodeArrays:
    return pb.EpisodeArrays(
        actions=codec.encode_array(np.asarray(episode.actions)),
        rewards=codec.encode_array(np.asarray(episode.rewards)),
        states=[
            pb.NamedArray(name=k, array=codec.encode_array(np.asarray(v)))
            for k, v in episode.states.items()
        ],
    )


def file_parts(session: str, name: str, data: bytes) -> Iterator[pb.FilePart]:
    digest = hashlib.sha256(data).hexdigest()
    view = memoryview(data)
    yield pb.FilePart(
        session=session,
        name=name,
        size=len(data),
        sha256=digest,
        data=bytes(view[:FILE_PART_BYTES]),
    )
    for offset in range(FILE_PART_BYTES, len(data), FILE_PART_BYTES):
        yield pb.FilePart(data=bytes(view[offset : offset + FILE_PART_BYTES]))


def receive_file(parts: Iterator[pb.FilePart]) -> tuple[str, bytes]:
    """Join streamed parts; checks the declared size and sha256."""
    first = next(parts, None)
    if first is None:
        raise SessionError("INVALID_ARGUMENT", "file: expected at least one part, got none")
    buf = bytearray(first.data)
    for part in parts:
        buf += part.data
        if len(buf) > first.size:
            break
    digest = hashlib.sha256(buf).hexdigest()
    if len(buf) != first.size or digest != first.sha256:
        raise SessionError(
            "INVALID_ARGUMENT",
            f"file {first.name!r}: expected {first.size} bytes with sha256 {first.sha256}, "
            f"got {len(buf)} bytes with sha256 {digest}",
        )
    return first.session, bytes(buf)
