"""record() latency with JAX arrays as input: the `latency_jax` scenario.

A `jax.jit`-compiled rollout (one `lax.scan` over T steps of N environments, on CPU) returns
the chunk `recorder_server.workload.SyntheticVecEnv` collects, with the same shapes and dtypes:
int32 actions (T, N), float32 rewards (T, N), bool done flags (T, N), int32 `player_positions`
(T, N, 1, 2) and `player_inventory` (T, N, 1, 16). record() takes the outputs as `jax.Array`s
and returns; the sender thread converts them later. An accelerator's array gets its
device-to-host copy started (`copy_to_host_async`) in record(); a CPU array's buffer is host
memory already, read in place, so no copy is started for it.

Three phases against one local server, each with a recorder (session) of its own and the
in-flight cap far away, only the record() call inside the clock:

- `numpy_back_to_back`, the reference: chunks of the same jitted rollout as numpy arrays, a
  pool reused cyclically, back-to-back (the `latency` scenario's setup);
- `jax_back_to_back`: a fresh chunk per call, computed before the clock starts
  (`block_until_ready`), back-to-back: the same calls with jax.Array inputs;
- `jax_in_loop`: rollout, record, rollout, record...: record() right after the jitted call
  returns, its outputs possibly still being computed (JAX dispatches asynchronously).

jax is a bench-only dependency (bench/requirements.txt); without it the scenario is skipped.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
from chunks import STATE_FIELDS
from harness import MB, Context, Row, Skipped, latency_summary

from recorder_server.workload import GRID, NUM_ACTIONS, NUM_ITEMS

WARMUP_CALLS = 3  # record() calls before each phase's clock: connection, first-chunk schema


def make_rollout(
    num_envs: int,
    length: int,
    *,
    seed: int = 0,
    done_prob: float = 1 / 500,
    reward_prob: float = 0.02,
) -> tuple[Any, Any]:
    """`(rollout, carry)`: `rollout(carry)` is jitted and returns `(carry, traj, states)`,
    `traj` and `states` dicts of (T, N, ...) jax.Arrays shaped as SyntheticVecEnv's chunk."""
    import jax
    import jax.numpy as jnp

    def step(carry, _):
        key, pos, inv = carry
        key, k_act, k_hit, k_rew, k_done, k_move, k_gain, k_reset = jax.random.split(key, 8)
        action = jax.random.randint(k_act, (num_envs,), 0, NUM_ACTIONS, dtype=jnp.int32)
        hit = jax.random.uniform(k_hit, (num_envs,)) < reward_prob
        reward = jnp.where(hit, jax.random.normal(k_rew, (num_envs,)), 0.0).astype(jnp.float32)
        done = jax.random.uniform(k_done, (num_envs,)) < done_prob
        move = jax.random.randint(k_move, (num_envs, 1, 2), -1, 2, dtype=jnp.int32)
        pos = jnp.clip(pos + move, 0, GRID - 1)
        gain = jax.random.uniform(k_gain, (num_envs, 1, NUM_ITEMS)) < 0.01
        inv = inv + gain.astype(jnp.int32)
        out = (action, reward, done, pos, inv)
        # A finished episode restarts from a fresh state.
        ended = done[:, None, None]
        fresh = jax.random.randint(k_reset, (num_envs, 1, 2), 0, GRID, dtype=jnp.int32)
        pos = jnp.where(ended, fresh, pos)
        inv = jnp.where(ended, 0, inv)
        return (key, pos, inv), out

    @jax.jit
    def rollout(carry):
        carry, (action, reward, done, pos, inv) = jax.lax.scan(step, carry, None, length=length)
        traj = {"action": action, "reward": reward, "done": done}
        states = {"player_positions": pos, "player_inventory": inv}
        return carry, traj, states

    key = jax.random.key(seed)
    key, k_pos = jax.random.split(key)
    pos = jax.random.randint(k_pos, (num_envs, 1, 2), 0, GRID, dtype=jnp.int32)
    inv = jnp.zeros((num_envs, 1, NUM_ITEMS), dtype=jnp.int32)
    return rollout, (key, pos, inv)


def run_latency_jax(ctx: Context, rep: int = 0) -> dict[str, Any]:
    try:
        import jax
    except ImportError as exc:
        raise Skipped(f"jax is not installed ({exc}); see bench/requirements.txt") from None

    from recorder_client import RolloutRecorder

    p = ctx.params
    calls = p.latency_calls
    rollout, carry = make_rollout(p.num_envs, p.length, seed=11, done_prob=p.done_prob)
    # Compile and warm up before any clock.
    t0 = time.perf_counter()
    for _ in range(3):
        carry, traj, states = rollout(carry)
    jax.block_until_ready((traj, states))
    warmup_s = time.perf_counter() - t0

    def host(chunk: tuple[dict, dict]) -> tuple[dict, dict]:
        traj, states = chunk
        return {k: np.asarray(v) for k, v in traj.items()}, {
            k: np.asarray(v) for k, v in states.items()
        }

    # The numpy reference's pool, then the jax phase's fresh chunks (each converted only by
    # the recorder), computed before the clocks start.
    pool = []
    for _ in range(p.pool):
        carry, traj, states = rollout(carry)
        pool.append(host((traj, states)))
    fresh = []
    t0 = time.perf_counter()
    for _ in range(calls + WARMUP_CALLS):
        carry, traj, states = rollout(carry)
        fresh.append((traj, states))
    jax.block_until_ready(fresh)
    rollout_ms = (time.perf_counter() - t0) / len(fresh) * 1e3
    traj0, states0 = pool[0]
    chunk_bytes = sum(a.nbytes for a in (*traj0.values(), *states0.values()))
    out: dict[str, Any] = {
        "chunk_raw_bytes": chunk_bytes,
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "compile_and_warmup_s": warmup_s,
        "rollout_ms": rollout_ms,
        "dtypes": {k: str(v.dtype) for k, v in (*traj0.items(), *states0.items())},
        "shapes": {k: list(v.shape) for k, v in (*traj0.items(), *states0.items())},
    }
    uncapped = max(1 << 30, int(chunk_bytes * (calls + 8) * 1.1))
    server = ctx.server("latency_jax")
    try:

        def phase(name: str, chunks: Any) -> None:
            rec = RolloutRecorder(
                record_states=True,
                state_fields=list(STATE_FIELDS),
                target=server.address,
                session=name.replace("_", "-"),
                worker_id=name.replace("_", "-"),
                max_bytes_in_flight=uncapped,
            )
            lat = []
            t_start = time.perf_counter_ns()
            for i, chunk in enumerate(chunks):
                traj, states = chunk() if callable(chunk) else chunk
                t0 = time.perf_counter_ns()
                rec.record(traj, states)
                t1 = time.perf_counter_ns()
                if i < WARMUP_CALLS:
                    if i == WARMUP_CALLS - 1:
                        rec.flush()
                        t_start = time.perf_counter_ns()
                    continue
                lat.append(t1 - t0)
            t_submitted = time.perf_counter_ns()
            rec.flush()
            t_done = time.perf_counter_ns()
            out[name] = {
                **latency_summary(lat),
                "max_bytes_in_flight": uncapped,
                "submit_s": (t_submitted - t_start) / 1e9,
                "drain_s": (t_done - t_submitted) / 1e9,
                "one_worker_raw_mb_s": chunk_bytes * len(lat) / MB / ((t_done - t_start) / 1e9),
                "chunks_acked": rec.stats.chunks_acked,
            }
            rec.close()

        phase("numpy_back_to_back", (pool[i % len(pool)] for i in range(calls + WARMUP_CALLS)))
        phase("jax_back_to_back", fresh)
        del fresh
        gc.collect()

        def step() -> tuple[dict, dict]:
            nonlocal carry
            carry, traj, states = rollout(carry)
            return traj, states

        phase("jax_in_loop", (step for _ in range(calls + WARMUP_CALLS)))
        out["server_vm"] = server.status()
    finally:
        server.stop()
    return out


def rows_latency_jax(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("latency_jax")
    if not r:
        return []
    mb = r["chunk_raw_bytes"] / MB
    ref = r["numpy_back_to_back"]
    ref_name = "same calls, numpy arrays"
    rows = []
    for key, label, note in (
        ("jax_back_to_back", "back-to-back, cap not reached", ""),
        (
            "jax_in_loop",
            "right after each jitted rollout call (outputs may still be computing)",
            f"the rollout ({r['rollout_ms']:.0f} ms a chunk) computes on the same CPU cores "
            "meanwhile",
        ),
    ):
        ours = r[key]
        for stat in ("p50", "p99"):
            rows.append(
                Row(
                    "record() latency",
                    f"record() {stat}, jax.Array input (jax.jit rollout on "
                    f"{r['jax_backend'].upper()}), {label}, {mb:.2f} MB chunk (n={ours['n']}"
                    + (
                        f"; {ours['over_200us']} calls > 200 us, {ours['over_1ms']} > 1 ms)"
                        if stat == "p99"
                        else ")"
                    ),
                    ours[f"{stat}_us"],
                    ref[f"{stat}_us"],
                    ref_name,
                    "us",
                    "lower",
                    note=note,
                )
            )
    return rows
