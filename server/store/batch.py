"""Grouping a batch of episodes by cell, vectorised over the whole batch.

The input is the concatenation of the batch's episodes (in recording order): the cell-key
columns and the cumulative reward (float64, restarting at each episode) of every step, plus the
episodes' lengths. Everything here depends on the episodes only, never on the store's state, so
it runs before the store's lock is taken; :meth:`CellArchive.apply_batch` then folds the result
into the archive under the lock, as if the episodes had been recorded one by one.

A (episode, cell) "pair" is one cell as visited by one episode; its best step is the step with
the highest cumulative reward in that cell, the earliest on a tie.

Each step's key becomes a cell "code": a dense mixed-radix number when the keys span a small
range (the usual case: positions on a grid), else a rank from np.unique. The pairs, their best
steps and their discounted sums then come from single passes over the steps (kernels.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import kernels
from .cells import key_bytes

# Dense bincount-based grouping is used while the number of bins is at most
# max(_DENSE_FACTOR * steps, _DENSE_MIN); beyond that, np.unique (a sort) is cheaper.
_DENSE_MIN = 1 << 16
_DENSE_FACTOR = 4
_CODE_LIMIT = 1 << 62


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
    visits: np.ndarray
    """(U,) int64 steps spent in each cell over the batch."""
    codes: np.ndarray
    """(U,) code of each distinct cell."""
    step_codes: np.ndarray | None
    """(S,) int64 code of each step's cell (None when ``pair_discounted`` is given)."""
    num_codes: int
    first_step: np.ndarray
    """(num_codes,) index of the first step with each code (S for codes no step has)."""
    pair_ep: np.ndarray
    """(P,) episode of each pair; pairs are ordered by (episode, cell)."""
    pair_cell: np.ndarray
    """(P,) cell (index into ``keys``) of each pair."""
    pair_code: np.ndarray
    """(P,) code of each pair's cell."""
    episode_pairs: np.ndarray
    """(E+1,) episode e owns pairs episode_pairs[e]..episode_pairs[e+1]-1."""
    pair_best_step: np.ndarray
    """(P,) 0-based step within the episode: highest cumulative reward, earliest on a tie."""
    pair_best_return: np.ndarray
    """(P,) float64 cumulative reward at that step."""
    pair_discounted: np.ndarray | None = None
    """(U, P) :meth:`discounted_sums` of every utility, when computed with the grouping."""

    @property
    def num_episodes(self) -> int:
        return int(self.lengths.shape[0])

    @functools.cached_property
    def key_ids(self) -> list[bytes]:
        """The keys as bytes (the archive index's dict keys), made on first use."""
        return key_bytes(self.keys).tolist()

    def discounted_sums(self, utility: int, powers: np.ndarray) -> np.ndarray:
        """(P,) per-pair sums of ``powers[k]`` over the pair's steps, ``k`` the steps before
        the episode's last step, each accumulated in step order from 0.0 (bit-identical to a
        per-episode ``np.bincount(inverse, powers[k])``). ``powers``: float64, at least as
        long as the longest episode, of utility number ``utility``."""
        if self.pair_discounted is not None:
            return self.pair_discounted[utility]
        return kernels.discounted_pair_sums(
            self.step_codes,
            self.offsets,
            self.episode_pairs,
            self.pair_code,
            powers,
            self.num_codes,
        )

    def first_index(self, cells: np.ndarray) -> np.ndarray:
        """Global index (into the concatenation) of the first step in each of ``cells``."""
        return self.first_step[self.codes[cells]]


class Grouping(NamedTuple):
    """A batch's steps grouped by cell, with what the store checks before recording it."""

    cells: BatchCells | None
    """The batch's cells; None when it has no steps or a non-finite cumulative reward."""
    returns: np.ndarray
    """(E,) float64 return of each episode (0.0 for an empty one)."""
    bad: int
    """Index of the first step whose cumulative reward is not finite; -1 when none is."""


def _dense_limit(num_steps: int) -> int:
    return max(_DENSE_FACTOR * num_steps, _DENSE_MIN)


def _code_space(lows: np.ndarray, highs: np.ndarray) -> tuple[list[int], int, list[int]]:
    """``(ranges, total, strides)`` of the mixed-radix code of keys within [lows, highs] per
    field, first field most significant (Python ints: exact for any range)."""
    ranges = [h - lo + 1 for h, lo in zip(highs.tolist(), lows.tolist())]
    total = 1
    for r in ranges:
        total *= r
    strides = [1] * len(ranges)
    for j in range(len(ranges) - 2, -1, -1):
        strides[j] = strides[j + 1] * ranges[j + 1]
    return ranges, total, strides


def _dense_cells(
    counts: np.ndarray, ranges: list[int], lows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes (U,), keys (U, F), visits (U,))`` of the codes some step has, from the
    per-code step counts of a dense code space."""
    codes = np.flatnonzero(counts)
    keys = np.stack(np.unravel_index(codes, ranges), axis=1)
    keys += lows
    return codes, keys, counts[codes]


def _cells_of_pairs(pair_code: np.ndarray, codes: np.ndarray, num_codes: int) -> np.ndarray:
    """The cell (index into the batch's keys) of each pair, from its code."""
    if codes.shape[0] == num_codes:
        return pair_code
    cell_of_code = np.empty(num_codes, dtype=np.int64)
    cell_of_code[codes] = np.arange(codes.shape[0], dtype=np.int64)
    return cell_of_code[pair_code]


def _step_codes(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """Cell codes of the steps from the (F, S) key columns:
    ``(step_codes (S,), keys (U, F), num_codes, codes (U,), visits (U,))``."""
    width = columns.shape[0]
    lows, highs = kernels.key_bounds(columns)
    ranges, total, strides = _code_space(lows, highs)
    if total >= _CODE_LIMIT:
        voids = key_bytes(np.ascontiguousarray(columns.T))
        uniq, inverse, visits = np.unique(voids, return_inverse=True, return_counts=True)
        keys = np.ascontiguousarray(uniq).view(np.int64).reshape(uniq.shape[0], width)
        return inverse.reshape(-1), keys, keys.shape[0], np.arange(keys.shape[0]), visits
    # Each key minus its field's low is in [0, range): the code is exact in int64.
    if total <= _dense_limit(columns.shape[1]):
        code, counts = kernels.dense_codes(columns, lows, np.array(strides, np.int64), total)
        codes, keys, visits = _dense_cells(counts, ranges, lows)
        return code, keys, total, codes, visits
    # Codes too sparse for a dense table: rank them (a sort). Wrapping int64 arithmetic is
    # exact here too, the result being in [0, total).
    code = columns[0] * strides[0] if strides[0] != 1 else columns[0].copy()
    for j in range(1, width):
        code += columns[j] * strides[j] if strides[j] != 1 else columns[j]
    offset = sum(lo * st for lo, st in zip(lows.tolist(), strides, strict=True))
    offset = (offset + (1 << 63)) % (1 << 64) - (1 << 63)  # as the int64 it wraps to
    if offset:
        code -= offset
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
    num_steps = int(offsets[-1])
    if num_steps == 0 or columns.shape[1] != num_steps or cumulative.shape != (num_steps,):
        raise ValueError(
            f"batch: {columns.shape[1]} keys and {cumulative.shape} returns for {num_steps} steps"
        )
    columns = np.ascontiguousarray(columns, dtype=np.int64)
    step_codes, keys, num_codes, codes, visits = _step_codes(columns)
    step_codes = step_codes.astype(np.int64, copy=False)
    offsets = offsets.astype(np.int64, copy=False)
    pairs = kernels.group_pairs(
        step_codes, cumulative.astype(np.float64, copy=False), offsets, num_codes
    )
    return _batch_cells(lengths, offsets, keys, visits, codes, num_codes, step_codes, pairs)


def group_columns(
    cumulative: np.ndarray,
    columns: Callable[[], np.ndarray],
    lengths: np.ndarray,
    offsets: np.ndarray,
) -> Grouping:
    """:func:`group_batch` with each episode's return, from the steps' (S,) float64
    cumulative rewards (restarting at each episode) and a callable for their (F, S) key
    columns, called only when there are steps and every cumulative reward is finite."""
    ends = offsets[1:]
    returns = np.zeros(lengths.shape[0], dtype=np.float64)
    nonempty = ends > offsets[:-1]
    returns[nonempty] = cumulative[ends[nonempty] - 1]
    if not cumulative.size:
        return Grouping(None, returns, -1)
    finite = np.isfinite(cumulative)
    if not finite.all():
        return Grouping(None, returns, int(np.argmin(finite)))
    return Grouping(group_batch(columns(), cumulative, lengths, offsets), returns, -1)


def _batch_cells(
    lengths: np.ndarray,
    offsets: np.ndarray,
    keys: np.ndarray,
    visits: np.ndarray,
    codes: np.ndarray,
    num_codes: int,
    step_codes: np.ndarray | None,
    pairs: tuple,
    discounted: np.ndarray | None = None,
) -> BatchCells:
    """BatchCells from the cells and a grouping kernel's ``(pair_ep, pair_code, best_index,
    best_return, first_step, episode_pairs)``."""
    pair_ep, pair_code, best_index, best_return, first_step, episode_pairs = pairs
    return BatchCells(
        lengths=lengths,
        offsets=offsets,
        keys=keys,
        visits=visits,
        codes=codes,
        step_codes=step_codes,
        num_codes=num_codes,
        first_step=first_step,
        pair_ep=pair_ep,
        pair_cell=_cells_of_pairs(pair_code, codes, num_codes),
        pair_code=pair_code,
        episode_pairs=episode_pairs,
        pair_best_step=best_index - offsets[pair_ep],
        pair_best_return=best_return,
        pair_discounted=discounted,
    )


def group_window(
    ring: np.ndarray,
    reward_ring: np.ndarray,
    env: np.ndarray,
    start: np.ndarray,
    lengths: np.ndarray,
    offsets: np.ndarray,
    powers: np.ndarray,
) -> Grouping | None:
    """:func:`group_columns` (with every utility's discounted sums for the (U, L) ``powers``)
    for episodes read in place from rings (a :class:`sources.EpisodeWindow`'s fields: episode
    i is environment ``env[i]``'s steps from ``start[i]``, time t at ring column
    ``t % capacity``), in one compiled pass; None when the keys' code space is too wide for a
    dense table (group the copied-out steps then)."""
    num_steps = int(offsets[-1])
    if num_steps == 0:
        return Grouping(None, np.zeros(lengths.shape[0], dtype=np.float64), -1)
    capacity = int(ring.shape[2])
    lows, highs = kernels.window_bounds(ring, env, start, lengths, capacity)
    ranges, total, strides = _code_space(lows, highs)
    if total > _dense_limit(num_steps):
        return None
    *pairs, counts, returns, bad, sums = kernels.window_pairs(
        ring,
        reward_ring,
        capacity,
        env,
        start,
        offsets,
        lows,
        np.array(strides, dtype=np.int64),
        total,
        powers,
    )
    if bad >= 0:
        return Grouping(None, returns, int(bad))
    codes, keys, visits = _dense_cells(counts, ranges, lows)
    cells = _batch_cells(
        lengths, offsets, keys, visits, codes, total, None, tuple(pairs), discounted=sums
    )
    return Grouping(cells, returns, -1)
