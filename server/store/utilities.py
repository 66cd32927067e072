"""Per-cell utilities back-propagated from episode outcomes.

For utility u with discount gamma, a step k steps before the episode's end (the last step has
k = 0) adds ``gamma**k * sign(outcome)`` to its cell's sum, where sign is +1 for an outcome in
``positive_outcomes``, -1 for ``negative_outcomes`` and 0 otherwise. Every step also counts one
visit (in the archive), so a cell's net value is ``sum / visits``.
"""

from __future__ import annotations

import numpy as np

from recorder_client.capture_types import UtilityConfig

from . import kernels


class UtilityTable:
    """A (num_utilities, capacity) float64 array of sums, grown alongside the archive."""

    def __init__(self, configs: tuple[UtilityConfig, ...], capacity: int = 1024) -> None:
        self.configs = configs
        self.names = tuple(c.name for c in configs)
        self.sums = np.zeros((len(configs), capacity), dtype=np.float64)

    def _grow(self, needed: int) -> None:
        if needed > self.sums.shape[1]:
            sums = np.zeros((len(self.configs), max(needed, 2 * self.sums.shape[1])))
            sums[:, : self.sums.shape[1]] = self.sums
            self.sums = sums

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(
                f"utility_key: unknown utility {name!r}; configured utilities are "
                f"{list(self.names)}"
            ) from None

    def apply_batch(
        self,
        cell_ids: np.ndarray,
        pair_ep: np.ndarray,
        pair_cell: np.ndarray,
        pair_sums: list[np.ndarray | None],
        signs: list[np.ndarray | None],
        num_cells: int,
    ) -> None:
        """Add each (episode, cell) pair's discounted outcome (``pair_sums[u]``: the pair's
        sum of ``gamma**k``, times the episode's sign) to its cell's sum. Pairs come in episode
        order and are added one after the other, exactly as one episode at a time would."""
        self._grow(num_cells)
        for u, (sums, sign) in enumerate(zip(pair_sums, signs, strict=True)):
            if sums is None or sign is None:
                continue
            # "+ 0.0" turns a -0.0 (sign -1 times an all-zero sum) into the 0.0 that summing
            # the per-step products from 0.0 gives.
            kernels.add_pair_sums(self.sums[u], cell_ids, pair_ep, pair_cell, sums, sign)

    def state_arrays(self, num_cells: int) -> dict[str, np.ndarray]:
        return {
            f"utility/{name}": self.sums[u, :num_cells].copy() for u, name in enumerate(self.names)
        }

    def load_state_arrays(self, arrays: dict[str, np.ndarray], num_cells: int) -> list[str]:
        """Load sums by utility name; returns the configured names absent from ``arrays``."""
        self._grow(num_cells)
        self.sums[:] = 0.0
        missing = []
        for u, name in enumerate(self.names):
            col = arrays.get(f"utility/{name}")
            if col is None:
                missing.append(name)
                continue
            if col.shape != (num_cells,):
                raise ValueError(f"utility {name!r}: shape {col.shape}, expected ({num_cells},)")
            self.sums[u, :num_cells] = col
        return missing


def aggregate(
    keys: np.ndarray, sums: np.ndarray, visits: np.ndarray, *, distinct: bool = False
) -> dict[tuple[int, ...], float]:
    """``{key: total sum / total visits}`` over the rows sharing each (projected) key.

    ``distinct=True`` promises the rows of ``keys`` are already distinct (no merging needed).
    """
    if keys.shape[0] == 0:
        return {}
    if keys.shape[1] == 0:
        return {(): float(sums.sum() / visits.sum())}
    if distinct:
        values = sums / visits
        return dict(zip(map(tuple, keys.tolist()), values.tolist(), strict=True))
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    total = np.bincount(inverse, weights=sums, minlength=uniq.shape[0])
    count = np.bincount(inverse, weights=visits, minlength=uniq.shape[0])
    return dict(zip(map(tuple, uniq.tolist()), (total / count).tolist(), strict=True))
