"""The benchmark workload: (T, N) chunks shaped like a real collection call, made fast.

Same distributions as `recorder_server.workload.SyntheticVecEnv` (int32 actions
in [0, 12), float32 rewards non-zero with probability 2%, done flags with a given
probability, `player_positions` (T, N, 1, 2) int32 a random walk on a 64x64 grid,
`player_inventory` (T, N, 1, 16) int32 slowly increasing counts that restart at
0 after a done), but generated without a Python loop over time: the walk is a
cumulative sum folded back into the grid (a reflecting boundary instead of a
clipping one), and the per-episode restart is a gather at each step's episode
start. One chunk at T=128, N=256 is 2,654,208 raw bytes.

Workers pre-generate a `pool` of distinct chunks before the clock starts and
reuse them cyclically, so generation cost is never measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID = 64
NUM_ACTIONS = 12
NUM_ITEMS = 16
REWARD_PROB = 0.02
ITEM_GAIN_PROB = 0.01
STATE_FIELDS = ("player_positions", "player_inventory")


def store_configuration():
    """The store rows' configuration: 2 cell fields (positions, bucket 4) and 1 utility,
    fed by every episode: the reward-sign rule turns each return into a win or a loss."""
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
        utilities=(UtilityConfig("win_proximity", gamma=0.99),),
        outcome_rule=OutcomeRule("reward_sign"),
    )


@dataclass
class Rollout:
    """What `collect_fn` returns as `trajectories` (attribute access, like a flax struct)."""

    action: np.ndarray
    reward: np.ndarray
    done: np.ndarray


@dataclass
class EnvStates:
    player_positions: np.ndarray
    player_inventory: np.ndarray


@dataclass
class Chunk:
    rollout: Rollout
    states: EnvStates

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "action": self.rollout.action,
            "reward": self.rollout.reward,
            "done": self.rollout.done,
            "player_positions": self.states.player_positions,
            "player_inventory": self.states.player_inventory,
        }

    @property
    def raw_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def as_dicts(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        a = self.arrays
        traj = {k: a[k] for k in ("action", "reward", "done")}
        states = {k: a[k] for k in STATE_FIELDS}
        return traj, states

    def to_bytes(self) -> bytes:
        """The uncompressed bytes of every array, back to back (the raw-gRPC payload)."""
        return b"".join(memoryview(np.ascontiguousarray(a)).cast("B") for a in self.arrays.values())


class ChunkGenerator:
    """Consecutive chunks of N environments; episodes continue across chunks."""

    def __init__(self, num_envs: int, *, seed: int = 0, done_prob: float = 1 / 500) -> None:
        self.num_envs = num_envs
        self.done_prob = done_prob
        self.rng = np.random.default_rng(seed)
        self.pos = self.rng.integers(0, GRID, (num_envs, 2), dtype=np.int32)
        self.inv = np.zeros((num_envs, NUM_ITEMS), dtype=np.int32)

    def chunk(self, length: int) -> Chunk:
        t_len, n, rng = length, self.num_envs, self.rng
        action = rng.integers(0, NUM_ACTIONS, (t_len, n), dtype=np.int32)
        hit = rng.random((t_len, n), dtype=np.float32) < REWARD_PROB
        reward = np.zeros((t_len, n), dtype=np.float32)
        reward[hit] = rng.standard_normal(int(hit.sum()), dtype=np.float32)
        done = rng.random((t_len, n), dtype=np.float32) < self.done_prob

        # seg[t, e]: the step at which env e's episode containing step t began in
        # this chunk (0 when it began in an earlier chunk).
        mark = np.zeros((t_len, n), dtype=np.int64)
        mark[1:] = np.where(done[:-1], np.arange(1, t_len, dtype=np.int64)[:, None], 0)
        seg = np.maximum.accumulate(mark, axis=0)
        carried = seg == 0  # still in the episode the previous chunk left open

        # Positions: a walk of steps in {-1, 0, 1} per axis from each episode's start.
        steps = rng.integers(-1, 2, (t_len, n, 2), dtype=np.int32)
        walk_incl = np.cumsum(steps, axis=0, dtype=np.int32)
        walk_excl = walk_incl - steps
        seg3 = np.broadcast_to(seg[:, :, None], (t_len, n, 2))
        fresh = rng.integers(0, GRID, (t_len, n, 2), dtype=np.int32)
        start = np.where(
            carried[:, :, None], self.pos[None], np.take_along_axis(fresh, seg3, axis=0)
        )
        raw = start + walk_incl - np.take_along_axis(walk_excl, seg3, axis=0)
        folded = np.mod(raw, 2 * GRID)
        positions = np.where(folded < GRID, folded, 2 * GRID - 1 - folded).astype(np.int32)

        # Inventory: Bernoulli gains per item per step, counted from the episode start.
        gains = (rng.random((t_len, n, NUM_ITEMS), dtype=np.float32) < ITEM_GAIN_PROB).astype(
            np.int32
        )
        c_incl = np.cumsum(gains, axis=0, dtype=np.int32)
        c_excl = c_incl - gains
        seg16 = np.broadcast_to(seg[:, :, None], (t_len, n, NUM_ITEMS))
        base = np.where(carried[:, :, None], self.inv[None], 0)
        inventory = base + c_incl - np.take_along_axis(c_excl, seg16, axis=0)

        # What the next chunk continues from (a done on the last step restarts).
        last_done = done[-1]
        self.pos = positions[-1].copy()
        self.pos[last_done] = rng.integers(0, GRID, (int(last_done.sum()), 2), dtype=np.int32)
        self.inv = np.where(last_done[:, None], 0, inventory[-1]).astype(np.int32)
        return Chunk(
            Rollout(action, reward, done),
            EnvStates(positions[:, :, None, :].copy(), inventory[:, :, None, :].copy()),
        )


def make_pool(
    size: int, *, length: int = 128, num_envs: int = 256, seed: int = 0, done_prob: float = 1 / 500
) -> list[Chunk]:
    """`size` consecutive distinct chunks, to be reused cyclically."""
    gen = ChunkGenerator(num_envs, seed=seed, done_prob=done_prob)
    return [gen.chunk(length) for _ in range(size)]


def compression_check(level: int = 1, seed: int = 0) -> dict[str, float]:
    """zstd wire/raw ratio of this generator next to `SyntheticVecEnv` (same statistics?)."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=level)

    def ratio(arrays: dict[str, np.ndarray]) -> float:
        raw = sum(a.nbytes for a in arrays.values())
        wire = sum(len(comp.compress(np.ascontiguousarray(a).tobytes())) for a in arrays.values())
        return wire / raw

    ours = make_pool(2, seed=seed)[1]
    out = {"workload_wire_over_raw": ratio(ours.arrays)}
    try:
        from recorder_server.workload import SyntheticVecEnv
    except ImportError:
        return out
    env = SyntheticVecEnv(256, seed=seed)
    env.collect(128)
    rollout, states = env.collect(128)
    out["synthetic_env_wire_over_raw"] = ratio(
        {
            "action": rollout.action,
            "reward": rollout.reward,
            "done": rollout.done,
            "player_positions": states.player_positions,
            "player_inventory": states.player_inventory,
        }
    )
    return out
