"""What recording costs a Gymnasium loop: the `gym_record_rollouts` scenario.

CartPole-v1, 8 environments in a `SyncVectorEnv` (Gymnasium's default next-step autoreset),
the same pre-drawn actions, stepped bare and wrapped in `RecordRollouts` recording to a
local server (at the default 128 steps a `record()`, at 512, with `linger_ms=50`, and with
the stream in a process of its own, `sender="process"`), side by side. Two more arms read
the bench's resolution and the floor under those: a second bare loop, made after the others
(an A/A pair: its ratio to the first is noise), and `RecordRollouts` into a recorder that
discards every chunk (the wrapper's copies of each step and its chunk building, with no
record()). The seven take turns in short rounds (each first in turn), so that all see the
same background load. Each arm steps one env (and one wrapper and recorder) for the whole
run, as a training loop does. A wrapped round's clock runs until the server acknowledged
the round's chunks (the rows a wrapper still holds go in its next round). The server runs
with `--wal-fsync never`: with batch fsync an ack waits up to `--wal-batch-ms` (50 ms) for
the log's fsync, a wait a training loop never makes but that a 90 ms round's clock would
count. Before each round
every recorder is flushed and the process rests 60 ms (outside the clocks), so that no arm's
background work (acks, a sender thread's polling) lands in the next arm's round. The row is
env steps per second (vector steps x 8), wrapped against bare; the target reads the median
of the rounds' ratios of the `sender="process"` arm.

gymnasium comes with the dev extra (the tests run it); without it the scenario is skipped.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from harness import Context, Row, Skipped

NUM_ENVS = 8
# Longer than a sender thread polls after its last chunk (recorder_client._poll.POLL_QUIET_S).
REST_S = 0.06


def run_gym_record_rollouts(ctx: Context, rep: int = 0) -> dict[str, Any]:
    try:
        import gymnasium as gym
    except ImportError as exc:
        raise Skipped(f"gymnasium is not installed ({exc}); it is in the dev extra") from None
    from recorder_client import RolloutRecorder
    from recorder_client.gymnasium import RecordRollouts

    class Discarding(RolloutRecorder):
        """Its wrapper's chunks go nowhere: RecordRollouts hands each chunk it built to
        `_record_built`, record()'s entry for them."""

        def _record_built(self, arrays: dict[str, Any]) -> bool:
            return True

    # Short rounds in many pairs: a pair sees nearly the same load, and the median of the
    # pairs' ratios drops the pairs a load swing split.
    rounds, steps = (6, 1000) if ctx.quick else (24, 2400)
    actions = np.random.default_rng(0).integers(0, 2, (steps, NUM_ENVS))

    def make() -> Any:
        return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS)

    def timed(envs: Any, recorder: Any) -> tuple[float, float, float]:
        """Env steps per second of wall time, per second of this process's CPU time (every
        thread: the recorder's sender too), and per second of the loop thread's CPU time."""
        for other in recorders:  # every arm's background work done before the clock starts
            other.flush()
        time.sleep(REST_S)
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        for action in actions:
            envs.step(action)
        if recorder is not None:
            recorder.flush()  # the round's chunks acknowledged by the server
        n = steps * NUM_ENVS
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return n / wall, n / cpu, n / (time.thread_time() - m0)

    server = ctx.server("gym_record_rollouts", ("--wal-fsync", "never"))
    recorders: list[Any] = []
    arms: dict[str, tuple[Any, Any]] = {}
    try:
        # Each arm steps one env for the whole run (a wrapper records into one recorder from
        # start to end, as in training); a round's clock runs until its chunks are acked.
        # The rows a wrapper holds at a round's end (fewer than a chunk) go in the next one.
        def wrapped(session: str, chunk_steps: int = 128, **kwargs: Any) -> tuple[Any, Any]:
            recorder = RolloutRecorder(target=server.address, session=session, **kwargs)
            recorders.append(recorder)
            return RecordRollouts(make(), recorder, chunk_steps=chunk_steps), recorder

        arms["bare"] = (make(), None)
        # The floor: this wrapper's own work, without record().
        discarding = Discarding(target=server.address, session="gym-discard")
        recorders.append(discarding)
        arms["discarding"] = (RecordRollouts(make(), discarding), discarding)
        arms["wrapped"] = wrapped("gym-wrapper")
        arms["wrapped_512"] = wrapped("gym-wrapper-512", 512)
        # Small chunks linger 50 ms and join (linger_ms, off by default).
        arms["wrapped_linger"] = wrapped("gym-linger", linger_ms=50)
        # The stream in a process of its own: no thread of the loop's process takes the GIL.
        arms["wrapped_process"] = wrapped("gym-process", sender="process")
        arms["bare_again"] = (make(), None)  # A/A: the same loop on envs made last
        for envs, recorder in arms.values():  # warm up: connections, the first layouts
            envs.reset(seed=0)
            timed(envs, recorder)
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in arms}
        for r in range(rounds):
            order = list(arms)[r % len(arms) :] + list(arms)[: r % len(arms)]  # each first in turn
            for name in order:
                runs[name].append(timed(*arms[name]))
        for envs, _ in arms.values():
            envs.close()  # a wrapper's: its last rows recorded, its recorder flushed
        status = arms["wrapped"][1].status()
        linger_status = arms["wrapped_linger"][1].status()
    finally:
        for recorder in recorders:
            recorder.close()
        server.stop()
    bare, wrapped = runs["bare"], runs["wrapped"]

    def ratio(arm: list[tuple[float, float, float]], i: int) -> float:
        return statistics.median(w[i] / b[i] for w, b in zip(arm, bare))

    def summary(name: str) -> dict[str, float]:
        arm = runs[name]
        return {
            "env_steps_s": statistics.median(w[0] for w in arm),
            "ratio": ratio(arm, 0),
            "cpu_ratio": ratio(arm, 1),
            "loop_thread_cpu_ratio": ratio(arm, 2),
        }

    return {
        "num_envs": NUM_ENVS,
        "steps_per_round": steps,
        "rounds": rounds,
        "bare_env_steps_s": statistics.median(b[0] for b in bare),
        "wrapped_env_steps_s": statistics.median(w[0] for w in wrapped),
        "ratio": ratio(wrapped, 0),
        "ratios": [w[0] / b[0] for w, b in zip(wrapped, bare)],
        # The same per CPU second (less swayed by the machine's load than wall time): of the
        # whole process, and of the loop's thread alone (the wrapper and record() calls).
        "cpu_ratio": ratio(wrapped, 1),
        "loop_thread_cpu_ratio": ratio(wrapped, 2),
        # The same wrapper sending 512 steps a record() (the client's cost is mostly per call).
        "chunk_512": summary("wrapped_512"),
        # The same wrapper, its recorder made with sender="process".
        "process": summary("wrapped_process"),
        "bare_again": summary("bare_again"),
        "discarding": summary("discarding"),
        # The same wrapper, its recorder made with linger_ms=50.
        "linger": {
            **summary("wrapped_linger"),
            "messages": linger_status.chunks_stored,
            "recorded_steps": linger_status.num_recorded_steps,
        },
        "recorded_steps": status.num_recorded_steps,
        "stepped": (rounds + 1) * steps * NUM_ENVS,
        "gymnasium_version": gym.__version__,
    }


def rows_gym_record_rollouts(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("gym_record_rollouts")
    if not r:
        return []
    n = r["num_envs"]
    recording = (
        f"RecordRollouts on CartPole, {n} SyncVectorEnv envs{{}}: env steps/s recording to a "
        "local server (--wal-fsync never"
    )
    arms = [
        (recording.format(""), r),
        (recording.format(", chunk_steps=512"), r["chunk_512"]),
        (recording.format(", recorder with linger_ms=50"), r.get("linger")),
        (recording.format(', recorder with sender="process"'), r.get("process")),
        (
            f"RecordRollouts on CartPole, {n} SyncVectorEnv envs, into a recorder that discards "
            "each chunk: env steps/s (the wrapper's copies and chunks alone, no record()",
            r.get("discarding"),
        ),
        (
            f"A/A: a second bare loop on CartPole, {n} SyncVectorEnv envs, made after the "
            "others: env steps/s (the bench's noise",
            r.get("bare_again"),
        ),
    ]
    return [
        Row(
            "Gymnasium",
            f"{text}; median of {r['rounds']} rounds' ratio {res['ratio']:.3f}; per CPU second "
            f"{res['cpu_ratio']:.3f}, of the loop's thread {res['loop_thread_cpu_ratio']:.3f})",
            res.get("env_steps_s", r["wrapped_env_steps_s"]),
            r["bare_env_steps_s"],
            "the same loop without the wrapper",
            "steps/s",
            "higher",
            digits=0,
        )
        for text, res in arms
        if res is not None
    ]
