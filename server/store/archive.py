"""The cell archive: per-cell counters and the best known way to reach each cell.

Cells live in parallel numpy arrays indexed by a dense cell id (the order cells were first
seen); a dict maps each key (as bytes) to its id. Not thread-safe: the store locks around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import BatchCells
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
        num_cells = len(cells.key_ids)
        get = self._index.get
        ids = np.fromiter((get(k, -1) for k in cells.key_ids), dtype=np.int64, count=num_cells)
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
            self.cols["first_seen_step"][new_ids] = global_steps[first_ep]
            self.cols["first_seen_offset"][new_ids] = first - cells.offsets[first_ep]
            self.size += fresh.size
            new_per_ep = np.bincount(first_ep, minlength=num_eps).astype(np.int64)
        self.cols["visits"][ids] += cells.visits

        if num_eps == 1:
            improved, rel_tid, counts = self._replace_one(cells, ids, first_trajectory_id)
            rel_ep = np.zeros(rel_tid.shape[0], dtype=np.int64)
        else:
            improved, rel_ep, rel_tid, counts = self._replace_in_order(
                cells, ids, first_trajectory_id
            )
        return BatchUpdate(
            cell_ids=ids,
            new_cells=new_per_ep,
            improved=improved,
            released_ep=rel_ep,
            released_tid=rel_tid,
            released_count=counts,
        )

    def _replace_one(
        self, cells: BatchCells, ids: np.ndarray, trajectory_id: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Best-reference replacement for a batch of one episode (each cell has one candidate,
        in cell order): ``(improved (1,), released tids, their counts)``."""
        best_ret = self.cols["best_return"][ids]
        best_step = self.cols["best_step"][ids]
        best_traj = self.cols["best_trajectory"][ids]
        ret, step = cells.pair_best_return, cells.pair_best_step
        won = (best_traj < 0) | (ret > best_ret)
        won |= (ret == best_ret) & (step < best_step)
        old = best_traj[won]
        old = old[old >= 0]
        if old.size:
            tids, counts = np.unique(old, return_counts=True)
        else:
            tids = counts = np.zeros(0, dtype=np.int64)
        target = ids[won]
        self.cols["best_trajectory"][target] = trajectory_id
        self.cols["best_step"][target] = step[won]
        self.cols["best_return"][target] = ret[won]
        return np.array([np.count_nonzero(won)], dtype=np.int64), tids, counts

    def _replace_in_order(
        self, cells: BatchCells, ids: np.ndarray, first_trajectory_id: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Best-reference replacement for a batch, episode after episode:
        ``(improved (E,), released_ep, released_tid, released_count)``."""
        num_eps = cells.num_episodes
        order = cells.cell_order
        c_cell = cells.pair_cell[order]
        c_ret = cells.pair_best_return[order]
        c_step = cells.pair_best_step[order]
        best_traj = self.cols["best_trajectory"][ids]
        best_ret = self.cols["best_return"][ids]
        best_step = self.cols["best_step"][ids]
        # A candidate that does not beat its cell's incumbent never beats the running best
        # (which is at least the incumbent), so it neither improves the cell nor holds it:
        # drop those, and the cells left without candidates.
        inc_ret, inc_step = best_ret[c_cell], best_step[c_cell]
        beats = (best_traj[c_cell] < 0) | (c_ret > inc_ret)
        beats |= (c_ret == inc_ret) & (c_step < inc_step)
        sel = np.flatnonzero(beats)
        if sel.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return np.zeros(num_eps, dtype=np.int64), empty, empty, empty
        order, c_cell, c_ret, c_step = order[sel], c_cell[sel], c_ret[sel], c_step[sel]
        used = np.flatnonzero(np.bincount(c_cell, minlength=ids.shape[0]))
        if used.shape[0] != ids.shape[0]:
            compact = np.empty(ids.shape[0], dtype=np.int64)
            compact[used] = np.arange(used.shape[0], dtype=np.int64)
            c_cell = compact[c_cell]
            ids, best_traj = ids[used], best_traj[used]
            best_ret, best_step = best_ret[used], best_step[used]
        num_cells = ids.shape[0]
        c_ep = cells.pair_ep[order]
        # Per cell, a segment: the incumbent (or a placeholder), then the batch's candidates
        # in episode order. A candidate improves the cell iff it beats the running best of its
        # segment so far, so a segmented running max over a rank that orders (return, -step)
        # replays the one-at-a-time replacement rule.
        num_pairs = order.shape[0]
        ncand = np.bincount(c_cell, minlength=num_cells)
        size = num_pairs + num_cells
        start = np.arange(num_cells, dtype=np.int64) + np.cumsum(ncand) - ncand
        cpos = np.arange(num_pairs, dtype=np.int64) + c_cell + 1
        item_tid = np.empty(size, dtype=np.int64)
        item_tid[start] = best_traj
        item_tid[cpos] = first_trajectory_id + c_ep
        item_ret = np.empty(size, dtype=np.float64)
        item_ret[start] = best_ret
        item_ret[cpos] = c_ret
        item_step = np.empty(size, dtype=np.int64)
        item_step[start] = best_step
        item_step[cpos] = c_step
        valid = np.ones(size, dtype=bool)
        valid[start] = best_traj >= 0
        rank = np.zeros(size, dtype=np.int64)
        if size:
            _, ret_rank = np.unique(item_ret[valid], return_inverse=True)
            ret_rank = ret_rank.reshape(-1)
            vstep = item_step[valid]
            span = int(vstep.max()) + 1 if vstep.size else 1
            rank[valid] = ret_rank * span + (span - 1 - vstep) + 1
            width = (int(ret_rank.max()) + 1 if ret_rank.size else 0) * span + 1
            if num_cells * width >= 1 << 62:
                _, dense = np.unique(rank, return_inverse=True)
                rank = dense.reshape(-1).astype(np.int64)
                width = int(rank.max()) + 1
            cell_of_item = np.repeat(np.arange(num_cells, dtype=np.int64), ncand + 1)
            rank += cell_of_item * width
        running = np.maximum.accumulate(rank)
        won = np.zeros(size, dtype=bool)
        won[1:] = rank[1:] > running[:-1]
        won[start] = False
        holder = np.where(won, np.arange(size, dtype=np.int64), 0)
        holder[start] = start
        holder = np.maximum.accumulate(holder)

        c_won = won[cpos]
        won_pos = cpos[c_won]
        won_ep = c_ep[c_won]
        improved_per_ep = np.bincount(won_ep, minlength=num_eps).astype(np.int64)
        prev_tid = item_tid[holder[won_pos - 1]]
        keep = prev_tid >= 0
        rel_ep, rel_tid = won_ep[keep], prev_tid[keep]
        if rel_ep.size:
            low = int(rel_tid.min())
            tid_span = int(rel_tid.max()) - low + 1
            code, counts = np.unique(rel_ep * tid_span + (rel_tid - low), return_counts=True)
            rel_ep, rel_tid = np.divmod(code, tid_span)
            rel_tid += low
        else:
            counts = np.zeros(0, dtype=np.int64)

        final = holder[start + ncand]
        moved = final != start
        target, final = ids[moved], final[moved]
        self.cols["best_trajectory"][target] = item_tid[final]
        self.cols["best_step"][target] = item_step[final]
        self.cols["best_return"][target] = item_ret[final]
        return improved_per_ep, rel_ep, rel_tid, counts.astype(np.int64, copy=False)

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
