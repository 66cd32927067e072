"""The Go-Explore-style trajectory store: cells, archive, repository, curriculum, utilities.

Pure Python + numpy (+ zstandard); no gRPC. See DESIGN.md, "Trajectory store".
"""

from .cells import find_state
from .processor import TrajectoryCaptureProcessor, build_store
from .sources import (
    EpisodeArrays,
    EpisodeBatch,
    EpisodeColumns,
    EpisodeList,
    EpisodeSource,
    EpisodeWindow,
)
from .store import (
    CHECKPOINT_FORMAT,
    BatchResult,
    CellInfo,
    EpisodeRecord,
    TrajectoryStore,
    decode_checkpoint_state,
    encode_checkpoint_state,
)

__all__ = [
    "BatchResult",
    "CHECKPOINT_FORMAT",
    "CellInfo",
    "EpisodeArrays",
    "EpisodeBatch",
    "EpisodeColumns",
    "EpisodeList",
    "EpisodeRecord",
    "EpisodeSource",
    "EpisodeWindow",
    "TrajectoryCaptureProcessor",
    "TrajectoryStore",
    "build_store",
    "decode_checkpoint_state",
    "encode_checkpoint_state",
    "find_state",
]
