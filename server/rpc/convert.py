"""Protobuf messages <-> the core's types, and refusals -> gRPC status, in one place.

Received arrays become `EncodedArray`s whose headers are checked here (sizes first, before
anything is allocated or decompressed); everything after that is the core's. Messages the
client reads too are built by `recorder_client._messages`, the one home of both sides.
"""

from __future__ import annotations

import json
import logging

import grpc
import numpy as np

from recorder_client import _messages, _wire
from recorder_client._proto import recorder_pb2 as pb
from recorder_client.status import SessionStatus

from ..chunks import (
    FINAL,
    STATE,
    Chunk,
    EncodedArray,
    SessionConfig,
    SubmittedEpisode,
    array_label,
    check_parts,
    check_size,
    encoded_array,
)
from ..episodes import Assembly, StoredChunk
from ..errors import ErrorKind, RequestError, invalid
from ..loss import LossCause, LossKind
from ..session import Applied, Counters, Session
from ..sessions import ServiceLimits
from ..store import EpisodeArrays

logger = logging.getLogger(__name__)

# The status each kind of refusal ends an RPC with.
_STATUS = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.INVALID_QUERY: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.INVALID_NAME: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.SESSION_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.UNKNOWN_SESSION: grpc.StatusCode.NOT_FOUND,
    ErrorKind.NOT_JOINED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.SEQUENCE_GAP: grpc.StatusCode.ABORTED,
    ErrorKind.LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.STORAGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.NO_DATA: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NO_STORE: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NO_LOG: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.WORKER_IN_USE: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.SESSION_DROPPED: grpc.StatusCode.FAILED_PRECONDITION,
}
assert set(_STATUS) == set(ErrorKind)

# Refusals of one chunk that the Record stream answers with a REJECTED ack and goes on; any
# other kind ends the stream (the client resends or gives up, by the status).
CHUNK_REJECTIONS = frozenset({ErrorKind.INVALID})

INTERNAL_MESSAGE = "internal error: the server logged it"


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, message, kind tag) for an error that ends an RPC or refuses a chunk."""
    if isinstance(error, RequestError):
        return _STATUS[error.kind], _capped(str(error)), error.kind.value
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, "internal"


# Status details travel as metadata (8 KiB for all of it by default): a message that echoes
# a long input is cut here, whatever its author did.
MAX_MESSAGE_CHARS = 1024


def _capped(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters)"


_CAUSES = {
    LossKind.TORN_TAIL: pb.LossReport.CAUSE_TORN_TAIL,
    LossKind.CHECKPOINT_FALLBACK: pb.LossReport.CAUSE_CHECKPOINT_FALLBACK,
    LossKind.DROP: pb.LossReport.CAUSE_DROP,
    LossKind.UNSYNCED_TAIL: pb.LossReport.CAUSE_UNSYNCED_TAIL,
}
assert set(_CAUSES) == set(LossKind)


def loss_report(cause: LossCause | None, first: int, last: int) -> pb.LossReport:
    """A join's report of a worker's lost sequences (cause None: a replayed claim)."""
    report = pb.LossReport(first_sequence=first, last_sequence=last)
    if cause is not None:
        report.cause = _CAUSES[cause.kind]
        report.detail = cause.detail
    return report


def trailing(kind: str, retry_after: float | None = None) -> tuple[tuple[str, str], ...]:
    if retry_after is None:
        return ((_wire.ERROR_KIND_KEY, kind),)
    return ((_wire.ERROR_KIND_KEY, kind), (_wire.RETRY_AFTER_KEY, f"{retry_after:.3f}"))


# -- requests ----------------------------------------------------------------------------------


def config_from_proto(msg: pb.SessionConfig) -> SessionConfig:
    capture = None
    if msg.capture_config_json:
        try:
            capture = json.loads(msg.capture_config_json)
        except ValueError as exc:
            raise invalid(
                f"config.capture_config_json: expected JSON, got an error ({exc})"
            ) from None
    max_episodes = msg.max_episodes if msg.HasField("max_episodes") else None
    return SessionConfig.create(max_episodes, msg.record_states, list(msg.state_fields), capture)


def array_from_proto(msg: pb.ArrayData, what: str, max_raw: int) -> EncodedArray:
    return encoded_array(msg.dtype, msg.shape, msg.raw_size, msg.codec, msg.data, what, max_raw)


def _max_raw(limits: ServiceLimits) -> int:
    return min(limits.max_array_bytes, limits.max_chunk_bytes)


def chunk_from_proto(msg: pb.Chunk, limits: ServiceLimits) -> Chunk:
    """A chunk with every header checked against the limits (sizes, env steps, frames)."""
    max_raw = _max_raw(limits)
    arrays: dict[str, EncodedArray] = {}
    for name in ("action", "reward", "done", "outcome", "terminated", "truncated", "valid"):
        if msg.HasField(name):
            arrays[name] = array_from_proto(getattr(msg, name), f"chunk.{name}", max_raw)
    for named in msg.states:
        key = STATE + named.name
        what = array_label("chunk", key)
        if key in arrays:
            raise invalid(f"{what}: field sent twice")
        arrays[key] = array_from_proto(named.array, what, max_raw)
    for named in msg.finals:
        key = FINAL + named.name
        what = f"chunk.finals[{_wire.shown(named.name)}]"
        if key in arrays:
            raise invalid(f"{what}: field sent twice")
        arrays[key] = array_from_proto(named.array, what, max_raw)
    check_size(arrays, "chunk", limits.max_chunk_bytes, limits.max_chunk_env_steps, time_axes=2)
    return Chunk(
        msg.sequence,
        arrays,
        parts=check_parts(msg.part_lengths, arrays),
        cut_before=msg.cut_before,
        fresh_start=msg.fresh_start,
    )


def episode_from_proto(msg: pb.SubmitEpisodeRequest, limits: ServiceLimits) -> SubmittedEpisode:
    """An episode with every header checked against the limits, as a chunk's are."""
    max_raw = _max_raw(limits)
    ep = msg.episode
    arrays = {
        "actions": array_from_proto(ep.actions, "episode.actions", max_raw),
        "rewards": array_from_proto(ep.rewards, "episode.rewards", max_raw),
    }
    for named in ep.states:
        key = STATE + named.name
        what = array_label("episode", key)
        if key in arrays:
            raise invalid(f"{what}: field sent twice")
        arrays[key] = array_from_proto(named.array, what, max_raw)
    check_size(arrays, "episode", limits.max_chunk_bytes, limits.max_chunk_env_steps, time_axes=1)
    reference = None
    if msg.HasField("start_reference"):
        reference = (msg.start_reference.trajectory_id, msg.start_reference.step)
    return SubmittedEpisode(arrays, dict(msg.episode_data), msg.step, msg.outcome, reference)


# -- replies -----------------------------------------------------------------------------------

_ACK = {
    Applied.STORED: pb.RecordAck.STORED,
    Applied.DROPPED_FULL: pb.RecordAck.DROPPED_FULL,
    Applied.DUPLICATE: pb.RecordAck.DUPLICATE,
}


def ack(
    sequence: int, applied: Applied | RequestError, counters: Counters, through: int
) -> pb.RecordAck:
    """A chunk's answer, with the session's counters and the last of the worker's chunks
    they count."""
    reply = pb.RecordAck(
        sequence=sequence,
        is_full=counters.is_full,
        num_recorded_steps=counters.num_recorded_steps,
        episodes_finished=counters.episodes_finished,
        counters_version=counters.version,
        counted_through=through,
    )
    if isinstance(applied, RequestError):
        code, message, _ = status_of(applied)
        reply.result = pb.RecordAck.REJECTED
        reply.error_code = code.name
        reply.error_message = message
    else:
        reply.result = _ACK[applied]
    return reply


def session_counters(session: Session) -> pb.StatusReply:
    """The session's counters alone (a join's, and GetStatus with counters_only): no
    per-worker list, so the reply costs the same however many workers the session holds."""
    counters = session.counters
    return pb.StatusReply(
        session=session.name,
        counters_version=counters.version,
        is_full=counters.is_full,
        num_recorded_steps=counters.num_recorded_steps,
        episodes_finished=counters.episodes_finished,
    )


def session_status(session: Session) -> pb.StatusReply:
    """The session's status, with the version of counters no newer than it holds."""
    version = session.counters.version
    reply = status_to_proto(session.status(), session.config)
    reply.counters_version = version
    return reply


def status_to_proto(status: SessionStatus, config: SessionConfig) -> pb.StatusReply:
    capture = "" if config.capture is None else json.dumps(config.capture.to_dict(), sort_keys=True)
    return _messages.status_to_proto(status, capture)


def episode_to_proto(episode: EpisodeArrays) -> pb.EpisodeArrays:
    return _messages.episode_to_proto(episode.actions, episode.rewards, episode.states)


def archive_to_proto(table: dict[str, np.ndarray]) -> pb.ArchiveReply:
    """`Session.archive` columns (in their order: key fields first, utilities last)."""
    return pb.ArchiveReply(
        key_names=[k[len("cell:") :] for k in table if k.startswith("cell:")],
        utility_names=[k[len("utility:") :] for k in table if k.startswith("utility:")],
        columns=[
            pb.NamedArray(name=name, array=_messages.array_to_proto(np.ascontiguousarray(col)))
            for name, col in table.items()
        ],
    )


# Chunks whose frames read as zeros that a Finish header names (it counts them all).
MAX_CORRUPT_LISTED = 64


def finish_header(plan: Assembly, worker_ids: list[str], corrupt: list[str]) -> pb.FinishPart:
    """The result's header; ``corrupt``: a message per chunk it reads that holds zeros for
    frames found not to decode after the ack."""
    header = pb.FinishHeader(
        corrupt_chunks=corrupt[:MAX_CORRUPT_LISTED],
        num_corrupt_chunks=len(corrupt),
        num_episodes=plan.num_episodes,
        max_length=plan.max_length,
        lengths=plan.lengths.tolist(),
        workers=plan.workers.tolist(),
        envs=plan.envs.tolist(),
        starts=plan.starts.tolist(),
        done=plan.done.tolist(),
        worker_ids=worker_ids,
    )
    if plan.partial.any():  # none sent when every episode is whole
        header.partial.extend(plan.partial.tolist())
    header.terminated.extend(plan.terminated.tolist())
    header.truncated.extend(plan.truncated.tolist())
    for spec in plan.fields:
        shape = (plan.num_episodes, plan.max_length, *spec.trailing)
        header.fields.append(pb.FieldSpec(name=spec.name, dtype=spec.dtype.str, shape=shape))
    for spec in plan.finals:
        shape = (plan.num_episodes, *spec.trailing)
        header.final_fields.append(pb.FieldSpec(name=spec.name, dtype=spec.dtype.str, shape=shape))
    return pb.FinishPart(header=header)


def finish_part(
    field: int, row_start: int, row_count: int, flat: np.ndarray, final: bool = False
) -> pb.FinishPart:
    """An ArrayPart of a field's real steps, or (``final``) of a final-state field's rows."""
    part = pb.ArrayPart(
        field=field, row_start=row_start, row_count=row_count, array=_messages.array_to_proto(flat)
    )
    return pb.FinishPart(final=part) if final else pb.FinishPart(array=part)


def chunk_frames(worker: int, chunk: StoredChunk, keys: list[str]) -> pb.FinishPart:
    """A stored chunk's arrays for `keys`, as they were recorded (no decoding)."""
    arrays = [chunk.arrays[key] for key in keys]
    msg = pb.ChunkFrames(
        worker=worker, t0=chunk.t0, length=chunk.length, num_envs=arrays[0].shape[1]
    )
    for a in arrays:
        msg.fields.add(
            dtype=a.dtype.str, shape=a.shape, raw_size=a.nbytes, codec=a.codec, data=a.data
        )
    return pb.FinishPart(chunk=msg)


file_parts = _messages.file_parts


def empty_file(session: str) -> pb.FilePart:
    return pb.FilePart(session=session, empty=True)
