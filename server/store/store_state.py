"""StoreState: the trajectory store's archive, repository, curriculum and utilities behind one
lock, and the queries that only read them (TrajectoryStore, in store.py, adds the writes).

Readers never see a half-applied episode: every method that reads more than one field copies
what it needs under the lock and builds its (fresh, plain) result after releasing it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from recorder_client.capture_types import (
    EpisodeOutcome,
    TrajectoryKey,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
)

from . import curriculum as curriculum_mod
from . import kernels
from .archive import CellArchive
from .curriculum import Curriculum
from .repository import TrajectoryRepository, decode_episode
from .results import CellInfo
from .sources import EpisodeArrays
from .utilities import UtilityTable, aggregate


class StoreState:
    """The store's state under its lock, and its read-only queries."""

    def __init__(self, configuration: TrajectoryTrainingConfiguration, *, seed: int | None = None):
        if not isinstance(configuration, TrajectoryTrainingConfiguration):
            raise ValueError(
                f"configuration: expected a TrajectoryTrainingConfiguration, got {configuration!r}"
            )
        self._config = configuration
        self._lock = threading.Lock()
        self._archive = CellArchive(len(configuration.cell_fields))
        self._repository = TrajectoryRepository(configuration.repository_capacity_bytes)
        self._utilities = UtilityTable(configuration.utilities)
        self._curriculum = Curriculum(configuration.selection_power, seed)
        self._pending: OrderedDict[tuple[int, int], TrajectoryKey] = OrderedDict()
        self._counters = {"episodes": 0, "steps": 0, "last_new_cells": 0, "last_improved": 0}
        # Per utility: the sign of each outcome code; gamma -> cached gamma ** k table.
        self._sign_tables = [[u.sign(o) for o in EpisodeOutcome] for u in configuration.utilities]
        self._power_tables: dict[float, np.ndarray] = {}
        # (monotonic time, values) of the per-cell gauges last computed (see metrics()).
        self._gauges: tuple[float, dict[str, float]] | None = None
        kernels.warm_up()

    # -- configuration -------------------------------------------------------------------------

    @property
    def configuration(self) -> TrajectoryTrainingConfiguration:
        return self._config

    @property
    def key_names(self) -> tuple[str, ...]:
        """Names of the cell-key fields, in key order."""
        return self._config.key_names

    @property
    def utility_names(self) -> tuple[str, ...]:
        return self._utilities.names

    def __len__(self) -> int:
        """Number of cells in the archive."""
        return len(self._archive)

    # -- reading -------------------------------------------------------------------------------

    def _field_columns(self, field_names: Any) -> list[int]:
        names = self.key_names
        if isinstance(field_names, str):
            raise ValueError(
                f"field_names: expected a list of names, got the string {field_names!r}"
            )
        cols = []
        for f in field_names:
            if f not in names:
                raise ValueError(
                    f"field_names: unknown field {f!r}; cell key fields are {list(names)}"
                )
            if names.index(f) in cols:
                raise ValueError(f"field_names: field {f!r} given twice")
            cols.append(names.index(f))
        return cols

    def snapshot_potential(
        self, utility_key: str, field_names: list[str]
    ) -> dict[tuple[int, ...], float]:
        """``{(values of field_names): net value}`` as a fresh dict; fields left out are merged
        (total sum / total visits over the merged cells)."""
        u = self._utilities.index(utility_key)
        cols = self._field_columns(field_names)
        with self._lock:
            n = len(self._archive)
            keys = self._archive.keys[:n][:, cols]
            sums = self._utilities.sums[u, :n].copy()
            visits = self._archive.view("visits").astype(np.float64)
        distinct = sorted(cols) == list(range(len(self.key_names)))
        return aggregate(keys, sums, visits, distinct=distinct)

    def start_probabilities(self) -> dict[TrajectoryKey, float]:
        """The current start distribution ``{cell key: probability}``."""
        with self._lock:
            keys = self._archive.view("keys").copy()
            times = self._archive.view("times_chosen").copy()
        if not len(times):
            return {}
        w = curriculum_mod.start_weights(times, self._config.selection_power)
        return dict(zip(map(tuple, keys.tolist()), (w / w.sum()).tolist(), strict=True))

    def midpoint_start_counts(self) -> dict[TrajectoryKey, int]:
        with self._lock:
            return dict(self._curriculum.midpoint_counts)

    def cell(self, key: TrajectoryKey) -> CellInfo | None:
        """A copy of one cell's entry, or None when the archive lacks it."""
        key = tuple(int(k) for k in key)
        with self._lock:
            i = self._archive.lookup(key)
            if i is None:
                return None
            col = {name: self._archive.view(name)[i].item() for name in self._archive.cols}
            mid = self._curriculum.midpoint_counts.get(key, 0)
        return CellInfo(
            key=key,
            visits=col["visits"],
            first_seen_step=col["first_seen_step"],
            first_seen_offset=col["first_seen_offset"],
            times_chosen=col["times_chosen"],
            best_reference=TrajectorySliceReference(col["best_trajectory"], col["best_step"]),
            best_return=col["best_return"],
            midpoint_starts=mid,
        )

    def archive_columns(self) -> dict[str, np.ndarray]:
        """Copies of the archive, one row per cell in first-seen order, taken under one lock:
        ``keys`` (N, F), the per-cell columns (``visits``, ``times_chosen``,
        ``first_seen_step``, ``best_trajectory``, ``best_step``, ``best_return``...),
        ``utility/<name>`` sums, and ``midpoint_starts``."""
        with self._lock:
            n = len(self._archive)
            out = self._archive.state_arrays()
            out.update(self._utilities.state_arrays(n))
            keys = out["keys"]
            counts = self._curriculum.midpoint_counts
            mid = [counts.get(k, 0) for k in map(tuple, keys.tolist())] if counts else []
        out["midpoint_starts"] = np.array(mid, dtype=np.int64) if mid else np.zeros(n, np.int64)
        return out

    def cell_keys(self) -> list[TrajectoryKey]:
        """Every cell key, in first-seen order."""
        with self._lock:
            return list(map(tuple, self._archive.view("keys").tolist()))

    def trajectory(self, trajectory_id: int) -> EpisodeArrays | None:
        """A stored trajectory decoded, or None when not (or no longer) stored."""
        with self._lock:
            blob = self._repository.blob(trajectory_id)
        return None if blob is None else decode_episode(blob)

    def trajectory_ids(self) -> list[int]:
        with self._lock:
            return self._repository.ids()
