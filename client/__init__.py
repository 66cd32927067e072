"""Rollout Recorder client: record rollout chunks into a recorder server.

Imports only grpcio, protobuf, numpy and zstandard.
"""

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
