"""The bench's chunks: `recorder_server.workload.SyntheticVecEnv` (the demo's environment)
collected into a pool, packaged for the three kinds of worker.

Workers pre-generate a `pool` of consecutive distinct chunks before the clock starts and
reuse them cyclically, so generation is never measured. One chunk at T=128, N=256 is
2,654,208 raw bytes; with `frame_size=84` each env step adds an 84x84 uint8 frame (7,056
bytes), so a pixel chunk at T=128, N=16 is about 14.6 MB.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from recorder_server.workload import EnvStates, Rollout, SyntheticVecEnv, position_store

STATE_FIELDS = ("player_positions", "player_inventory")
FRAME_SIZE = 84  # the pixel rows' frames: (T, N, 84, 84) uint8


def store_configuration():
    """The store rows' configuration: 2 cell fields (positions, bucket 4) and 1 utility,
    fed by every episode: the reward-sign rule turns each return into a win or a loss."""
    return position_store(gamma=0.99)


@dataclass
class Chunk:
    """One `collect(T)`: what `record(trajectories, env_states)` takes."""

    rollout: Rollout
    states: EnvStates
    state_fields: tuple[str, ...]

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        out = {
            "action": self.rollout.action,
            "reward": self.rollout.reward,
            "done": self.rollout.done,
        }
        return out | {name: getattr(self.states, name) for name in self.state_fields}

    @property
    def raw_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def as_dicts(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        a = self.arrays
        traj = {k: a[k] for k in ("action", "reward", "done")}
        return traj, {k: a[k] for k in self.state_fields}

    def to_bytes(self) -> bytes:
        """The uncompressed bytes of every array, back to back (the raw-gRPC payload)."""
        return b"".join(memoryview(np.ascontiguousarray(a)).cast("B") for a in self.arrays.values())


def make_pool(
    size: int,
    *,
    length: int = 128,
    num_envs: int = 256,
    seed: int = 0,
    done_prob: float = 1 / 500,
    frame_size: int | None = None,
) -> list[Chunk]:
    """`size` consecutive distinct chunks of one environment, to be reused cyclically."""
    env = SyntheticVecEnv(num_envs, seed=seed, done_prob=done_prob, frame_size=frame_size)
    fields = tuple(env.state_fields)
    return [Chunk(*env.collect(length), fields) for _ in range(size)]


def compression_check(level: int = 1, seed: int = 0) -> dict[str, float]:
    """zstd wire/raw of a chunk of each workload (the pixel one: its frames alone too)."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=level)

    def ratio(arrays: dict[str, np.ndarray]) -> float:
        raw = sum(a.nbytes for a in arrays.values())
        wire = sum(len(comp.compress(np.ascontiguousarray(a).tobytes())) for a in arrays.values())
        return wire / raw

    base = make_pool(2, seed=seed)[1]
    pixels = make_pool(2, num_envs=16, seed=seed, frame_size=FRAME_SIZE)[1]
    return {
        "workload_wire_over_raw": ratio(base.arrays),
        "pixels_wire_over_raw": ratio(pixels.arrays),
        "frames_wire_over_raw": ratio({"frames": pixels.arrays["frames"]}),
    }


def timed_records(rec, pool: list[Chunk], calls: int, pause_s: float = 0.0) -> list[int]:
    """``calls`` record() calls cycling through ``pool``, each after ``pause_s`` of sleep (a
    training step, the GIL released); each call's nanoseconds."""
    lat = []
    for i in range(calls):
        if pause_s:
            time.sleep(pause_s)
        c = pool[i % len(pool)]
        t0 = time.perf_counter_ns()
        rec.record(c.rollout, c.states)
        lat.append(time.perf_counter_ns() - t0)
    return lat
