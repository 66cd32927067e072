"""Protobuf messages <-> numpy arrays and dataclasses: the protobuf side of `_wire`'s rules,
shared by the client and the server's gRPC edge (users never see protobuf)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from . import _wire
from ._proto import recorder_pb2 as pb
from .capture_types import CheckpointFile
from .status import SessionStatus, WorkerStatus

_WORKER_FIELDS = dataclasses.fields(WorkerStatus)


def array_to_proto(
    arr: np.ndarray, level: int = _wire.DEFAULT_LEVEL, pack: bool = False
) -> pb.ArrayData:
    arr = np.ascontiguousarray(arr)
    codec, data = _wire.encode(arr, level, pack)
    return pb.ArrayData(
        dtype=arr.dtype.str, shape=arr.shape, raw_size=arr.nbytes, codec=codec, data=data
    )


def fill_array(
    msg: pb.ArrayData, arr: np.ndarray, level: int = _wire.DEFAULT_LEVEL, pack: bool = False
) -> None:
    """array_to_proto into an empty field of a message being built: no message made and
    copied in (a chunk's encoding in the client's sender thread costs a third less)."""
    arr = np.ascontiguousarray(arr)
    codec, data = _wire.encode(arr, level, pack)
    msg.dtype = arr.dtype.str
    msg.shape.extend(arr.shape)
    msg.raw_size = arr.nbytes
    msg.codec = codec
    msg.data = data


def array_from_proto(msg: pb.ArrayData, what: str, max_raw: int = 1 << 40) -> np.ndarray:
    dtype, shape = _wire.check_header(msg.dtype, msg.shape, msg.raw_size, what, max_raw)
    return _wire.decode(msg.codec, msg.data, dtype, shape, what)


def episode_to_proto(
    actions: Any, rewards: Any, states: Mapping[str, Any] | None
) -> pb.EpisodeArrays:
    return pb.EpisodeArrays(
        actions=array_to_proto(np.asarray(actions)),
        rewards=array_to_proto(np.asarray(rewards)),
        states=[
            pb.NamedArray(name=k, array=array_to_proto(np.asarray(v)))
            for k, v in (states or {}).items()
        ],
    )


def episode_from_proto(msg: pb.EpisodeArrays, what: str) -> dict[str, Any]:
    return {
        "actions": array_from_proto(msg.actions, f"{what}.actions"),
        "rewards": array_from_proto(msg.rewards, f"{what}.rewards"),
        "states": {
            s.name: array_from_proto(s.array, f"{what}.states[{s.name!r}]") for s in msg.states
        },
    }


def file_parts(session: str, name: str, data: bytes) -> Iterator[pb.FilePart]:
    """A file as FilePart messages: the first carries session, name, size and sha256."""
    pieces = _wire.file_pieces(data)
    yield pb.FilePart(
        session=session,
        name=name,
        size=len(data),
        sha256=_wire.digest(data),
        data=next(pieces),
    )
    for piece in pieces:
        yield pb.FilePart(data=piece)


def join_parts(parts: Iterable[pb.FilePart]) -> CheckpointFile | None:
    """The file a FilePart stream carries (size and sha256 checked); None for an empty one."""
    parts = iter(parts)
    first = next(parts, None)
    if first is None or first.empty:
        return None
    buf = bytearray(first.data)
    for part in parts:
        buf += part.data
    data = bytes(buf)
    _wire.check_file(first.name, first.size, first.sha256, data)
    return CheckpointFile(name=first.name, size=len(data), sha256=first.sha256, data=data)


# SessionStatus's counters and WorkerStatus's fields have the messages' names.
_COUNTERS = (
    "is_full",
    "num_recorded_steps",
    "episodes_finished",
    "chunks_stored",
    "chunks_dropped",
    "raw_bytes",
    "wire_bytes",
    "sequences_lost",
    "idle_seconds",
)


def session_status(msg: pb.StatusReply) -> SessionStatus:
    config = msg.config
    return SessionStatus(
        session=msg.session,
        **{name: getattr(msg, name) for name in _COUNTERS},
        max_episodes=config.max_episodes if config.HasField("max_episodes") else None,
        record_states=config.record_states,
        state_fields=tuple(config.state_fields),
        workers=tuple(
            WorkerStatus(**{f.name: getattr(w, f.name) for f in _WORKER_FIELDS})
            for w in msg.workers
        ),
    )


def status_to_proto(status: SessionStatus, capture_config_json: str) -> pb.StatusReply:
    """The inverse of session_status, given the session's capture configuration as JSON."""
    config = pb.SessionConfig(
        record_states=status.record_states,
        state_fields=status.state_fields,
        capture_config_json=capture_config_json,
    )
    if status.max_episodes is not None:
        config.max_episodes = status.max_episodes
    return pb.StatusReply(
        session=status.session,
        config=config,
        **{name: getattr(status, name) for name in _COUNTERS},
        # Field by field: dataclasses.asdict deep-copies each worker (4x slower at 1,000).
        workers=[
            pb.WorkerStatus(**{f.name: getattr(w, f.name) for f in _WORKER_FIELDS})
            for w in status.workers
        ],
    )
