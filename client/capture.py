"""`recorder.capture`: the trajectory store's verbs, called remotely.

Mirrors TrajectoryCaptureProcessor (seeds/trajectory_capture_processor_api.txt);
everything comes back as Python and numpy types, never protobuf.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from . import codec
from ._proto import recorder_pb2 as pb
from .capture_types import CheckpointFile, EpisodeOutcome, TrajectorySliceReference
from .errors import from_rpc_error

_PART_BYTES = 1 << 20


@dataclass(frozen=True)
class Episode:
    """One episode or prefix: actions (L, ...), rewards (L,), states by env-state name."""

    actions: np.ndarray
    rewards: np.ndarray
    states: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.rewards.shape[0])


def _episode_to_proto(actions: Any, rewards: Any, states: Mapping[str, Any] | None):
    return pb.EpisodeArrays(
        actions=codec.encode_array(np.asarray(actions)),
        rewards=codec.encode_array(np.asarray(rewards)),
        states=[
            pb.NamedArray(name=k, array=codec.encode_array(np.asarray(v)))
            for k, v in (states or {}).items()
        ],
    )


def _episode_from_proto(msg: pb.EpisodeArrays) -> Episode:
    return Episode(
        codec.decode_array(msg.actions, "prefix.actions"),
        codec.decode_array(msg.rewards, "prefix.rewards"),
        {s.name: codec.decode_array(s.array, f"prefix.states[{s.name!r}]") for s in msg.states},
    )


def file_parts(session: str, name: str, data: bytes) -> Iterator[pb.FilePart]:
    view = memoryview(data)
    yield pb.FilePart(
        session=session,
        name=name,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        data=bytes(view[:_PART_BYTES]),
    )
    for offset in range(_PART_BYTES, len(data), _PART_BYTES):
        yield pb.FilePart(data=bytes(view[offset : offset + _PART_BYTES]))


def read_parts(parts: Iterator[pb.FilePart]) -> tuple[pb.FilePart | None, bytes]:
    """The first part (metadata) and the joined bytes; checks the declared size and sha256."""
    parts = iter(parts)
    first = next(parts, None)
    if first is None or first.empty:
        return first, b""
    buf = bytearray(first.data)
    for part in parts:
        buf += part.data
        if len(buf) > first.size:
            break
    data = bytes(buf)
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != first.size or digest != first.sha256:
        raise ValueError(
            f"file {first.name!r}: expected {first.size} bytes with sha256 {first.sha256}, "
            f"got {len(data)} bytes with sha256 {digest}"
        )
    return first, data


def join_parts(parts: Iterator[pb.FilePart]) -> CheckpointFile | None:
    first, data = read_parts(parts)
    if first is None or first.empty:
        return None
    return CheckpointFile(name=first.name, size=len(data), sha256=first.sha256, data=data)


class RemoteCapture:
    """The session's trajectory store, reached through the recorder's connection."""

    def __init__(self, recorder: Any) -> None:
        self._recorder = recorder

    def _call(self, method: str, request: Any) -> Any:
        rec = self._recorder
        rec.flush()  # the store reflects every chunk this worker recorded
        try:
            return getattr(rec._stub, method)(request, timeout=rec._rpc_timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, rec.target) from None

    def record_episode(
        self,
        actions: Any,
        rewards: Any,
        states: Mapping[str, Any] | None = None,
        *,
        outcome: EpisodeOutcome | int | str,
        episode_data: Mapping[str, float] | None = None,
        step: int = 0,
        start_reference: TrajectorySliceReference | None = None,
    ) -> int:
        """Submit one whole episode; returns the session's captured-episode count."""
        request = pb.SubmitEpisodeRequest(
            session=self._recorder.session,
            episode=_episode_to_proto(actions, rewards, states),
            episode_data=dict(episode_data or {}),
            step=int(step),
            outcome=int(EpisodeOutcome.coerce(outcome)),
        )
        if start_reference is not None:
            request.start_reference.CopyFrom(
                pb.SliceReference(
                    trajectory_id=start_reference.trajectory_id, step=start_reference.step
                )
            )
        return int(self._call("SubmitEpisode", request).episodes_captured)

    def sample_start(self) -> tuple[TrajectorySliceReference, Episode] | None:
        """A curriculum start and its recorded prefix; None without a store or cells."""
        reply = self._call("SampleStart", pb.SampleStartRequest(session=self._recorder.session))
        if not reply.found:
            return None
        ref = TrajectorySliceReference(reply.reference.trajectory_id, reply.reference.step)
        return ref, _episode_from_proto(reply.prefix)

    def snapshot_potential(
        self, utility_key: str, field_names: list[str]
    ) -> dict[tuple[int, ...], float]:
        """{(cell values of field_names): net value}; {} when the store is off."""
        reply = self._call(
            "SnapshotPotential",
            pb.SnapshotPotentialRequest(
                session=self._recorder.session,
                utility_key=utility_key,
                field_names=list(field_names),
            ),
        )
        width = reply.key_width
        if not width:  # no key fields kept: every cell merged into one
            return {(): float(reply.values[0])} if reply.values else {}
        keys = np.asarray(reply.keys, dtype=np.int64).reshape(-1, width)
        return {tuple(int(k) for k in row): float(v) for row, v in zip(keys, reply.values)}

    def trajectory_store_checkpoint_file(
        self, compress: bool = True, *, checkpoint_step: int = 0
    ) -> CheckpointFile | None:
        """The reusable store payload (bytes in `data`); None when the store is off."""
        rec = self._recorder
        rec.flush()
        request = pb.StoreCheckpointRequest(
            session=rec.session, compress=bool(compress), checkpoint_step=int(checkpoint_step)
        )
        try:
            return join_parts(rec._stub.GetStoreCheckpoint(request, timeout=rec._rpc_timeout))
        except grpc.RpcError as err:
            raise from_rpc_error(err, rec.target) from None

    def load_trajectory_store_checkpoint_data(
        self, state: CheckpointFile | bytes | str | os.PathLike[str]
    ) -> None:
        """Seed this session's store from a payload written by any server."""
        rec = self._recorder
        if isinstance(state, CheckpointFile):
            data = state.data if state.data is not None else open(state.path or "", "rb").read()
            name = state.name
        elif isinstance(state, (bytes, bytearray, memoryview)):
            data, name = bytes(state), "store-checkpoint"
        else:
            with open(state, "rb") as fh:
                data, name = fh.read(), os.path.basename(os.fspath(state))
        rec.flush()
        try:
            rec._stub.LoadStoreCheckpoint(
                file_parts(rec.session, name, data), timeout=rec._rpc_timeout
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, rec.target) from None
