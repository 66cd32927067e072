"""What the trajectory store hands back: per-episode records, batch results, cell copies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recorder_client.capture_types import EpisodeOutcome, TrajectoryKey, TrajectorySliceReference

_OUTCOMES = tuple(EpisodeOutcome(i) for i in range(len(EpisodeOutcome)))


@dataclass(frozen=True)
class EpisodeRecord:
    """What the store did with one episode."""

    trajectory_id: int
    """The id the episode got (ids advance for every episode, stored or not)."""
    stored: bool
    """Whether the repository kept it (it became some cell's best reference)."""
    outcome: EpisodeOutcome
    """The outcome recorded, after the configured rule."""
    new_cells: int
    """Cells first seen in this episode."""
    improved_cells: int
    """Cells whose best reference moved to this episode (new cells included)."""


@dataclass(frozen=True, eq=False)
class BatchResult:
    """What the store did with a batch of episodes, one entry per episode, in order."""

    first_trajectory_id: int
    """The id of the batch's first episode; episode i got ``first_trajectory_id + i``."""
    codes: np.ndarray
    """(E,) int64 outcome codes recorded, after the configured rule."""
    new_cells: np.ndarray
    """(E,) int64 cells first seen in each episode."""
    improved_cells: np.ndarray
    """(E,) int64 cells whose best reference moved to each episode (new cells included); an
    episode was stored exactly when its count is non-zero."""

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def records(self) -> list[EpisodeRecord]:
        """One EpisodeRecord per episode."""
        first = self.first_trajectory_id
        return [
            EpisodeRecord(first + i, n > 0, _OUTCOMES[o], k, n)
            for i, (o, k, n) in enumerate(
                zip(
                    self.codes.tolist(),
                    self.new_cells.tolist(),
                    self.improved_cells.tolist(),
                    strict=True,
                )
            )
        ]


@dataclass(frozen=True)
class CellInfo:
    """A copy of one cell's archive entry."""

    key: TrajectoryKey
    visits: int
    """Steps spent in the cell over all recorded episodes."""
    first_seen_step: int
    """The ``step`` passed to record_episode for the episode that first reached the cell."""
    first_seen_offset: int
    """The 0-based step within that episode at which it first reached the cell."""
    times_chosen: int
    """Times sample_start chose the cell."""
    best_reference: TrajectorySliceReference
    best_return: float
    """Cumulative reward (float64) of the best reference, up to and including its step."""
    midpoint_starts: int
    """Episodes recorded with a start_reference into this cell."""
