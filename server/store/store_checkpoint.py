"""The trajectory store's checkpoint format: its bytes, and the refcount check on loading."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import codec
from .archive import CellArchive
from .repository import TrajectoryRepository

CHECKPOINT_FORMAT = "recorder.trajectory_store.v1"


def _check_refcounts(archive: CellArchive, repository: TrajectoryRepository) -> None:
    best = archive.view("best_trajectory")
    if len(best) and best.min() < 0:
        raise ValueError("trajectory store checkpoint: a cell has no best reference")
    tids, counts = np.unique(best, return_counts=True)
    expected = dict(zip(tids.tolist(), counts.tolist(), strict=True))
    for tid in repository.ids():
        if repository.refcount(tid) != expected.pop(tid, 0):
            raise ValueError(f"trajectory store checkpoint: refcount of trajectory {tid} is wrong")
    if expected:
        raise ValueError(
            f"trajectory store checkpoint: cells reference missing trajectories {sorted(expected)}"
        )


def encode_checkpoint_state(state: dict[str, Any], compress: bool) -> bytes:
    """A :meth:`TrajectoryStore.checkpoint_state` dict as bytes (zstd frame when compress)."""
    meta = {k: v for k, v in state.items() if k != "arrays"}
    raw = codec.pack_arrays(state["arrays"], meta)
    return codec.compress(raw) if compress else raw


def decode_checkpoint_state(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_checkpoint_state` (compressed or not, detected by magic)."""
    arrays, meta = codec.unpack_arrays(codec.maybe_decompress(data))
    if not isinstance(meta, dict):
        raise ValueError(f"trajectory store checkpoint: expected a dict header, got {meta!r}")
    return {**meta, "arrays": arrays}
