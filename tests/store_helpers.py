"""Small builders shared by the trajectory-store tests."""

from __future__ import annotations

import numpy as np

from recorder_client.capture_types import EpisodeOutcome
from recorder_server.store import EpisodeArrays

WIN, LOSS, DRAW = EpisodeOutcome.WIN, EpisodeOutcome.LOSS, EpisodeOutcome.DRAW


def episode(pos, rewards=None) -> EpisodeArrays:
    """An episode over the scalar state field ``pos`` (one cell per distinct value)."""
    pos = np.asarray(pos, dtype=np.int32)
    rewards = np.zeros(len(pos)) if rewards is None else rewards
    return EpisodeArrays(
        actions=np.arange(len(pos), dtype=np.int32) + 10,
        rewards=np.asarray(rewards, dtype=np.float32),
        states={"pos": pos},
    )
