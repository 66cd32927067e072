"""The gRPC servicer: each RPC converts its messages and runs the core off the event loop.

An open stream costs a coroutine, not a thread. Ingest (a chunk: decode, split, log, queue
for the store) runs on the ingest pool; everything else that touches a session (finish,
status, reset, store verbs, checkpoints) on the control pool, so that it answers at once
however busy ingest is. Every refusal ends its RPC through `convert.status_of`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from recorder_client import _wire
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc

from ..chunks import Chunk
from ..durability import Durability, snapshot
from ..durability.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from ..errors import ErrorKind, RequestError, invalid
from ..lifecycle import Lifecycle
from ..session import Applied, Session
from ..store import kernels
from . import convert
from .offload import Offload

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_PART_BYTES = 4 << 20
# Chunks up to this many bytes on the wire take the ingest pool's small-call slots: many
# small actors then fill its batches (Offload.run_batched), in at most 64 x 64 KB of requests.
_SMALL_CHUNK_BYTES = 64 << 10
# Join waits at most this long for the store's compiled loops (loaded in about a second).
_WARM_UP_S = 30.0


# Finish parts made per trip to the control pool: small parts (a few episodes of many
# workers) go together, up to this many or this many raw bytes, so that the client can
# decode one batch while the next is made.
_PARTS_PER_HOP = 64
_RAW_PER_HOP = 1 << 20

# A gathered part: (field index, first row, row count, real steps, whether the index is a
# final-state field's), not yet encoded.
_Gathered = tuple[int, int, int, Any, bool]


def _take_parts(
    parts: Iterator[pb.FinishPart | _Gathered],
) -> tuple[list[pb.FinishPart | _Gathered], bool]:
    """The next parts (the header alone), and whether more may follow."""
    batch, raw = [], 0
    for part in parts:
        batch.append(part)
        if not isinstance(part, pb.FinishPart):
            raw += part[3].nbytes
        elif part.HasField("header"):
            return batch, True
        else:  # a chunk's frames, compressed as stored
            raw += sum(len(a.data) for a in part.chunk.fields)
        if len(batch) == _PARTS_PER_HOP or raw >= _RAW_PER_HOP:
            return batch, True
    return batch, False


def _encode_parts(batch: list[pb.FinishPart | _Gathered]) -> list[pb.FinishPart]:
    return [p if isinstance(p, pb.FinishPart) else convert.finish_part(*p) for p in batch]


class _Stream:
    """One Record stream's handler task, which a drop ends from another thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.error: RequestError | None = None

    def end(self, error: RequestError) -> None:
        self.error = error
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)


class RecorderServicer(pb_grpc.RecorderServicer):
    def __init__(
        self,
        lifecycle: Lifecycle,
        metrics,
        *,
        ingest: Offload,
        control: Offload,
        max_message_bytes: int = 0,
    ) -> None:
        self.lifecycle = lifecycle
        self.max_message_bytes = max_message_bytes  # the gRPC cap, told to joining clients
        self.sessions = sessions = lifecycle.sessions
        self.metrics = metrics
        self.durability: Durability | None = lifecycle.durability
        self.ingest = ingest
        self.control = control
        self.limits = sessions.limits
        self._started = time.monotonic()

    # -- helpers ---------------------------------------------------------
    async def _abort(self, context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
        code, message, kind = convert.status_of(error)
        if not isinstance(error, RequestError):
            logger.error("RPC failed", exc_info=error)
        context.set_trailing_metadata(convert.trailing(kind, getattr(error, "retry_after", None)))
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the control pool; any error ends the RPC with its status."""
        try:
            return await self.control.run(fn, *args)
        except Exception as exc:
            await self._abort(context, exc)

    # -- recording -------------------------------------------------------
    def _join(self, request: pb.JoinRequest) -> tuple[Session, pb.JoinReply]:
        config = convert.config_from_proto(request.config)
        acked = request.acked_sequence
        session, held = self.sessions.join(
            request.session, config, request.worker_id, acked, instance=request.instance_id
        )
        reply = pb.JoinReply(
            worker_index=session.workers[request.worker_id].index,
            last_sequence=held,
            status=convert.session_counters(session),
            packed_codecs=True,
            max_message_bytes=self.max_message_bytes,
            max_chunk_env_steps=self.limits.max_chunk_env_steps,
            max_chunk_bytes=self.limits.max_chunk_bytes,
        )
        if acked > held:
            cause = session.identity.last_loss.pop(request.worker_id, None)
            reply.loss.CopyFrom(convert.loss_report(cause, held + 1, acked))
        return session, reply

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        session, reply = await self._run(context, self._join, request)
        if session.processor.store is not None:
            # The store's compiled loops load in about a second (a first compile on a fresh
            # install takes longer): the worker starts once they are ready.
            remaining = context.time_remaining()
            budget = _WARM_UP_S if remaining is None else max(0.0, min(_WARM_UP_S, remaining - 1))
            deadline = time.monotonic() + budget
            while not kernels.warm_up() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return reply

    def _open(self, request: pb.RecordRequest, stream: _Stream) -> tuple[Session, str, int]:
        if request.WhichOneof("kind") != "open":
            raise invalid("Record: expected `open` as the first message, got a chunk")
        opened = request.open
        self.sessions.tombstones.check(opened.session, opened.instance_id)
        session = self.sessions.get(opened.session)
        session.worker(opened.worker_id)
        epoch = session.identity.open(opened.worker_id, opened.instance_id, stream.end)
        return session, opened.worker_id, epoch

    def _apply(self, session: Session, worker_id: str, epoch: int, msg: pb.Chunk) -> pb.RecordAck:
        began = time.perf_counter()
        if not session.identity.current(worker_id, epoch):
            raise session.identity.superseded(worker_id)
        try:
            chunk = convert.chunk_from_proto(msg, self.limits)
        except RequestError as err:
            chunk = Chunk(msg.sequence, {}, refused=err)
        try:
            applied: Applied | RequestError = session.apply(worker_id, chunk)
        except RequestError as err:
            if err.kind not in convert.CHUNK_REJECTIONS:
                if err.kind == ErrorKind.STORAGE:
                    self.metrics.inc("Recorder/chunks_refused_no_space", 1, session=session.name)
                raise
            applied = err
            self.metrics.inc("Recorder/chunks_rejected", 1, session=session.name)
            logger.info("chunk %d of %r refused: %s", msg.sequence, worker_id, err)
        self.metrics.set(
            "Recorder/ack_latency_seconds",
            time.perf_counter() - began,
            session=session.name,
            worker=worker_id,
        )
        reply = convert.ack(msg.sequence, applied, *session.counters_for(worker_id))
        reply.late_refusals.extend(session.take_late_refusals(worker_id))
        return reply

    def _inline(self, session: Session) -> bool:
        """Whether a small chunk that arrived alone is taken here, on the event loop: no
        store, a log that does not fsync each chunk, and the session's lock free (a hint: a
        holder that takes it meanwhile delays the loop by its critical section)."""
        if session.processor.store is not None:
            return False
        if self.durability is not None and self.durability.wal.fsync_policy == "always":
            return False
        if not session.lock.acquire(blocking=False):
            return False
        session.lock.release()
        return True

    async def Record(
        self, request_iterator: AsyncIterator[pb.RecordRequest], context
    ) -> AsyncIterator[pb.RecordAck]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        stream = _Stream()
        opened: tuple[Session, str, int] | None = None
        try:
            opened = await self._run(context, self._open, first, stream)
            session, worker_id, epoch = opened
            async for request in request_iterator:
                if request.WhichOneof("kind") != "chunk":
                    await self._abort(
                        context, invalid("Record: expected a chunk, got `open` again")
                    )
                try:
                    chunk = request.chunk
                    small = chunk.ByteSize() <= _SMALL_CHUNK_BYTES
                    reply = await self.ingest.run_batched(
                        self._apply,
                        session,
                        worker_id,
                        epoch,
                        chunk,
                        small=small,
                        inline=functools.partial(self._inline, session) if small else None,
                    )
                except Exception as exc:
                    await self._abort(context, exc)
                yield reply
        except asyncio.CancelledError:
            if stream.error is None:  # the client or the server went away
                raise
            # Ended from outside (the session was dropped): the worker hears why.
            asyncio.current_task().uncancel()
            await self._abort(context, stream.error)
        finally:
            if opened is not None:
                opened[0].identity.close(opened[1], opened[2])

    def _finish_parts(self, request: pb.FinishRequest) -> Iterator[pb.FinishPart | _Gathered]:
        session = self.sessions.get(request.session)
        with session.lock:  # the ids as the plan numbers them
            plan = session.assemble(request.pad_incomplete, request.include_partial)
            worker_ids = list(session.workers)
        needed = [c for part in plan.per_worker for c in part.needed_chunks()]
        session.verify(needed)
        # Proved (here, or by the background thread under the lock this waited for): the
        # caller is told which of the chunks its result reads hold zeros for frames.
        corrupt = ["; ".join(c.corrupt) for c in needed if c.corrupt]
        if corrupt:
            plan.mark_corrupt()
        yield convert.finish_header(plan, worker_ids, corrupt)
        # The client that asks gathers the result from the stored chunks itself: no decode,
        # gather and re-compress here (most of the server's CPU for a finish()).
        frames = plan.chunk_frames() if request.chunk_frames else None
        part_bytes = request.max_part_bytes or DEFAULT_PART_BYTES
        if frames is not None:
            keys = [spec.key for spec in plan.fields]
            for position, chunk in frames:
                yield convert.chunk_frames(position, chunk, keys)
        else:
            for index, spec in enumerate(plan.fields):
                for row_start, row_count, flat in plan.field_parts(spec, part_bytes):
                    yield index, row_start, row_count, flat, False
        # Final states are gathered here whichever form the steps took (one row an episode).
        for index, spec in enumerate(plan.finals):
            for row_start, row_count, rows in plan.final_parts(spec, part_bytes):
                yield index, row_start, row_count, rows, True

    async def Finish(self, request: pb.FinishRequest, context) -> AsyncIterator[pb.FinishPart]:
        # Two stages on the control pool: the next batch is gathered (decode, one fancy
        # index) while this one is compressed (zstd releases the GIL), then sent. One after
        # the other, the server was the slower end of finish() (bench: 0.23 s of server CPU
        # against 0.17 s of client for the 21k-episode result).
        parts = await self._run(context, self._finish_parts, request)
        pending = asyncio.ensure_future(self.control.run(_take_parts, parts))
        try:
            while True:
                try:
                    batch, more = await pending
                    if more:
                        pending = asyncio.ensure_future(self.control.run(_take_parts, parts))
                    encoded = await self.control.run(_encode_parts, batch)
                except Exception as exc:
                    await self._abort(context, exc)
                for part in encoded:
                    yield part
                if not more:
                    return
        finally:
            pending.cancel()

    def _reset(self, request: pb.ResetRequest) -> pb.ResetReply:
        session = self.sessions.get(request.session)
        session.reset()
        logger.info("session %r reset", session.name)
        return pb.ResetReply(status=convert.session_status(session))

    async def Reset(self, request: pb.ResetRequest, context) -> pb.ResetReply:
        return await self._run(context, self._reset, request)

    def _status(self, name: str, counters_only: bool) -> pb.StatusReply:
        session = self.sessions.get(name)
        if counters_only:
            return convert.session_counters(session)
        return convert.session_status(session)

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        return await self._run(context, self._status, request.session, request.counters_only)

    def _metrics(self) -> pb.MetricsReply:
        now = time.monotonic()
        replies = []
        self.sessions.publish_levels()
        for session in self.sessions.all():
            replies.append(convert.status_to_proto(session.status(), session.config))
        return pb.MetricsReply(
            values=self.metrics.snapshot(), sessions=replies, uptime_s=now - self._started
        )

    async def GetMetrics(self, request: pb.MetricsRequest, context) -> pb.MetricsReply:
        return await self._run(context, self._metrics)

    # -- trajectory store ------------------------------------------------
    def _submit(self, request: pb.SubmitEpisodeRequest) -> pb.SubmitEpisodeReply:
        session = self.sessions.get(request.session)
        episode = convert.episode_from_proto(request, self.limits)
        return pb.SubmitEpisodeReply(episodes_captured=session.submit_episode(episode))

    async def SubmitEpisode(self, request: pb.SubmitEpisodeRequest, context):
        return await self._run(context, self._submit, request)

    def _sample(self, name: str) -> pb.SampleStartReply:
        sampled = self.sessions.get(name).sample_start()
        if sampled is None:
            return pb.SampleStartReply(found=False)
        reference, prefix = sampled
        return pb.SampleStartReply(
            found=True,
            reference=pb.SliceReference(trajectory_id=reference.trajectory_id, step=reference.step),
            prefix=convert.episode_to_proto(prefix),
            cell=reference.cell or (),
        )

    async def SampleStart(self, request: pb.SampleStartRequest, context):
        return await self._run(context, self._sample, request.session)

    def _potential(self, request: pb.SnapshotPotentialRequest) -> pb.SnapshotPotentialReply:
        session = self.sessions.get(request.session)
        values = session.snapshot_potential(request.utility_key, list(request.field_names))
        reply = pb.SnapshotPotentialReply(key_width=len(request.field_names))
        for key, value in values.items():
            reply.keys.extend(int(k) for k in key)
            reply.values.append(float(value))
        return reply

    async def SnapshotPotential(self, request: pb.SnapshotPotentialRequest, context):
        return await self._run(context, self._potential, request)

    def _archive(self, name: str) -> pb.ArchiveReply:
        session = self.sessions.get(name)
        session.require_store("archive")
        return convert.archive_to_proto(session.archive() or {})

    async def GetArchive(self, request: pb.ArchiveRequest, context) -> pb.ArchiveReply:
        return await self._run(context, self._archive, request.session)

    def _store_file(self, request: pb.StoreCheckpointRequest) -> list[pb.FilePart]:
        session = self.sessions.get(request.session)
        file = session.store_checkpoint(request.compress, int(request.checkpoint_step))
        if file is None:
            return [convert.empty_file(session.name)]
        name, data = file
        return list(convert.file_parts(session.name, name, data))

    async def GetStoreCheckpoint(self, request: pb.StoreCheckpointRequest, context):
        for part in await self._run(context, self._store_file, request):
            yield part

    def _load_store(self, name: str, data: bytearray) -> pb.LoadReply:
        session = self.sessions.get(name)
        session.load_store_checkpoint(data, self.limits.max_upload_bytes)
        self._checkpoint_after_load()
        return pb.LoadReply(status=convert.session_status(session))

    async def LoadStoreCheckpoint(self, request_iterator, context) -> pb.LoadReply:
        name, data = await self._receive(request_iterator, context)
        return await self._run(context, self._load_store, name, data)

    # -- runtime state and checkpoints -----------------------------------
    def _state_file(self, name: str) -> list[pb.FilePart]:
        session = self.sessions.get(name)
        with session.quiet():
            session.drain()
            meta, blobs = snapshot.session_state(session)
            data = snapshot.pack(meta, blobs)
        framed = encode_checkpoint(data, compress=False)
        return list(convert.file_parts(session.name, f"{session.name}.state", framed))

    async def GetRuntimeState(self, request: pb.RuntimeStateRequest, context):
        for part in await self._run(context, self._state_file, request.session):
            yield part

    def _load_state(self, name: str, data: bytearray) -> pb.LoadReply:
        # No bigger than what was sent: GetRuntimeState never compresses, so a state
        # inflates to nothing more than its upload.
        cap = min(self.limits.max_upload_bytes, len(data))
        try:
            payload = decode_checkpoint(data, max_payload_bytes=cap, source="runtime state")
            meta, blobs = snapshot.unpack(payload)
            got = meta.get("name") if isinstance(meta, dict) else None
            if got != name:
                raise ValueError(
                    f"session: expected state of session {_wire.shown(name)}, got {_wire.shown(got)}"
                )
            # Every chunk within this server's limits before anything of the state is built.
            snapshot.check_limits(meta, blobs, self.limits)
            session = self.sessions.restore(meta, blobs, limit=True)
            # Its holders were another run's recorders: the loading one joins next.
            session.identity.clear()
        except (CheckpointError, ValueError) as exc:
            raise invalid(f"runtime state: {exc}") from None
        self._checkpoint_after_load()
        return pb.LoadReply(status=convert.session_status(session))

    async def LoadRuntimeState(self, request_iterator, context) -> pb.LoadReply:
        name, data = await self._receive(request_iterator, context)
        return await self._run(context, self._load_state, name, data)

    def _checkpoint_after_load(self) -> None:
        # Loaded state is not in the log: a checkpoint makes it durable before the reply.
        if self.durability is not None:
            try:
                self.durability.checkpoint(self.sessions)
            except OSError as exc:
                raise RequestError(
                    ErrorKind.STORAGE, f"data directory: checkpoint failed ({exc})"
                ) from None

    def _checkpoint(self) -> pb.CheckpointReply:
        if self.durability is None:
            raise RequestError(
                ErrorKind.NO_LOG,
                "checkpoint: expected a server with a write-ahead log, got one started with "
                "--no-wal",
            )
        try:
            path, cut = self.durability.checkpoint(self.sessions)
        except OSError as exc:
            raise RequestError(ErrorKind.STORAGE, f"checkpoint failed: {exc}") from None
        return pb.CheckpointReply(path=str(path), wal_index=cut)

    async def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointReply:
        return await self._run(context, self._checkpoint)

    # -- sessions as resources -------------------------------------------
    def _leave(self, request: pb.LeaveRequest) -> pb.LeaveReply:
        self.sessions.leave(request.session, request.worker_id, instance=request.instance_id)
        return pb.LeaveReply()

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        return await self._run(context, self._leave, request)

    def _list(self) -> pb.ListSessionsReply:
        reply = pb.ListSessionsReply()
        for session in sorted(self.sessions.all(), key=lambda s: s.name):
            status = session.status()
            reply.sessions.append(
                pb.SessionSummary(
                    name=status.session,
                    workers=sum(w.active for w in status.workers),
                    episodes=status.episodes_finished,
                    raw_bytes=status.raw_bytes,
                    wire_bytes=status.wire_bytes,
                    idle_seconds=status.idle_seconds,
                    num_recorded_steps=status.num_recorded_steps,
                    is_full=status.is_full,
                )
            )
        return reply

    async def ListSessions(self, request: pb.ListSessionsRequest, context):
        return await self._run(context, self._list)

    def _drop(self, request: pb.DropSessionRequest) -> pb.DropSessionReply:
        self.lifecycle.drop(request.session)
        return pb.DropSessionReply()

    async def DropSession(self, request: pb.DropSessionRequest, context):
        return await self._run(context, self._drop, request)

    async def _receive(self, request_iterator, context) -> tuple[str, bytearray]:
        """A streamed file: its session and bytes (declared size and sha256 checked). A file
        that declares more than max_upload_bytes is refused before anything is buffered, and
        buffering stops one part past the declared size."""
        cap = self.limits.max_upload_bytes
        first = None
        buf = bytearray()
        try:
            async for part in request_iterator:
                if first is None:
                    first = part
                    if first.size > cap:
                        raise invalid(
                            f"file.size: expected at most {cap} bytes (the server's "
                            f"--max-upload-mib), got {first.size}"
                        )
                buf += part.data
                if len(buf) > first.size:
                    break
            if first is None:
                raise invalid("file: expected at least one part, got none")
            got = _wire.digest(buf)
            if len(buf) != first.size or got != first.sha256:
                raise invalid(
                    f"file {_wire.shown(first.name)}: expected {first.size} bytes with sha256 "
                    f"{_wire.shown(first.sha256)}, got {len(buf)} bytes with sha256 {got}"
                )
        except RequestError as exc:
            await self._abort(context, exc)
        return first.session, buf
