"""torch and Stable-Baselines3 producers: the `latency_torch` and `sb3_ppo` scenarios.

- `latency_torch`: record() caller latency with a chunk of torch CPU tensors (the bench's
  chunk, each array as `torch.from_numpy`) against the same chunk as numpy arrays. Two
  recorders of one local server take turns call by call, so both see the same load, in
  AB BA order (neither kind always follows the other). TORCH_CALLS calls a side, not the
  other latency rows' 200: the p99 of 200 calls is their second and third slowest, and
  whether a garbage collection (40-150 us, about one in 170 calls of this loop) fell among
  those decided the ratio, 1.0x to 4.8x between runs of one build.
- `sb3_ppo`: SB3 PPO training on CartPole (8 DummyVecEnv envs) with `RecorderCallback`
  recording into a local server (on a recorder with the default sender threads, and on one
  with `sender="process"`), against the same training without it. Three models of the
  same seed learn in alternating turns of two rollouts (`learn(..., reset_num_timesteps=
  False)`), in ABC CBA order, until each side trained about 10 s; each side's time is summed,
  so a drift of the machine's load falls on both. torch computes on one thread: its thread
  pool's spinning on an oversubscribed machine swung the rate 20-fold between runs.

torch and stable-baselines3 come with the dev extra; without them each scenario is skipped.
"""

from __future__ import annotations

import time
from typing import Any

from chunks import STATE_FIELDS, make_pool
from harness import Context, Row, Skipped, latency_summary

WARMUP_CALLS = 3
MIN_ROUNDS, MAX_ROUNDS = 4, 200
TORCH_CALLS = 1000  # a side (quick: the bench's latency_calls)


def run_latency_torch(ctx: Context, rep: int = 0) -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        raise Skipped(f"torch is not installed ({exc})") from None
    from recorder_client import RolloutRecorder

    p = ctx.params
    pool = make_pool(p.pool, length=p.length, num_envs=p.num_envs, seed=5, done_prob=p.done_prob)
    numpy_chunks = [c.as_dicts() for c in pool]
    torch_chunks = [
        tuple({k: torch.from_numpy(v) for k, v in d.items()} for d in chunk)
        for chunk in numpy_chunks
    ]
    calls = p.latency_calls if ctx.quick else TORCH_CALLS
    chunk_bytes = pool[0].raw_bytes
    uncapped = max(1 << 30, int(chunk_bytes * (calls + 8) * 1.1))
    server = ctx.server("latency_torch")
    out: dict[str, Any] = {"chunk_raw_bytes": chunk_bytes, "torch_version": torch.__version__}
    try:
        recorders = {
            name: RolloutRecorder(
                record_states=True,
                state_fields=list(STATE_FIELDS),
                target=server.address,
                session=name.replace("_", "-"),
                max_bytes_in_flight=uncapped,
            )
            for name in ("numpy_back_to_back", "torch_back_to_back")
        }
        sources = {"numpy_back_to_back": numpy_chunks, "torch_back_to_back": torch_chunks}
        lat: dict[str, list[int]] = {name: [] for name in recorders}
        # Warm-up: both sessions joined and their first chunks acknowledged (as `latency`
        # does), then WARMUP_CALLS more in turns, so that both senders are running. Without
        # the second part the session started second paid its start in its first timed call
        # (~21 us in every run, whichever kind of array it records).
        warm = 2 * WARMUP_CALLS
        for i in range(calls + warm):
            if i == WARMUP_CALLS:
                for rec in recorders.values():
                    rec.flush()
            for name, rec in recorders.items() if i % 2 == 0 else reversed(recorders.items()):
                traj, states = sources[name][i % len(pool)]
                t0 = time.perf_counter_ns()
                rec.record(traj, states)
                t1 = time.perf_counter_ns()
                if i >= warm:
                    lat[name].append(t1 - t0)
        for name, rec in recorders.items():
            rec.flush()
            out[name] = {**latency_summary(lat[name]), "chunks_acked": rec.stats.chunks_acked}
            rec.close()
    finally:
        server.stop()
    return out


def rows_latency_torch(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("latency_torch")
    if not r:
        return []
    mb = r["chunk_raw_bytes"] / 1e6
    ours, ref = r["torch_back_to_back"], r["numpy_back_to_back"]
    return [
        Row(
            "record() latency",
            f"record() {stat}, torch CPU tensor input, back-to-back, {mb:.2f} MB chunk "
            f"(n={ours['n']}, in AB BA turns with the numpy calls)",
            ours[f"{stat}_us"],
            ref[f"{stat}_us"],
            "same chunk, numpy arrays",
            "us",
            "lower",
        )
        for stat in ("p50", "p99")
    ]


def run_sb3_ppo(ctx: Context, rep: int = 0) -> dict[str, Any]:
    try:
        import torch
        from stable_baselines3 import PPO
        from stable_baselines3.common.env_util import make_vec_env
        from stable_baselines3.common.logger import Logger
    except ImportError as exc:
        raise Skipped(f"stable-baselines3 is not installed ({exc})") from None
    from recorder_client import RolloutRecorder
    from recorder_client.sb3 import RecorderCallback

    num_envs, n_steps = 8, 128
    segment = num_envs * n_steps * 2  # two rollouts and their updates per turn
    # Turns until each side trained this long (at least MIN_ROUNDS rounds, at most MAX).
    budget_s = 3.0 if ctx.quick else 10.0
    server = ctx.server("sb3_ppo")
    out: dict[str, Any] = {"torch_version": torch.__version__}
    try:
        recorder = RolloutRecorder(target=server.address, session="sb3-ppo")
        # The same callback on a recorder whose stream runs in a process of its own.
        in_process = RolloutRecorder(target=server.address, session="sb3-ppo-p", sender="process")
        callbacks = {
            "without": None,
            "with_callback": RecorderCallback(recorder),
            "with_process_sender": RecorderCallback(in_process),
        }
        models = {
            name: PPO(
                "MlpPolicy",
                make_vec_env("CartPole-v1", n_envs=num_envs, seed=0),
                n_steps=n_steps,
                batch_size=256,
                n_epochs=4,
                seed=0,
                device="cpu",
            )
            for name in callbacks
        }
        for model in models.values():
            # Outputs SB3 would write nowhere: without a logger of its own, every learn()
            # made a log directory under the system's temp directory.
            model.set_logger(Logger(None, []))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        seconds = dict.fromkeys(models, 0.0)
        for name, model in models.items():  # warm-up: the first learn() sets everything up
            model.learn(segment, callback=callbacks[name])
        rounds = 0
        while rounds < MIN_ROUNDS or (min(seconds.values()) < budget_s and rounds < MAX_ROUNDS):
            # ABC CBA: a drift of the machine's load within a round falls on every side.
            order = list(models) if rounds % 2 == 0 else list(reversed(models))
            for name in order:
                t0 = time.perf_counter()
                models[name].learn(segment, callback=callbacks[name], reset_num_timesteps=False)
                seconds[name] += time.perf_counter() - t0
            rounds += 1
        torch.set_num_threads(threads)
        recorder.flush()
        in_process.flush()
        steps = segment * rounds
        for name in models:
            out[name] = {
                "steps": steps,
                "seconds": seconds[name],
                "steps_per_s": steps / seconds[name],
            }
        out["rounds"] = rounds
        out["recorded_env_steps"] = recorder.num_recorded_steps * num_envs
        out["recorded_env_steps_process"] = in_process.num_recorded_steps * num_envs
        recorder.close()
        in_process.close()
    finally:
        server.stop()
    return out


def rows_sb3_ppo(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("sb3_ppo")
    if not r:
        return []
    ref = r["without"]
    return [
        Row(
            "producers",
            f"SB3 PPO on CartPole, 8 envs: training steps/s with RecorderCallback{label} "
            f"({r[arm]['steps']} steps a side, in alternating turns)",
            r[arm]["steps_per_s"],
            ref["steps_per_s"],
            "the same training without it",
            "steps/s",
            "higher",
            digits=0,
        )
        for arm, label in (
            ("with_callback", ""),
            ("with_process_sender", ' on a recorder with sender="process"'),
        )
        if arm in r
    ]
