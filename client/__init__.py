"""Rollout Recorder client: record rollout chunks into a recorder server.

Imports only grpcio, protobuf, numpy and zstandard.
"""

from .capture import Episode, RemoteCapture
from .capture_types import (
    CellField,
    CheckpointFile,
    EpisodeOutcome,
    OutcomeRule,
    TrajectoryKey,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from .errors import (
    AuthenticationError,
    InvalidChunkError,
    NoDataError,
    RecorderError,
    RecorderUnavailableError,
    ResourceExhaustedError,
    SessionMismatchError,
)
from .recorder import RolloutRecorder
from .trajectory import Trajectory

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CellField",
    "CheckpointFile",
    "Episode",
    "EpisodeOutcome",
    "OutcomeRule",
    "RemoteCapture",
    "TrajectoryKey",
    "TrajectorySliceReference",
    "TrajectoryTrainingConfiguration",
    "UtilityConfig",
    "InvalidChunkError",
    "NoDataError",
    "RecorderError",
    "RecorderUnavailableError",
    "ResourceExhaustedError",
    "RolloutRecorder",
    "SessionMismatchError",
    "Trajectory",
    "__version__",
]
