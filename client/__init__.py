"""Rollout Recorder client: record rollout chunks into a recorder server.

Imports only grpcio, protobuf, numpy and zstandard; the dataset readers (``read_episodes``,
``open_dataset``) import pyarrow and fsspec when called. Names load on first use, so that the
plain types (``capture_types``) and the wire rules the server shares load without gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "ArchiveColumns": "capture_types",
    "AuthenticationError": "errors",
    "CellField": "capture_types",
    "CheckpointFile": "capture_types",
    "DataLossError": "errors",
    "Episode": "capture",
    "EpisodeOutcome": "capture_types",
    "InvalidChunkError": "errors",
    "InvalidNameError": "errors",
    "InvalidQueryError": "errors",
    "NoDataError": "errors",
    "OutcomeRule": "capture_types",
    "RecorderError": "errors",
    "RecorderUnavailableError": "errors",
    "RemoteCapture": "capture",
    "ResourceExhaustedError": "errors",
    "RolloutRecorder": "recorder",
    "SessionDroppedError": "errors",
    "SessionMismatchError": "errors",
    "SessionStatus": "status",
    "StoreNotConfiguredError": "errors",
    "StreamStats": "_stream",
    "Trajectory": "trajectory",
    "TrajectoryKey": "capture_types",
    "TrajectorySliceReference": "capture_types",
    "TrajectoryTrainingConfiguration": "capture_types",
    "UnknownSessionError": "errors",
    "UtilityConfig": "capture_types",
    "WorkerIdInUseError": "errors",
    "WorkerStatus": "status",
    "drop_session": "sessions",
    "fetch_episodes": "sessions",
    "list_sessions": "sessions",
    "open_dataset": "dataset",
    "read_episodes": "dataset",
    "unflatten": "_obs",
}

__all__ = [
    "ArchiveColumns",
    "AuthenticationError",
    "CellField",
    "CheckpointFile",
    "DataLossError",
    "Episode",
    "EpisodeOutcome",
    "InvalidChunkError",
    "InvalidNameError",
    "InvalidQueryError",
    "NoDataError",
    "OutcomeRule",
    "RecorderError",
    "RecorderUnavailableError",
    "RemoteCapture",
    "ResourceExhaustedError",
    "RolloutRecorder",
    "SessionDroppedError",
    "SessionMismatchError",
    "SessionStatus",
    "StoreNotConfiguredError",
    "StreamStats",
    "Trajectory",
    "TrajectoryKey",
    "TrajectorySliceReference",
    "TrajectoryTrainingConfiguration",
    "UnknownSessionError",
    "UtilityConfig",
    "WorkerIdInUseError",
    "WorkerStatus",
    "__version__",
    "drop_session",
    "fetch_episodes",
    "list_sessions",
    "open_dataset",
    "read_episodes",
    "unflatten",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from ._obs import unflatten
    from ._stream import StreamStats
    from .capture import Episode, RemoteCapture
    from .capture_types import (
        ArchiveColumns,
        CellField,
        CheckpointFile,
        EpisodeOutcome,
        OutcomeRule,
        TrajectoryKey,
        TrajectorySliceReference,
        TrajectoryTrainingConfiguration,
        UtilityConfig,
    )
    from .dataset import open_dataset, read_episodes
    from .errors import (
        AuthenticationError,
        DataLossError,
        InvalidChunkError,
        InvalidNameError,
        InvalidQueryError,
        NoDataError,
        RecorderError,
        RecorderUnavailableError,
        ResourceExhaustedError,
        SessionDroppedError,
        SessionMismatchError,
        StoreNotConfiguredError,
        UnknownSessionError,
        WorkerIdInUseError,
    )
    from .recorder import RolloutRecorder
    from .sessions import drop_session, fetch_episodes, list_sessions
    from .status import SessionStatus, WorkerStatus
    from .trajectory import Trajectory
