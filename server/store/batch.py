"""Grouping a batch of episodes by cell, vectorised over the whole batch.

The input is the concatenation of the batch's episodes (in recording order): the cell-key
columns and the cumulative reward (float64, restarting at each episode) of every step, plus the
episodes' lengths. Everything here depends on the episodes only, never on the store's state, so
it runs before the store's lock is taken; :meth:`CellArchive.apply_batch` then folds the result
into the archive under the lock, as if the episodes had been recorded one by one.

A (episode, cell) "pair" is one cell as visited by one episode; its best step is the step with
the highest cumulative reward in that cell, the earliest on a tie.

No sort over the S steps is needed when the cell keys span a small range (the usual case:
positions on a grid): each step's key becomes a dense mixed-radix code, cells and pairs come
from bincounts over ``code`` and ``episode * codes + code``. Wide ranges fall back to np.unique.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cells import key_bytes

# Dense bincount-based grouping is used while the number of bins is at most
# max(_DENSE_FACTOR * steps, _DENSE_MIN); beyond that, np.unique (a sort) is cheaper.
_DENSE_MIN = 1 << 16
_DENSE_FACTOR = 4
_CODE_LIMIT = 1 << 62
# Below this many steps, the run filter in group_batch costs more than it saves.
_RUN_FILTER_MIN = 256


@dataclass(frozen=True, eq=False)
class BatchCells:
    """The distinct cells of a batch of episodes, and each episode's best step in each of them.

    Steps carry a cell "code" in [0, num_codes): every distinct cell has one code (``codes``),
    and codes that no step uses may exist (a dense code space)."""

    lengths: np.ndarray
    """(E,) int64 episode lengths (0 allowed)."""
    offsets: np.ndarray
    """(E+1,) int64: episode e holds steps offsets[e]..offsets[e+1]-1 of the concatenation."""
    keys: np.ndarray
    """(U, F) int64 distinct cell keys of the batch."""
    key_ids: list[bytes]
    """The same keys as bytes (dict keys of the archive index)."""
    visits: np.ndarray
    """(U,) int64 steps spent in each cell over the batch."""
    codes: np.ndarray
    """(U,) code of each distinct cell."""
    step_codes: np.ndarray
    """(S,) code of each step's cell."""
    num_codes: int
    pair_ep: np.ndarray
    """(P,) episode of each pair; pairs are ordered by (episode, cell)."""
    pair_cell: np.ndarray
    """(P,) cell (index into ``keys``) of each pair."""
    pair_best_step: np.ndarray
    """(P,) 0-based step within the episode: highest cumulative reward, earliest on a tie."""
    pair_best_return: np.ndarray
    """(P,) float64 cumulative reward at that step."""
    cell_order: np.ndarray
    """(P,) the pairs ordered by (cell, episode)."""
    pair_bins: np.ndarray
    """(S,) bin of each step, for per-pair bincounts (see :meth:`pair_sums`)."""
    pair_nbins: int
    pair_select: np.ndarray | None
    """Bin of each pair, or None when bins are the pairs themselves."""

    @property
    def num_episodes(self) -> int:
        return int(self.lengths.shape[0])

    def pair_sums(self, weights: np.ndarray) -> np.ndarray:
        """(P,) per-pair sums of per-step ``weights``, each accumulated in step order from 0.0
        (bit-identical to a per-episode ``np.bincount(inverse, weights)``)."""
        sums = np.bincount(self.pair_bins, weights=weights, minlength=self.pair_nbins)
        return sums if self.pair_select is None else sums[self.pair_select]

    def first_index(self, cells: np.ndarray) -> np.ndarray:
        """Global index (into the concatenation) of the first step in each of ``cells``."""
        wanted = np.zeros(self.num_codes, dtype=bool)
        codes = self.codes[cells]
        wanted[codes] = True
        steps = np.flatnonzero(wanted[self.step_codes])
        first = np.full(self.num_codes, self.step_codes.shape[0], dtype=np.int64)
        np.minimum.at(first, self.step_codes[steps], steps)
        return first[codes]


def _dense_limit(num_steps: int) -> int:
    return max(_DENSE_FACTOR * num_steps, _DENSE_MIN)


def _step_codes(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """Cell codes of the steps from the (F, S) key columns:
    ``(step_codes (S,), keys (U, F), num_codes, codes (U,), visits (U,))``."""
    width = columns.shape[0]
    lows = columns.min(axis=1)
    ranges = [h - lo + 1 for h, lo in zip(columns.max(axis=1).tolist(), lows.tolist())]
    total = 1
    for r in ranges:
        total *= r
    if total >= _CODE_LIMIT:
        voids = key_bytes(np.ascontiguousarray(columns.T))
        uniq, inverse, visits = np.unique(voids, return_inverse=True, return_counts=True)
        keys = np.ascontiguousarray(uniq).view(np.int64).reshape(uniq.shape[0], width)
        return inverse.reshape(-1), keys, keys.shape[0], np.arange(keys.shape[0]), visits
    # Mixed-radix code, first field most significant: sum(c_j * stride_j) minus
    # sum(low_j * stride_j), exact in wrapping int64 arithmetic since it lies in [0, total).
    strides = [1] * width
    for j in range(width - 2, -1, -1):
        strides[j] = strides[j + 1] * ranges[j + 1]
    code = columns[0] * strides[0] if strides[0] != 1 else columns[0].copy()
    for j in range(1, width):
        code += columns[j] * strides[j] if strides[j] != 1 else columns[j]
    offset = sum(lo * st for lo, st in zip(lows.tolist(), strides, strict=True))
    offset = (offset + (1 << 63)) % (1 << 64) - (1 << 63)  # as the int64 it wraps to
    if offset:
        code -= offset
    if total <= _dense_limit(columns.shape[1]):
        counts = np.bincount(code, minlength=total)
        codes = np.flatnonzero(counts)
        visits = counts[codes]
        keys = np.stack(np.unravel_index(codes, ranges), axis=1)
        keys += lows
        return code, keys, total, codes, visits
    raw, code, visits = np.unique(code, return_inverse=True, return_counts=True)
    keys = np.stack(np.unravel_index(raw, ranges), axis=1)
    keys += lows
    return code.reshape(-1), keys, raw.shape[0], np.arange(raw.shape[0]), visits


def group_batch(
    columns: np.ndarray, cumulative: np.ndarray, lengths: np.ndarray, offsets: np.ndarray
) -> BatchCells:
    """Group the concatenated steps of a batch by cell and by (episode, cell) pair, from the
    (F, S) int64 key columns and (S,) cumulative rewards of the steps (S > 0), the (E,)
    episode lengths and their (E+1,) offsets."""
    num_eps = lengths.shape[0]
    num_steps = int(offsets[-1])
    if num_steps == 0 or columns.shape[1] != num_steps or cumulative.shape != (num_steps,):
        raise ValueError(
            f"batch: {columns.shape[1]} keys and {cumulative.shape} returns for {num_steps} steps"
        )
    step_codes, keys, num_codes, codes, visits = _step_codes(columns)
    num_cells = codes.shape[0]

    single = num_eps == 1
    if single:
        pair = step_codes
    else:
        pair = np.repeat(np.arange(num_eps, dtype=np.int64) * num_codes, lengths)
        pair += step_codes
    if num_steps > _RUN_FILTER_MIN:
        # Only the first step of each run of equal (pair, cumulative reward) can be a pair's
        # best (a later step of the run ties with it at a later step): reduce over those.
        run_start = np.empty(num_steps, dtype=bool)
        run_start[0] = True
        np.not_equal(pair[1:], pair[:-1], out=run_start[1:])
        run_start[1:] |= cumulative[1:] != cumulative[:-1]
        kept = np.flatnonzero(run_start)
        kept_bins, kept_cum = pair[kept], cumulative[kept]
    else:
        kept, kept_bins, kept_cum = np.arange(num_steps), pair, cumulative
    total = num_eps * num_codes
    select: np.ndarray | None
    if single:  # pairs are the cells
        bins, nbins, present, select = pair, num_codes, codes, codes
    elif total <= _dense_limit(num_steps):
        bins, nbins = pair, total
        present = np.flatnonzero(np.bincount(kept_bins, minlength=total))
        select = present
    else:
        present, bins = np.unique(pair, return_inverse=True)
        bins = bins.reshape(-1)
        kept_bins = bins[kept]
        nbins, select = present.shape[0], None
    best = np.full(nbins, -np.inf)
    np.maximum.at(best, kept_bins, kept_cum)
    hit = kept_cum == best[kept_bins]
    best_index = np.full(nbins, num_steps, dtype=np.int64)
    np.minimum.at(best_index, kept_bins[hit], kept[hit])
    if select is not None:
        best_index = best_index[select]
    if single:
        pair_ep = np.zeros(num_cells, dtype=np.int64)
        pair_cell = cell_order = np.arange(num_cells, dtype=np.int64)
        best_step = best_index
    else:
        pair_ep, pair_code = np.divmod(present, num_codes)
        if num_cells == num_codes:
            pair_cell = pair_code
        else:
            cell_of_code = np.empty(num_codes, dtype=np.int64)
            cell_of_code[codes] = np.arange(num_cells, dtype=np.int64)
            pair_cell = cell_of_code[pair_code]
        if num_cells < (1 << 16):
            cell_order = np.argsort(pair_cell.astype(np.uint16), kind="stable")
        else:
            cell_order = np.argsort(pair_cell, kind="stable")
        best_step = best_index - offsets[pair_ep]
    return BatchCells(
        lengths=lengths,
        offsets=offsets,
        keys=keys,
        key_ids=key_bytes(keys).tolist(),
        visits=visits,
        codes=codes,
        step_codes=step_codes,
        num_codes=num_codes,
        pair_ep=pair_ep,
        pair_cell=pair_cell,
        pair_best_step=best_step,
        pair_best_return=cumulative[best_index],
        cell_order=cell_order,
        pair_bins=bins,
        pair_nbins=nbins,
        pair_select=select,
    )


def discount_exponents(offsets: np.ndarray) -> np.ndarray:
    """(S,) int64 ``k`` of every step: steps before its episode's last step (last step: 0)."""
    num_steps = int(offsets[-1])
    if offsets.shape[0] == 2:
        return np.arange(num_steps - 1, -1, -1, dtype=np.int64)
    lengths = np.diff(offsets)
    exponents = np.repeat(offsets[1:] - 1, lengths)
    exponents -= np.arange(num_steps, dtype=np.int64)
    return exponents
