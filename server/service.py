"""The gRPC servicer: translates messages and status codes, nothing more."""

from __future__ import annotations

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
from recorder_client.capture import file_parts, read_parts
from recorder_client.capture_types import EpisodeOutcome, TrajectorySliceReference

from . import snapshot
from .durability import (
    KIND_CHUNK,
    KIND_EPISODE,
    KIND_JOIN,
    KIND_RESET,
    Durability,
    decode_record,
    encode_record,
)
from .episodes import NoEpisodesError
from .metrics import MetricsTracker
from .session import Session, SessionConfig, SessionError, check_session_name
from .store import EpisodeArrays, kernels

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
    def __init__(
        self,
        limits: ServiceLimits | None = None,
        metrics: MetricsTracker | None = None,
        durability: Durability | None = None,
    ) -> None:
        self.limits = limits or ServiceLimits()
        self.metrics = metrics or MetricsTracker()
        self.durability = durability
        self._sessions: dict[str, Session] = {}
        self._lock = threading.RLock()
        self._started = time.monotonic()

    def _journal(self, kind: bytes, session: str, worker: str, payload: bytes) -> None:
        if self.durability is None:
            return
        try:
            self.durability.journal(encode_record(kind, session, worker, payload))
        except OSError as exc:
            raise SessionError(
                "RESOURCE_EXHAUSTED",
                f"data directory: cannot append to the write-ahead log ({exc.strerror or exc})",
                kind="disk_full",
            ) from None

    def _new_session(self, name: str, config: SessionConfig) -> Session:
        session = Session(
            name, config, self.metrics, max_workers=self.limits.max_workers_per_session
        )
        if self.durability is not None:
            session.journal = self.durability.journal
        return session

    # -- durability --------------------------------------------------------
    def join(self, name: str, config_msg: pb.SessionConfig, worker_id: str, *, log: bool = True):
        """Create the session on first use and add the worker; logged before it counts."""
        name = check_session_name(name)
        config = SessionConfig.from_proto(config_msg)
        with self._lock:
            session = self._sessions.get(name)
            if session is None:
                if len(self._sessions) >= self.limits.max_sessions:
                    raise SessionError(
                        "RESOURCE_EXHAUSTED",
                        f"session: this server allows at most {self.limits.max_sessions} "
                        f"sessions, got a new one ({name!r})",
                    )
                new = self._new_session(name, config)
                new.check_join(worker_id, config)
                if log:
                    self._journal(KIND_JOIN, name, worker_id, config_msg.SerializeToString())
                self._sessions[name] = session = new
                logger.info("session %r created: %s", name, config)
                session.join(worker_id, config)
                return session
            if worker_id not in session.workers:
                session.check_join(worker_id, config)
                if log:
                    self._journal(KIND_JOIN, name, worker_id, config_msg.SerializeToString())
            session.join(worker_id, config)
            return session

    def restore_session(self, meta: dict, blobs: list) -> Session:
        config = SessionConfig.from_proto(snapshot.session_config(meta, blobs))
        session = self._new_session(meta["name"], config)
        snapshot.restore_session(session, meta, blobs)
        with self._lock:
            old = self._sessions.get(session.name)
            self._sessions[session.name] = session
        if old is not None:
            old.close()
        return session

    def apply_record(self, record: bytes) -> None:
        """Replay one write-ahead log record."""
        kind, name, worker, payload = decode_record(record)
        try:
            if kind == KIND_JOIN:
                self.join(name, pb.SessionConfig.FromString(payload), worker, log=False)
            elif kind == KIND_CHUNK:
                chunk = pb.Chunk.FromString(payload)
                self.session(name).apply(worker, chunk, self.limits.max_array_bytes, log=False)
            elif kind == KIND_RESET:
                self.session(name).reset()
            elif kind == KIND_EPISODE:
                self._submit(pb.SubmitEpisodeRequest.FromString(payload), log=False)
        except SessionError as err:
            logger.warning("log record for session %r not replayed: %s", name, err)

    def lock_all(self, stack) -> list[Session]:
        """Hold every lock that guards a change (for a consistent checkpoint)."""
        stack.enter_context(self._lock)
        sessions = sorted(self._sessions.values(), key=lambda s: s.name)
        for session in sessions:
            stack.enter_context(session.lock)
        for session in sessions:
            session.feeder.drain()
        return sessions

    def drain_feeders(self) -> None:
        for session in self.sessions():
            session.feeder.drain()

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
            session = self.join(request.session, request.config, request.worker_id)
            timeline = session.workers[request.worker_id]
            if session.processor.store is not None:
                # The store's compiled loops load in about a second (a first compile on a
                # fresh install takes longer): let the worker start once they are ready.
                remaining = context.time_remaining()
                budget = 30.0 if remaining is None else max(0.0, min(30.0, remaining - 1.0))
                kernels.warm_up(wait=True, timeout=budget)
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
                if err.code == "RESOURCE_EXHAUSTED":
                    # Nothing after this chunk can be taken either; the client keeps
                    # them all and resends once the server answers again.
                    self.metrics.inc("Recorder/chunks_refused_no_space", 1, session=session.name)
                    self._abort(context, err)
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
            for row_start, row_count, flat in plan.field_parts(spec, part_bytes):
                yield pb.FinishPart(
                    array=pb.ArrayPart(
                        field=index,
                        row_start=row_start,
                        row_count=row_count,
                        array=codec.encode_array(flat),
                    )
                )

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetReply:
        try:
            session = self.session(request.session)
            with session.lock:
                self._journal(KIND_RESET, session.name, "", b"")
                session.reset()
        except SessionError as err:
            self._abort(context, err)
            raise
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
            return self._submit(request)
        except SessionError as err:
            self._abort(context, err)
            raise

    def _submit(
        self, request: pb.SubmitEpisodeRequest, *, log: bool = True
    ) -> pb.SubmitEpisodeReply:
        session = self.session(request.session)
        session.feeder.drain()
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
        with session.lock:
            if log:
                self._journal(KIND_EPISODE, session.name, "", request.SerializeToString())
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
            self._checkpoint_after_load()
            return pb.LoadReply(status=session.status())
        except SessionError as err:
            self._abort(context, err)
            raise

    def _checkpoint_after_load(self) -> None:
        # Loaded state is not in the log: a checkpoint makes it durable before the reply.
        if self.durability is not None:
            try:
                self.durability.checkpoint(self)
            except OSError as exc:
                raise SessionError(
                    "RESOURCE_EXHAUSTED", f"data directory: checkpoint failed ({exc})"
                ) from None

    # -- runtime state and checkpoints -----------------------------------
    def GetRuntimeState(
        self, request: pb.RuntimeStateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FilePart]:
        try:
            session = self.session(request.session)
        except SessionError as err:
            self._abort(context, err)
            return
        with session.lock:
            session.feeder.drain()
            meta, blobs = snapshot.session_state(session)
            data = snapshot.pack(meta, blobs)
        from .checkpoint import encode_checkpoint

        yield from file_parts(
            session.name, f"{session.name}.state", encode_checkpoint(data, compress=False)
        )

    def LoadRuntimeState(
        self, request_iterator: Iterator[pb.FilePart], context: grpc.ServicerContext
    ) -> pb.LoadReply:
        from .checkpoint import CheckpointError, decode_checkpoint

        try:
            name, data = receive_file(request_iterator)
            try:
                meta, blobs = snapshot.unpack(decode_checkpoint(data, source="runtime state"))
                if meta.get("name") != name:
                    raise ValueError(
                        f"session: expected state of session {name!r}, got {meta.get('name')!r}"
                    )
                session = self.restore_session(meta, blobs)
            except (CheckpointError, ValueError) as exc:
                raise SessionError("INVALID_ARGUMENT", f"runtime state: {exc}") from None
            self._checkpoint_after_load()
            return pb.LoadReply(status=session.status())
        except SessionError as err:
            self._abort(context, err)
            raise

    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointReply:
        if self.durability is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "checkpoint: expected a server with a write-ahead log, got one started with --no-wal",
            )
        try:
            path, cut = self.durability.checkpoint(self)
        except OSError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"checkpoint failed: {exc}")
        return pb.CheckpointReply(path=str(path), wal_index=cut)


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


def receive_file(parts: Iterator[pb.FilePart]) -> tuple[str, bytes]:
    """Join streamed parts; checks the declared size and sha256."""
    try:
        first, data = read_parts(parts)
    except ValueError as exc:
        raise SessionError("INVALID_ARGUMENT", str(exc)) from None
    if first is None:
        raise SessionError("INVALID_ARGUMENT", "file: expected at least one part, got none")
    return first.session, data
