"""A synthetic vectorised environment for the demo, the benchmarks and the compose trainers.

N environments step together and return (T, N) chunks shaped like a real
collection call: int32 actions in [0, 12), sparse float32 rewards, done flags
that end episodes of random length, and two state fields: `player_positions`
(a random walk on a 64x64 grid, (T, N, 1, 2) int32) and `player_inventory`
(slowly increasing counts, (T, N, 1, 16) int32). With `frame_size=F`, a third state field
`frames` (T, N, F, F) uint8 draws each step as a pixel observation (F=84: the usual Atari
size): a per-environment map of grey tiles, the player as a white square at its position, and
an inventory bar along the top row. Frames are drawn from the other fields, so the random
stream, and every other array, is the same with or without them. `position_store`: a trajectory
store configuration over the positions, shared by the benchmarks and the cluster tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID = 64
NUM_ACTIONS = 12
NUM_ITEMS = 16
FRAME_TILES = 7  # grey tiles per side of a frame's background map


@dataclass
class Rollout:
    action: np.ndarray
    reward: np.ndarray
    done: np.ndarray


@dataclass
class EnvStates:
    player_positions: np.ndarray
    player_inventory: np.ndarray
    frames: np.ndarray | None = None  # (T, N, F, F) uint8 with `frame_size=F`


class SyntheticVecEnv:
    """`collect(T)` returns (Rollout, EnvStates) for T steps of N environments."""

    def __init__(
        self,
        num_envs: int,
        *,
        seed: int = 0,
        done_prob: float = 1 / 500,
        reward_prob: float = 0.02,
        frame_size: int | None = None,
    ) -> None:
        if frame_size is not None and frame_size < FRAME_TILES:
            raise ValueError(f"frame_size must be >= {FRAME_TILES} pixels, got {frame_size}")
        self.num_envs = num_envs
        self.done_prob = done_prob
        self.reward_prob = reward_prob
        self.frame_size = frame_size
        self.rng = np.random.default_rng(seed)
        self.pos = self.rng.integers(0, GRID, (num_envs, 1, 2), dtype=np.int32)
        self.inv = np.zeros((num_envs, 1, NUM_ITEMS), dtype=np.int32)
        self._background = None if frame_size is None else _backgrounds(num_envs, frame_size, seed)

    @property
    def state_fields(self) -> list[str]:
        """The names of the state fields `collect` fills."""
        names = ["player_positions", "player_inventory"]
        return names if self.frame_size is None else [*names, "frames"]

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
        frames = None if self._background is None else _draw(self._background, positions, inventory)
        return Rollout(action, reward, done), EnvStates(positions, inventory, frames)


def _backgrounds(num_envs: int, size: int, seed: int) -> np.ndarray:
    """(N, F, F) uint8: each environment's map, FRAME_TILES x FRAME_TILES tiles of 6 greys.

    From a generator of its own, so that frames leave the environment's random stream alone.
    """
    rng = np.random.default_rng([seed, size])
    tile = -(-size // FRAME_TILES)
    greys = rng.integers(0, 6, (num_envs, FRAME_TILES, FRAME_TILES), dtype=np.uint8) * 32
    return np.repeat(np.repeat(greys, tile, axis=1), tile, axis=2)[:, :size, :size].copy()


def _draw(background: np.ndarray, positions: np.ndarray, inventory: np.ndarray) -> np.ndarray:
    """(T, N, F, F) uint8 frames: the map, the player as a white square, an inventory bar."""
    length, n = positions.shape[:2]
    size = background.shape[-1]
    frames = np.empty((length, n, size, size), dtype=np.uint8)
    frames[:] = background[None]
    t = np.arange(length)[:, None]
    e = np.arange(n)[None, :]
    side = max(1, size // 21)  # 4 pixels at 84
    rows = positions[:, :, 0, 0] * size // GRID
    cols = positions[:, :, 0, 1] * size // GRID
    for dy in range(side):
        for dx in range(side):
            frames[t, e, np.minimum(rows + dy, size - 1), np.minimum(cols + dx, size - 1)] = 255
    width = np.minimum(inventory.sum(axis=(2, 3)), size)
    bar = np.arange(size)[None, None, :] < width[:, :, None]
    frames[:, :, 0, :] = np.where(bar, 200, frames[:, :, 0, :])
    return frames


def position_store(gamma: float):
    """A trajectory store configuration over ``player_positions``: cells of 4x4 grid squares
    (x, y), one ``win_proximity`` utility discounted by ``gamma``, each episode won or lost by
    its return's sign."""
    from recorder_client import (
        CellField,
        OutcomeRule,
        TrajectoryTrainingConfiguration,
        UtilityConfig,
    )

    return TrajectoryTrainingConfiguration(
        cell_fields=(
            CellField("player_positions", (0, 0), bucket=4, name="x"),
            CellField("player_positions", (0, 1), bucket=4, name="y"),
        ),
        utilities=(UtilityConfig("win_proximity", gamma=gamma),),
        outcome_rule=OutcomeRule("reward_sign"),
    )
