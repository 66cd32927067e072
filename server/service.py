"""The gRPC servicer: translates messages and status codes, nothing more."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from recorder_client import codec
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc

from .episodes import NoEpisodesError
from .session import Session, SessionConfig, SessionError, check_session_name

logger = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 4 << 20


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds on what one server accepts."""

    max_sessions: int = 64
    max_workers_per_session: int = 1024
    # Largest raw size of one array in a chunk.
    max_array_bytes: int = 1 << 31


class RecorderService(pb_grpc.RecorderServicer):
    def __init__(self, limits: ServiceLimits | None = None) -> None:
        self.limits = limits or ServiceLimits()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

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
                    session = Session(name, config, max_workers=self.limits.max_workers_per_session)
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
                logger.info("chunk %d of %r refused: %s", chunk.sequence, worker_id, err)
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
