"""The cell archive: per-cell counters and the best known way to reach each cell.

Cells live in parallel numpy arrays indexed by a dense cell id (the order cells were first
seen); a dict maps each key (as bytes) to its id. Not thread-safe: the store locks around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cells import EpisodeCells, key_bytes

# Array name -> (dtype, fill for new cells). "keys" is (capacity, F); the rest are (capacity,).
_COLUMNS: dict[str, tuple[type, float | int]] = {
    "visits": (np.int64, 0),
    "first_seen_step": (np.int64, 0),
    "first_seen_offset": (np.int64, 0),
    "times_chosen": (np.int64, 0),
    "best_trajectory": (np.int64, -1),
    "best_step": (np.int64, 0),
    "best_return": (np.float64, -np.inf),
}


@dataclass(frozen=True)
class ArchiveUpdate:
    """What one episode did to the archive."""

    cell_ids: np.ndarray
    """(U,) archive ids of the episode's distinct cells (same order as EpisodeCells)."""
    new_cells: int
    """How many of them were first seen in this episode."""
    improved: np.ndarray
    """(U,) bool: the episode is now the cell's best reference."""
    released: dict[int, int]
    """Old best trajectory id -> number of cells that stopped referencing it."""


class CellArchive:
    """Growable per-cell arrays plus a key index."""

    def __init__(self, num_fields: int, capacity: int = 1024) -> None:
        self.num_fields = num_fields
        self.size = 0
        self._index: dict[bytes, int] = {}
        self.keys = np.zeros((capacity, num_fields), dtype=np.int64)
        self.cols: dict[str, np.ndarray] = {
            name: np.full(capacity, fill, dtype=dtype) for name, (dtype, fill) in _COLUMNS.items()
        }

    def __len__(self) -> int:
        return self.size

    def _grow(self, needed: int) -> None:
        capacity = self.keys.shape[0]
        if needed <= capacity:
            return
        new_cap = max(needed, 2 * capacity)
        keys = np.zeros((new_cap, self.num_fields), dtype=np.int64)
        keys[: self.size] = self.keys[: self.size]
        self.keys = keys
        for name, (dtype, fill) in _COLUMNS.items():
            col = np.full(new_cap, fill, dtype=dtype)
            col[: self.size] = self.cols[name][: self.size]
            self.cols[name] = col

    def lookup(self, key: tuple[int, ...]) -> int | None:
        """The id of a cell key, or None."""
        if len(key) != self.num_fields:
            return None
        return self._index.get(key_bytes(np.asarray([key], dtype=np.int64)).tolist()[0])

    def view(self, name: str) -> np.ndarray:
        """The live (size,) column (``keys`` gives (size, F))."""
        if name == "keys":
            return self.keys[: self.size]
        return self.cols[name][: self.size]

    def apply_episode(
        self, cells: EpisodeCells, trajectory_id: int, global_step: int
    ) -> ArchiveUpdate:
        """Add visits, register new cells, and move best references to this episode where it
        wins (higher cumulative reward; on a tie, an earlier step). Refcounts are the caller's."""
        index = self._index
        ids = np.fromiter(
            (index.get(k, -1) for k in cells.key_ids), dtype=np.int64, count=len(cells.key_ids)
        )
        fresh = np.flatnonzero(ids < 0)
        if fresh.size:
            self._grow(self.size + fresh.size)
            new_ids = np.arange(self.size, self.size + fresh.size, dtype=np.int64)
            ids[fresh] = new_ids
            for i, cid in zip(fresh.tolist(), new_ids.tolist(), strict=True):
                index[cells.key_ids[i]] = cid
            self.keys[new_ids] = cells.keys[fresh]
            self.cols["first_seen_step"][new_ids] = global_step
            self.cols["first_seen_offset"][new_ids] = cells.first_step[fresh]
            self.size += fresh.size
        counts = np.bincount(cells.inverse, minlength=ids.size)
        self.cols["visits"][ids] += counts
        best_ret = self.cols["best_return"][ids]
        best_step = self.cols["best_step"][ids]
        best_traj = self.cols["best_trajectory"][ids]
        improved = (best_traj < 0) | (cells.best_return > best_ret)
        improved |= (cells.best_return == best_ret) & (cells.best_step < best_step)
        released: dict[int, int] = {}
        old = best_traj[improved]
        old = old[old >= 0]
        if old.size:
            tids, n = np.unique(old, return_counts=True)
            released = dict(zip(tids.tolist(), n.tolist(), strict=True))
        won = ids[improved]
        self.cols["best_trajectory"][won] = trajectory_id
        self.cols["best_step"][won] = cells.best_step[improved]
        self.cols["best_return"][won] = cells.best_return[improved]
        return ArchiveUpdate(
            cell_ids=ids, new_cells=int(fresh.size), improved=improved, released=released
        )

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of every live column, for a checkpoint."""
        out = {"keys": self.view("keys").copy()}
        out.update({name: self.view(name).copy() for name in _COLUMNS})
        return out

    @classmethod
    def from_state_arrays(cls, num_fields: int, arrays: dict[str, np.ndarray]) -> CellArchive:
        """Rebuild from :meth:`state_arrays` output."""
        missing = sorted({"keys", *_COLUMNS} - set(arrays))
        if missing:
            raise ValueError(f"archive: checkpoint lacks arrays {missing}")
        keys = np.asarray(arrays["keys"], dtype=np.int64)
        if keys.ndim != 2 or keys.shape[1] != num_fields:
            raise ValueError(f"archive: keys shape {keys.shape}, expected (N, {num_fields})")
        n = keys.shape[0]
        archive = cls(num_fields, capacity=max(n, 1024))
        archive.keys[:n] = keys
        for name, (dtype, _) in _COLUMNS.items():
            col = np.asarray(arrays[name])
            if col.shape != (n,):
                raise ValueError(f"archive: {name} shape {col.shape}, expected ({n},)")
            archive.cols[name][:n] = col.astype(dtype, copy=False)
        archive.size = n
        archive._index = {k: i for i, k in enumerate(key_bytes(keys).tolist())}
        if len(archive._index) != n:
            raise ValueError("archive: checkpoint has duplicate cell keys")
        return archive
