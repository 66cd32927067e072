"""What recording costs a Gymnasium loop: the `gym_record_rollouts` scenario.

CartPole-v1, 8 environments in a `SyncVectorEnv` (Gymnasium's default next-step autoreset),
the same pre-drawn actions, wrapped in `RecordRollouts` recording to a local server (at the
default 128 steps a `record()`, at 512, with `linger_ms=50`, and with the stream in a
process of its own, `sender="process"`) and into a recorder that discards every chunk (the
wrapper's copies and chunk building, with no record()). Each arm is a pair: in every round
its wrapper steps, and so do the same environments without it (`wrapper.env`), from the same
seed, the two in alternating order. Two envs of one make() step at speeds up to 2-3% apart
for the whole run (where their objects landed in memory), so a ratio between two instances
reads that as well; within a pair it cancels. An A/A arm pairs a bare loop with itself: its
ratio is the pairing's noise. The arms run in two phases, each with only its own recorders
open: the process sender, the floor (its recorder a process one too) and the A/A pair first,
then the three thread-sender arms, whose idle sender threads take the GIL about ten times a
second and would slow every other arm's rounds. Each round starts from reset() (a wrapper's
cuts the episodes under way; what its envs stepped without it is never recorded), the arms
take turns (each first in turn) so that all see the same background load, and each wrapper
records into one recorder for the whole run, as a training loop does. A wrapped round's
clock runs until the server acknowledged the round's chunks (the rows a wrapper still holds
go in its next round). The server runs with `--wal-fsync never`: with batch fsync an ack
waits up to `--wal-batch-ms` (50 ms) for the log's fsync, a wait a training loop never makes
but that a 170 ms round's clock would count. Before each round every recorder is flushed and
the process rests 60 ms (outside the clocks), so that no arm's background work (acks, a
sender thread's polling) lands in the next arm's round. The row is env steps per second
(vector steps x 8), wrapped against bare; the target reads the median of the rounds' ratios
of the `sender="process"` arm.

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

    def timed(envs: Any, recorder: Any, seed: int) -> tuple[float, float, float]:
        """Env steps per second of wall time, per second of this process's CPU time (every
        thread: the recorder's sender too), and per second of the loop thread's CPU time."""
        envs.reset(seed=seed)  # a wrapper's reset cuts the episodes under way
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

    runs: dict[str, list[tuple[float, float, float]]] = {}
    bares: dict[str, list[tuple[float, float, float]]] = {}
    server = ctx.server("gym_record_rollouts", ("--wal-fsync", "never"))
    recorders: list[Any] = []
    # name: (the loop as measured, its recorder, the same environments stepped bare)
    arms: dict[str, tuple[Any, Any, Any]] = {}

    # Each arm's wrapper records into one recorder from start to end, as in training; a
    # round's clock runs until its chunks are acked, and the rows a wrapper holds at a round's
    # end (fewer than a chunk) go in its next one.
    def add(name: str, recorder: Any, chunk_steps: int = 128) -> None:
        recorders.append(recorder)
        wrapper = RecordRollouts(make(), recorder, chunk_steps=chunk_steps)
        arms[name] = (wrapper, recorder, wrapper.env)

    def recording(session: str, **kwargs: Any) -> Any:
        return RolloutRecorder(target=server.address, session=session, **kwargs)

    def phase() -> dict[str, Any]:
        """Run the arms made so far, close them, and return their recorders' status."""
        try:
            for measured, recorder, _ in arms.values():  # warm up: connections, layouts
                timed(measured, recorder, 0)
            names = list(arms)
            for name in names:
                runs[name], bares[name] = [], []
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:  # each first
                    measured, recorder, envs = arms[name]
                    # Both sides of a pair step the same environments from the same seed;
                    # which goes first alternates.
                    sides = [(runs, measured, recorder), (bares, envs, None)]
                    for out, loop, rec in sides if r % 2 == 0 else sides[::-1]:
                        out[name].append(timed(loop, rec, seed=r + 1))
            for measured, _, _ in arms.values():
                measured.close()  # a wrapper's: its last rows recorded, its recorder flushed
            return {name: rec.status() for name, (_, rec, _) in arms.items() if rec is not None}
        finally:
            for recorder in recorders:
                recorder.close()
            recorders.clear()
            arms.clear()

    try:
        # Two phases. A thread-sender recorder's thread wakes its process's GIL about ten
        # times a second even when idle (gRPC's waits for the next ack), so the first phase
        # holds no such recorder: the process sender, the floor and the A/A pair.
        # The stream in a process of its own: no thread of the loop's process takes the GIL.
        add("wrapped_process", recording("gym-process", sender="process"))
        # The floor: this wrapper's own work, without record().
        add(
            "discarding", Discarding(target=server.address, session="gym-discard", sender="process")
        )
        bare = make()
        arms["bare_again"] = (bare, None, bare)  # A/A: the same loop on both sides
        phase()
        add("wrapped", recording("gym-wrapper"))
        add("wrapped_512", recording("gym-wrapper-512"), 512)
        # Small chunks linger 50 ms and join (linger_ms, off by default).
        add("wrapped_linger", recording("gym-linger", linger_ms=50))
        status = phase()
    finally:
        server.stop()

    def summary(name: str) -> dict[str, Any]:
        arm, base = runs[name], bares[name]

        def ratio(i: int) -> float:
            return statistics.median(w[i] / b[i] for w, b in zip(arm, base, strict=True))

        return {
            "env_steps_s": statistics.median(w[0] for w in arm),
            "bare_env_steps_s": statistics.median(b[0] for b in base),
            "ratio": ratio(0),
            "ratios": [w[0] / b[0] for w, b in zip(arm, base, strict=True)],
            # The same per CPU second (less swayed by the machine's load than wall time): of
            # the whole process, and of the loop's thread alone (the wrapper and record()).
            "cpu_ratio": ratio(1),
            "loop_thread_cpu_ratio": ratio(2),
        }

    return {
        "num_envs": NUM_ENVS,
        "steps_per_round": steps,
        "rounds": rounds,
        **summary("wrapped"),
        # The same wrapper sending 512 steps a record() (the client's cost is mostly per call).
        "chunk_512": summary("wrapped_512"),
        # The same wrapper, its recorder made with sender="process".
        "process": summary("wrapped_process"),
        "bare_again": summary("bare_again"),
        "discarding": summary("discarding"),
        # The same wrapper, its recorder made with linger_ms=50.
        "linger": {
            **summary("wrapped_linger"),
            "messages": status["wrapped_linger"].chunks_stored,
            "recorded_steps": status["wrapped_linger"].num_recorded_steps,
        },
        "recorded_steps": status["wrapped"].num_recorded_steps,
        "stepped": (rounds + 1) * steps * NUM_ENVS,  # its bare rounds are not recorded
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
            f"A/A: a bare loop on CartPole, {n} SyncVectorEnv envs, paired with itself: env "
            "steps/s (the bench's noise",
            r.get("bare_again"),
        ),
    ]
    return [
        Row(
            "Gymnasium",
            f"{text}; median of {r['rounds']} rounds' ratio {res['ratio']:.3f}; per CPU second "
            f"{res['cpu_ratio']:.3f}, of the loop's thread {res['loop_thread_cpu_ratio']:.3f})",
            res["env_steps_s"],
            res["bare_env_steps_s"],
            "the same envs stepped without the wrapper",
            "steps/s",
            "higher",
            digits=0,
        )
        for text, res in arms
        if res is not None
    ]
