"""Episode boundaries -> trajectory store and metrics, off the ack path.

Every finished episode reaches the capture processor (`record_episode`) and the
metrics, whether or not a trajectory store is configured. Without a store only
lengths, returns and outcomes are needed, computed per chunk with numpy; with a
store the episode's arrays are gathered from the recent decoded chunks of its
worker (kept while some environment's open episode still needs them).
"""

from __future__ import annotations

import bisect
import collections
import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from .capture import TrajectoryCaptureProcessor
from .store import EpisodeBatch

logger = logging.getLogger(__name__)


@dataclass
class ChunkEpisodes:
    """What the session hands over for one stored chunk."""

    worker: int
    t0: int
    arrays: dict[str, np.ndarray]  # decoded: action, reward, done, state:<name>, outcome?
    env: np.ndarray
    start: np.ndarray
    end: np.ndarray
    env_steps_before: int  # session env steps before this chunk (the metrics step)


@dataclass
class _WorkerTails:
    """Per-environment state of the open episodes of one worker."""

    num_envs: int
    open_start: np.ndarray
    open_return: np.ndarray
    open_code: np.ndarray
    # Recent decoded chunks (t0, arrays), oldest first, kept for the store path.
    chunks: collections.deque = field(default_factory=collections.deque)
    held_bytes: int = 0


class EpisodeFeeder:
    """A thread per session that turns finished episodes into store updates and metrics."""

    def __init__(
        self,
        session: str,
        processor: TrajectoryCaptureProcessor,
        metrics,
        *,
        queue_chunks: int = 32,
        max_tail_bytes: int = 1 << 30,
    ) -> None:
        self.session = session
        self.processor = processor
        self.metrics = metrics
        self.max_tail_bytes = max_tail_bytes
        self._queue: queue.Queue[ChunkEpisodes | None] = queue.Queue(maxsize=queue_chunks)
        self._workers: dict[int, _WorkerTails] = {}
        self._pending = 0
        self._idle = threading.Condition()
        self.truncated_episodes = 0
        self._thread = threading.Thread(target=self._run, name=f"feeder-{session}", daemon=True)
        self._thread.start()

    @property
    def keeps_arrays(self) -> bool:
        return self.processor.store is not None

    # -- producer side -----------------------------------------------------
    def submit(self, item: ChunkEpisodes) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(item)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk has been processed."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def reset(self) -> None:
        self.drain()
        self._workers.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def tails_state(self) -> dict[int, dict[str, np.ndarray]]:
        """Open-episode sums per worker (call drained)."""
        return {
            index: {
                "open_start": t.open_start,
                "open_return": t.open_return,
                "open_code": t.open_code,
            }
            for index, t in self._workers.items()
        }

    def restore_tails(self, state: dict[int, dict[str, np.ndarray]], timelines: list) -> None:
        """Inverse of tails_state; the store path re-decodes the chunks open episodes need."""
        self._workers.clear()
        by_index = {tl.index: tl for tl in timelines}
        for index, arrays in state.items():
            tails = _WorkerTails(
                int(arrays["open_start"].size),
                arrays["open_start"].astype(np.int64),
                arrays["open_return"].astype(np.float64),
                arrays["open_code"].astype(np.int64),
            )
            timeline = by_index.get(index)
            if self.keeps_arrays and timeline is not None and tails.open_start.size:
                oldest = int(tails.open_start.min())
                for chunk in timeline.chunks:
                    if chunk.t0 + chunk.length > oldest:
                        decoded = {
                            k: np.ascontiguousarray(np.swapaxes(a.decode(), 0, 1))
                            for k, a in chunk.arrays.items()
                            if k != "done"
                        }
                        tails.chunks.append((chunk.t0, decoded))
                        tails.held_bytes += sum(a.nbytes for a in decoded.values())
            self._workers[index] = tails

    # -- the thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                # NaN and inf rewards are data, not errors: returns just carry them.
                with np.errstate(all="ignore"):
                    self._process(item)
            except Exception:  # a bad episode must not stop the session's metrics
                logger.exception("session %r: episode processing failed", self.session)
                self.metrics.inc("Recorder/feed_errors", 1, session=self.session)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _tails(self, worker: int, num_envs: int) -> _WorkerTails:
        tails = self._workers.get(worker)
        if tails is None:
            tails = _WorkerTails(
                num_envs,
                np.zeros(num_envs, dtype=np.int64),
                np.zeros(num_envs, dtype=np.float64),
                np.zeros(num_envs, dtype=np.int64),
            )
            self._workers[worker] = tails
        return tails

    def _process(self, item: ChunkEpisodes) -> None:
        rewards = item.arrays["reward"]
        length, num_envs = rewards.shape
        tails = self._tails(item.worker, num_envs)
        t0 = item.t0
        env, start, end = item.env, item.start, item.end
        # Returns: running sums of the open episodes plus in-chunk cumulative sums.
        csum = np.cumsum(rewards, axis=0, dtype=np.float64)
        csum = np.concatenate([np.zeros((1, num_envs)), csum])  # csum[k] = sum of steps < k
        local_start = np.maximum(start - t0, 0)
        local_end = end - t0
        returns = csum[local_end, env] - csum[local_start, env]
        carried = start < t0
        returns[carried] += tails.open_return[env[carried]]
        codes = item.arrays.get("outcome")
        outcomes = self._outcomes(codes, tails, env, local_start, local_end, carried)
        lengths = end - start
        if self.keeps_arrays:
            # Env-major copies: each episode's steps are then contiguous to gather.
            held = {
                k: np.ascontiguousarray(np.swapaxes(a, 0, 1))
                for k, a in item.arrays.items()
                if k not in ("done", "outcome")
            }
            tails.chunks.append((t0, held))
            tails.held_bytes += sum(a.nbytes for a in held.values())
            batch, kept = self._gather(tails, env, start, end)
        else:
            # No store: only lengths and outcomes count, so no arrays are gathered.
            total = int(lengths.sum())
            batch = EpisodeBatch(np.zeros(total, np.int8), np.zeros(total, np.float32), {}, lengths)
            kept = np.ones(env.size, dtype=bool)

        # Advance the open tails past this chunk.
        last_end = np.full(num_envs, -1, dtype=np.int64)
        if env.size:
            last_end[env] = local_end  # env-major, time-ordered: the last write wins
        ended = last_end >= 0
        tails.open_start[ended] = t0 + last_end[ended]
        tail_from = np.where(ended, last_end, 0)
        tail_sum = csum[length] - csum[tail_from, np.arange(num_envs)]
        tails.open_return = np.where(ended, tail_sum, tails.open_return + tail_sum)
        if codes is not None:
            steps = np.arange(length)[:, None]
            marked = (codes != 0) & (steps >= tail_from[None, :])
            last = np.where(marked, steps, -1).max(axis=0) if length else np.full(num_envs, -1)
            has = last >= 0
            new_code = np.where(has, codes[np.maximum(last, 0), np.arange(num_envs)], 0)
            tails.open_code = np.where(ended | has, new_code, tails.open_code)
        else:
            tails.open_code[ended] = 0
        if self.keeps_arrays:
            self._trim(tails)

        step = item.env_steps_before
        if env.size:
            self.truncated_episodes += int(env.size - kept.sum())
            self.processor.record_episodes(batch, None, step, outcomes=outcomes[kept])
            labels = {"session": self.session}
            self.metrics.inc("Recorder/episodes_finished", float(env.size), **labels)
            self.metrics.log_many(
                {
                    "Episode/return_mean": float(returns.mean()),
                    "Episode/return_max": float(returns.max()),
                    "Episode/return_min": float(returns.min()),
                    "Episode/length_mean": float(lengths.mean()),
                    "Episode/length_max": float(lengths.max()),
                },
                step,
                **labels,
            )
            self.processor.log_metrics(step)

    @staticmethod
    def _outcomes(codes, tails, env, local_start, local_end, carried) -> np.ndarray:
        out = np.zeros(env.size, dtype=np.int64)
        if codes is None:
            return out
        for i in range(env.size):
            column = codes[local_start[i] : local_end[i], env[i]]
            nonzero = np.flatnonzero(column)
            if nonzero.size:
                out[i] = column[nonzero[-1]]
            elif carried[i]:
                out[i] = tails.open_code[env[i]]
        return out

    @staticmethod
    def _gather(
        tails: _WorkerTails, env: np.ndarray, start: np.ndarray, end: np.ndarray
    ) -> tuple[EpisodeBatch, np.ndarray]:
        """The finished episodes' arrays, back to back, from the held chunks.

        Episodes whose beginning was dropped under the tail cap are left out (kept[i]
        is False) rather than stored truncated.
        """
        held = list(tails.chunks)
        firsts = [c_t0 for c_t0, _ in held]
        keys = list(held[-1][1])
        pieces: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        kept = np.zeros(env.size, dtype=bool)
        for i, (e, s, t) in enumerate(zip(env.tolist(), start.tolist(), end.tolist())):
            if s < firsts[0]:
                continue
            kept[i] = True
            c = max(bisect.bisect_right(firsts, s) - 1, 0)
            while c < len(held) and firsts[c] < t:
                c_t0, arrays = held[c]
                lo, hi = max(s, c_t0) - c_t0, min(t - c_t0, arrays["reward"].shape[1])
                if lo < hi:
                    for k in keys:
                        pieces[k].append(arrays[k][e, lo:hi])
                c += 1
        joined = {k: np.concatenate(v) if v else held[-1][1][k][0, :0] for k, v in pieces.items()}
        states = {k[6:]: v for k, v in joined.items() if k.startswith("state:")}
        batch = EpisodeBatch(joined["action"], joined["reward"], states, (end - start)[kept])
        return batch, kept

    def _trim(self, tails: _WorkerTails) -> None:
        oldest = int(tails.open_start.min()) if tails.open_start.size else 0
        while tails.chunks:
            c_t0, arrays = tails.chunks[0]
            c_len = arrays["reward"].shape[1]
            over = tails.held_bytes > self.max_tail_bytes and len(tails.chunks) > 1
            if c_t0 + c_len > oldest and not over:
                break
            tails.chunks.popleft()
            tails.held_bytes -= sum(a.nbytes for a in arrays.values())
