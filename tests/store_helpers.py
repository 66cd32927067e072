"""Small builders shared by the trajectory-store tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from recorder_client.capture_types import EpisodeOutcome
from recorder_server.store import (
    EpisodeArrays,
    EpisodeBatch,
    EpisodeColumns,
    EpisodeSource,
    EpisodeWindow,
    TrajectoryStore,
)
from recorder_server.store.repository import episode_bound

WIN, LOSS, DRAW = EpisodeOutcome.WIN, EpisodeOutcome.LOSS, EpisodeOutcome.DRAW
FORMS = ("list", "batch", "columns", "window")
# The archive's per-cell statistics, written out here (not read from the client) so a column
# the code loses fails the tests.
CELL_STATS = (
    "visits",
    "times_chosen",
    "first_seen_step",
    "best_return",
    "best_length",
    "best_trajectory_id",
    "best_step",
    "midpoint_starts",
)


def episode(pos, rewards=None) -> EpisodeArrays:
    """An episode over the scalar state field ``pos`` (one cell per distinct value)."""
    pos = np.asarray(pos, dtype=np.int32)
    rewards = np.zeros(len(pos)) if rewards is None else rewards
    return EpisodeArrays(
        actions=np.arange(len(pos), dtype=np.int32) + 10,
        rewards=np.asarray(rewards, dtype=np.float32),
        states={"pos": pos},
    )


class HeldEpisode:
    """A repository.DeferredEpisode over an episode held in memory; counts its fetches."""

    def __init__(self, episode: EpisodeArrays, group: object, first: int, fetches: list) -> None:
        self.episode, self.group, self.first, self.fetches = episode, group, first, fetches
        self.length = episode.length
        self.bound = episode_bound(episode)

    def fetch(self, cache: dict) -> EpisodeArrays:
        self.fetches.append(self.first)
        return self.episode


def as_form(
    form: str, episodes: list[EpisodeArrays], store: TrajectoryStore, fetches: list | None = None
) -> EpisodeSource | list[EpisodeArrays]:
    """The episodes as the given form: a plain list, an EpisodeBatch, an EpisodeColumns, or an
    EpisodeWindow (one ring row per episode, its steps wrapping around the ring's end; window
    rewards must share one float dtype). ``fetches`` collects the episodes fetched."""
    fetches = [] if fetches is None else fetches
    if form == "list":
        return list(episodes)
    if form == "batch":
        return EpisodeBatch.from_episodes(episodes)
    columns = [store.step_columns(e.states, e.length) for e in episodes]
    lengths = np.array([e.length for e in episodes], dtype=np.int64)
    if form == "columns":

        def fetch(i: int) -> EpisodeArrays:
            fetches.append(i)
            return episodes[i]

        return EpisodeColumns(
            np.concatenate([e.rewards for e in episodes]),
            np.concatenate(columns, axis=1),
            lengths,
            fetch,
        )
    assert form == "window", form
    (reward_type,) = {e.rewards.dtype for e in episodes}
    capacity = max(int(lengths.max(initial=0)), 1)
    key_ring = np.full((len(store.key_names), len(episodes), capacity), -7, dtype=np.int64)
    reward_ring = np.full((len(episodes), capacity), np.nan, dtype=reward_type)
    start = np.arange(len(episodes), dtype=np.int64) * 3 + 5
    for i, (e, c) in enumerate(zip(episodes, columns, strict=True)):
        at = (start[i] + np.arange(e.length)) % capacity
        key_ring[:, i, at] = c
        reward_ring[i, at] = e.rewards
    held = [HeldEpisode(e, episodes, i, fetches) for i, e in enumerate(episodes)]
    env = np.arange(len(episodes), dtype=np.int64)
    return EpisodeWindow(key_ring, reward_ring, env, start, lengths, held.__getitem__)


def store_merge(files: list[Path], out: Path, sources: list[str], timeout: float) -> str:
    """`rollout-recorder store merge` of ``files`` into ``out``, the i-th file labelled
    ``sources[i]``; its stdout."""
    labels = [arg for name in sources for arg in ("--source", name)]
    done = subprocess.run(
        [sys.executable, "-m", "recorder_server", "store", "merge", *map(str, files)]
        + ["-o", str(out), *labels],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
