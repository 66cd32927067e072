"""The cell archive: per-cell counters and the best known way to reach each cell.

Cells live in parallel numpy arrays indexed by a dense cell id (the order cells were first
seen); a dict maps each key (as bytes) to its id. While every key seen fits a small box (keys
on a grid, say), a table over that box gives a batch's ids in one gather instead of a dict
lookup per cell. Not thread-safe: the store locks around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels
from .batch import BatchCells, _code_space
from .cells import key_bytes

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


# The id table's most entries (int32 ids: 4 MB at most); beyond that the dict serves alone.
_TABLE_LIMIT = 1 << 20


@dataclass(frozen=True)
class BatchUpdate:
    """What a batch of episodes did to the archive (as if recorded one by one, in order)."""

    cell_ids: np.ndarray
    """(U,) archive ids of the batch's distinct cells (same order as BatchCells.keys)."""
    new_cells: np.ndarray
    """(E,) int64 cells first seen in each episode."""
    improved: np.ndarray
    """(E,) int64 cells whose best reference moved to each episode when it was recorded."""
    released_ep: np.ndarray
    """(R,) episode whose recording released a reference, sorted; with released_tid and
    released_count: episode released_ep[r] took released_count[r] cells from trajectory
    released_tid[r] (an older trajectory or an earlier episode of the batch)."""
    released_tid: np.ndarray
    released_count: np.ndarray


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
        # The id table: box lows and highs (F,), strides (F,) and ids (-1: no cell) over the
        # box; None until a batch needs it, and for good once the keys outgrow _TABLE_LIMIT.
        self._box: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._box_off = False

    def __len__(self) -> int:
        return self.size

    @property
    def id_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The id table as (box lows, box highs, strides, ids); None until a batch needs it,
        and once given up."""
        return self._box

    @property
    def id_table_given_up(self) -> bool:
        """Whether the keys outgrew the id table for good (the dict serves alone)."""
        return self._box_off

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

    def apply_batch(
        self, cells: BatchCells, first_trajectory_id: int, global_steps: np.ndarray
    ) -> BatchUpdate:
        """Fold a batch of episodes (trajectory ids first_trajectory_id, +1, ...) into the
        archive exactly as applying them one at a time would: visits, new cells (ids in the
        order the one-at-a-time path assigns them: by episode, then by key bytes), and best
        references (higher cumulative reward wins; on a tie, an earlier step; an episode is
        judged against the state the earlier episodes of the batch left). Refcounts are the
        caller's, from the returned releases."""
        num_eps = cells.num_episodes
        ids = self._ids(cells)
        new_per_ep = np.zeros(num_eps, dtype=np.int64)
        fresh = np.flatnonzero(ids < 0)
        if fresh.size:
            first = cells.first_index(fresh)
            first_ep = np.searchsorted(cells.offsets, first, side="right") - 1
            # One episode at a time, new cells get ids in np.unique order of their key bytes.
            _, byte_rank = np.unique(key_bytes(cells.keys[fresh]), return_inverse=True)
            order = np.lexsort((byte_rank.reshape(-1), first_ep))
            fresh, first, first_ep = fresh[order], first[order], first_ep[order]
            self._grow(self.size + fresh.size)
            new_ids = np.arange(self.size, self.size + fresh.size, dtype=np.int64)
            ids[fresh] = new_ids
            index = self._index
            key_ids = cells.key_ids
            for i, cid in zip(fresh.tolist(), new_ids.tolist(), strict=True):
                index[key_ids[i]] = cid
            self.keys[new_ids] = cells.keys[fresh]
            if self._box is not None:  # _ids made the box hold every key of the batch
                lows, _, strides, table = self._box
                table[(cells.keys[fresh] - lows) @ strides] = new_ids
            self.cols["first_seen_step"][new_ids] = global_steps[first_ep]
            self.cols["first_seen_offset"][new_ids] = first - cells.offsets[first_ep]
            self.size += fresh.size
            new_per_ep = np.bincount(first_ep, minlength=num_eps).astype(np.int64)
        self.cols["visits"][ids] += cells.visits

        improved, rel_ep, rel_tid, counts = self._replace_in_order(cells, ids, first_trajectory_id)
        return BatchUpdate(
            cell_ids=ids,
            new_cells=new_per_ep,
            improved=improved,
            released_ep=rel_ep,
            released_tid=rel_tid,
            released_count=counts,
        )

    def _ids(self, cells: BatchCells) -> np.ndarray:
        """(U,) archive id of each of the batch's cells, -1 for new ones."""
        keys = cells.keys
        if keys.shape[0] and not self._box_off and self._cover(keys):
            lows, _, strides, table = self._box
            return table[(keys - lows) @ strides].astype(np.int64)
        get = self._index.get
        return np.fromiter((get(k, -1) for k in cells.key_ids), np.int64, count=keys.shape[0])

    def _cover(self, keys: np.ndarray) -> bool:
        """Make the id table's box hold ``keys`` (rebuilt, with room to grow, when they fall
        outside it); False, for good, once it would pass _TABLE_LIMIT entries."""
        if self.size + keys.shape[0] >= 1 << 31:  # ids past int32: the dict alone
            self._box, self._box_off = None, True
            return False
        lo, hi = keys.min(axis=0), keys.max(axis=0)
        if self._box is not None:
            lows, highs, _, _ = self._box
            if (lo >= lows).all() and (hi <= highs).all():
                return True
        # The new box: twice the keys' actual extent (not the old box's), so that keys
        # drifting outward do not double it rebuild after rebuild.
        if self.size:
            held = self.keys[: self.size]
            lo, hi = np.minimum(lo, held.min(axis=0)), np.maximum(hi, held.max(axis=0))
        # Python ints until the box is known to fit int64, however far apart the keys are.
        lo_i, hi_i = lo.tolist(), hi.tolist()
        for slack in (True, False):
            # With slack: twice the extent, half of it on each side.
            widths = [h - a + 1 for a, h in zip(lo_i, hi_i, strict=True)]
            box = [
                (a - w // 2, h + w - w // 2) if slack else (a, h)
                for a, h, w in zip(lo_i, hi_i, widths, strict=True)
            ]
            if all(-(1 << 62) < a and h < (1 << 62) for a, h in box):
                lows = np.array([a for a, _ in box], dtype=np.int64)
                highs = np.array([h for _, h in box], dtype=np.int64)
                _, total, strides_i = _code_space(lows, highs)
                if total <= _TABLE_LIMIT:
                    break
        else:
            self._box, self._box_off = None, True
            return False
        strides = np.array(strides_i, dtype=np.int64)
        table = np.full(total, -1, dtype=np.int32)
        if self.size:
            table[(self.keys[: self.size] - lows) @ strides] = np.arange(self.size)
        self._box = (lows, highs, strides, table)
        return True

    def _replace_in_order(
        self, cells: BatchCells, ids: np.ndarray, first_trajectory_id: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Best-reference replacement for a batch, episode after episode:
        ``(improved (E,), released_ep, released_tid, released_count)``, releases sorted by
        (episode, trajectory id)."""
        best_traj = self.cols["best_trajectory"][ids]
        best_step = self.cols["best_step"][ids]
        best_ret = self.cols["best_return"][ids]
        improved, won, released = kernels.replace_in_order(
            cells.pair_ep,
            cells.pair_cell,
            cells.pair_best_step,
            cells.pair_best_return,
            best_traj,
            best_step,
            best_ret,
            first_trajectory_id,
        )
        if improved.shape[0] < cells.num_episodes:  # (np.pad costs ~0.1 ms a call)
            padded = np.zeros(cells.num_episodes, dtype=improved.dtype)
            padded[: improved.shape[0]] = improved
            improved = padded
        self.cols["best_trajectory"][ids] = best_traj
        self.cols["best_step"][ids] = best_step
        self.cols["best_return"][ids] = best_ret
        keep = won & (released >= 0)
        rel_ep, rel_tid = cells.pair_ep[keep], released[keep]
        if not rel_ep.size:
            empty = np.zeros(0, dtype=np.int64)
            return improved, empty, empty, empty
        low = int(rel_tid.min())
        tid_span = int(rel_tid.max()) - low + 1
        code, counts = np.unique(rel_ep * tid_span + (rel_tid - low), return_counts=True)
        rel_ep, rel_tid = np.divmod(code, tid_span)
        return improved, rel_ep, rel_tid + low, counts.astype(np.int64, copy=False)

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
