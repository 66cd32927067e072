"""`recorder.capture`: the trajectory store's verbs, called remotely.

Mirrors TrajectoryCaptureProcessor (seeds/trajectory_capture_processor_api.txt);
everything comes back as Python and numpy types, never protobuf.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._connection import Connection
from ._messages import (
    array_from_proto,
    episode_from_proto,
    episode_to_proto,
    file_parts,
    join_parts,
)
from ._proto import recorder_pb2 as pb
from .capture_types import (
    ArchiveColumns,
    CheckpointFile,
    EpisodeOutcome,
    TrajectorySliceReference,
)


@dataclass(frozen=True)
class Episode:
    """One episode or prefix: actions (L, ...), rewards (L,), states by env-state name."""

    actions: np.ndarray
    rewards: np.ndarray
    states: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.rewards.shape[0])


class RemoteCapture:
    """The session's trajectory store, reached through the recorder's connection."""

    def __init__(self, connection: Connection, session: str, flush: Callable[[], None]) -> None:
        self._connection = connection
        self._session = session
        # Called before every verb: the store then reflects every chunk this worker recorded.
        self._flush = flush
        self._enabled: bool | None = None

    @property
    def enabled(self) -> bool:
        """Whether the session has a trajectory store (it was created with ``capture=``).

        Without one, the seed's verbs answer as the seed documents for a processor without a
        store (`snapshot_potential` ``{}``, `sample_start` and
        `trajectory_store_checkpoint_file` None, `record_episode` only counts), and
        `archive` and `load_trajectory_store_checkpoint_data` raise StoreNotConfiguredError.
        """
        if self._enabled is None:
            reply = self._connection.call("GetStatus", pb.StatusRequest(session=self._session))
            self._enabled = bool(reply.config.capture_config_json)
        return self._enabled

    def _call(self, method: str, request: Any) -> Any:
        self._flush()
        return self._connection.call(method, request)

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
            session=self._session,
            episode=episode_to_proto(actions, rewards, states),
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
        """A curriculum start (its reference names the chosen cell) and its recorded prefix;
        None without a store or cells."""
        reply = self._call("SampleStart", pb.SampleStartRequest(session=self._session))
        if not reply.found:
            return None
        ref = TrajectorySliceReference(
            reply.reference.trajectory_id, reply.reference.step, tuple(reply.cell)
        )
        return ref, Episode(**episode_from_proto(reply.prefix, "prefix"))

    def archive(self) -> ArchiveColumns:
        """The cell archive as numpy columns, after every chunk this worker recorded reached
        the store; StoreNotConfiguredError without a store."""
        reply = self._call("GetArchive", pb.ArchiveRequest(session=self._session))
        columns = {c.name: array_from_proto(c.array, f"archive.{c.name}") for c in reply.columns}
        return ArchiveColumns.from_columns(columns, reply.key_names, reply.utility_names)

    def snapshot_potential(
        self, utility_key: str, field_names: list[str]
    ) -> dict[tuple[int, ...], float]:
        """{(cell values of field_names): net value}; {} when the store is off.
        InvalidQueryError for an unknown utility or field name (or a field given twice)."""
        reply = self._call(
            "SnapshotPotential",
            pb.SnapshotPotentialRequest(
                session=self._session,
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
        self._flush()
        request = pb.StoreCheckpointRequest(
            session=self._session, compress=bool(compress), checkpoint_step=int(checkpoint_step)
        )
        return join_parts(self._connection.download("GetStoreCheckpoint", request))

    def load_trajectory_store_checkpoint_data(
        self, state: CheckpointFile | bytes | str | os.PathLike[str]
    ) -> None:
        """Seed this session's store from a payload written by any server."""
        if isinstance(state, CheckpointFile):
            data = state.data if state.data is not None else open(state.path or "", "rb").read()
            name = state.name
        elif isinstance(state, (bytes, bytearray, memoryview)):
            data, name = bytes(state), "store-checkpoint"
        else:
            with open(state, "rb") as fh:
                data, name = fh.read(), os.path.basename(os.fspath(state))
        self._flush()
        self._connection.upload("LoadStoreCheckpoint", file_parts(self._session, name, data))
