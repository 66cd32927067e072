"""A synthetic vectorised environment for the demo, the benchmarks and the compose trainers.

N environments step together and return (T, N) chunks shaped like a real
collection call: int32 actions in [0, 12), sparse float32 rewards, done flags
that end episodes of random length, and two state fields: `player_positions`
(a random walk on a 64x64 grid, (T, N, 1, 2) int32) and `player_inventory`
(slowly increasing counts, (T, N, 1, 16) int32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID = 64
NUM_ACTIONS = 12
NUM_ITEMS = 16


@dataclass
class Rollout:
    action: np.ndarray
    reward: np.ndarray
    done: np.ndarray


@dataclass
class EnvStates:
    player_positions: np.ndarray
    player_inventory: np.ndarray


class SyntheticVecEnv:
    """`collect(T)` returns (Rollout, EnvStates) for T steps of N environments."""

    def __init__(
        self,
        num_envs: int,
        *,
        seed: int = 0,
        done_prob: float = 1 / 500,
        reward_prob: float = 0.02,
    ) -> None:
        self.num_envs = num_envs
        self.done_prob = done_prob
        self.reward_prob = reward_prob
        self.rng = np.random.default_rng(seed)
        self.pos = self.rng.integers(0, GRID, (num_envs, 1, 2), dtype=np.int32)
        self.inv = np.zeros((num_envs, 1, NUM_ITEMS), dtype=np.int32)

    def collect(self, length: int) -> tuple[Rollout, EnvStates]:
        n, rng = self.num_envs, self.rng
        action = rng.integers(0, NUM_ACTIONS, (length, n), dtype=np.int32)
        hit = rng.random((length, n)) < self.reward_prob
        reward = np.where(hit, rng.standard_normal((length, n)), 0).astype(np.float32)
        done = rng.random((length, n)) < self.done_prob
        steps = rng.integers(-1, 2, (length, n, 1, 2), dtype=np.int32)
        positions = np.empty((length, n, 1, 2), dtype=np.int32)
        gains = (rng.random((length, n, 1, NUM_ITEMS)) < 0.01).astype(np.int32)
        inventory = np.empty((length, n, 1, NUM_ITEMS), dtype=np.int32)
        pos, inv = self.pos, self.inv
        for t in range(length):
            pos = np.clip(pos + steps[t], 0, GRID - 1)
            inv = inv + gains[t]
            positions[t], inventory[t] = pos, inv
            ended = done[t]
            if ended.any():  # a finished episode restarts from a fresh state
                pos = pos.copy()
                inv = inv.copy()
                pos[ended] = rng.integers(0, GRID, (int(ended.sum()), 1, 2), dtype=np.int32)
                inv[ended] = 0
        self.pos, self.inv = pos, inv
        return Rollout(action, reward, done), EnvStates(positions, inventory)
