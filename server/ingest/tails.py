"""Returns and outcomes of finished episodes, carried across chunks per environment.

An episode's return is the sum of its rewards over every chunk it spans, and its outcome its
last non-zero outcome code (0: none, the store's rule then decides). Each worker keeps, per
environment, the running return and the last code of its open episode; where that episode
starts is the timeline's to know (`episodes.WorkerTimeline.open_start`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..store import kernels


@dataclass
class Finished:
    """The episodes one chunk finished: their returns, lengths and outcome codes."""

    returns: np.ndarray
    lengths: np.ndarray
    outcomes: np.ndarray


class EpisodeSums:
    """Per environment of one worker: the running return and last outcome code of its open
    episode."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.open_return = np.zeros(num_envs, dtype=np.float64)
        self.open_code = np.zeros(num_envs, dtype=np.int64)

    def close(
        self,
        csum: np.ndarray,
        codes: np.ndarray | None,
        t0: int,
        env: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
    ) -> Finished:
        """The episodes (env, start, end) a chunk of steps t0.. finished, given the chunk's
        reward sums (``csum[k]``: steps before k, see `cumsum`) and outcome codes (or None);
        then carry every environment's open episode past the chunk."""
        length = csum.shape[0] - 1
        n = np.arange(self.num_envs)
        local_start = np.maximum(start - t0, 0)
        local_end = end - t0
        carried = start < t0
        returns = csum[local_end, env] - csum[local_start, env]
        returns[carried] += self.open_return[env[carried]]
        outcomes = np.zeros(env.size, dtype=np.int64)
        last_code = None
        if codes is not None and length:
            # Per (step, env): the step of the last non-zero code at or before it (-1: none).
            steps = np.arange(length)[:, None]
            last_code = np.maximum.accumulate(np.where(codes != 0, steps, -1), axis=0)
        if env.size:
            found = np.full(env.size, -1, dtype=np.int64)
            if last_code is not None:
                found = last_code[local_end - 1, env]
                found[found < local_start] = -1
            own = found >= 0
            outcomes[own] = codes[found[own], env[own]] if own.any() else 0
            inherit = ~own & carried
            outcomes[inherit] = self.open_code[env[inherit]]
        # Carry the open episodes past this chunk.
        last_end = np.full(self.num_envs, -1, dtype=np.int64)
        if env.size:
            last_end[env] = local_end  # env-major, time-ordered: the last write wins
        ended = last_end >= 0
        tail_from = np.where(ended, last_end, 0)
        tail_sum = csum[length] - csum[tail_from, n]
        self.open_return = np.where(ended, tail_sum, self.open_return + tail_sum)
        if last_code is not None:
            last = last_code[length - 1]
            has = last >= tail_from
            new_code = np.where(has, codes[np.maximum(last, 0), n], 0)
            self.open_code = np.where(ended | has, new_code, self.open_code)
        else:
            self.open_code[ended] = 0
        return Finished(returns, end - start, outcomes)

    def state(self) -> dict[str, np.ndarray]:
        return {"open_return": self.open_return, "open_code": self.open_code}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> EpisodeSums:
        sums = cls(int(state["open_return"].size))
        sums.open_return = np.asarray(state["open_return"], dtype=np.float64).copy()
        sums.open_code = np.asarray(state["open_code"], dtype=np.int64).copy()
        return sums


def cumsum(rewards: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(T+1, N) float64 running sums of a chunk's rewards over time, row 0 zeros. With
    ``out`` (a buffer to reuse; the store path, whose compiled loops are loaded), float
    rewards take the compiled loop; the sums are the same either way."""
    if out is not None and rewards.dtype in (np.float32, np.float64) and rewards.flags.c_contiguous:
        shape = (rewards.shape[0] + 1, rewards.shape[1])
        if out.shape != shape:
            out = np.empty(shape)
        return kernels.chunk_cumsum(rewards, out)
    # Cast first, then accumulate in place: numpy's cumsum with a dtype casts through a
    # buffer along the strided axis, twice as slow; the additions are the same.
    csum = np.empty((rewards.shape[0] + 1, *rewards.shape[1:]))
    csum[0] = 0.0
    csum[1:] = rewards
    np.add.accumulate(csum[1:], axis=0, out=csum[1:])
    return csum
