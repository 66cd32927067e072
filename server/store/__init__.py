"""The Go-Explore-style trajectory store: cells, archive, repository, curriculum, utilities.

Pure Python + numpy (+ zstandard); no gRPC. See DESIGN.md, "Trajectory store".
"""

from .cells import EpisodeArrays, EpisodeBatch, EpisodeColumns, EpisodeWindow
from .store import (
    CHECKPOINT_FORMAT,
    CellInfo,
    EpisodeRecord,
    TrajectoryStore,
    decode_checkpoint_state,
    encode_checkpoint_state,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CellInfo",
    "EpisodeArrays",
    "EpisodeBatch",
    "EpisodeColumns",
    "EpisodeRecord",
    "EpisodeWindow",
    "TrajectoryStore",
    "decode_checkpoint_state",
    "encode_checkpoint_state",
]
