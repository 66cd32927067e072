"""The Reverb side of the bench's Reverb rows: a Reverb server, or a process of Reverb writers.

Runs in its own virtualenv (bench/.venv-reverb, from bench/requirements-reverb.txt: Reverb
wants TensorFlow 2.15, protobuf < 5 and numpy < 2), isolated from the project's packages:

    bench/.venv-reverb/bin/python -I bench/reverb_proc.py server '{"max_size": 4096}'
    bench/.venv-reverb/bin/python -I bench/reverb_proc.py writers '{"target": ..., ...}'

`server` prints "reverb listening on 127.0.0.1:PORT", then answers each "info" line on stdin
with the table's size as JSON (and empties the table at each "reset"), until SIGTERM or stdin
closes. `writers` speaks worker.py's protocol: {"event": "ready"} once its `threads` clients
are connected and its chunks are made, then a round at each "go" line on stdin, answered by
{"event": "result", ...} with perf_counter_ns timestamps, until stdin closes.

The chunks are worker.py's: `SyntheticVecEnv` (server/workload.py, numpy only, loaded by
path) at the same seed, T and N. Each chunk is one item, appended as one step (every array
whole, (T, N, ...)) and referenced by `create_item` over that step: one call per chunk, as
our `record()` is (`per_step`: T appends of one time step each, then an item over the last T,
as an actor stepping a vector env would). Each writer keeps at most `window` items
unconfirmed (`flush(window)`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TABLE = "chunks"


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def vhwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def make_pool(
    size: int, *, length: int, num_envs: int, seed: int, done_prob: float
) -> list[dict[str, np.ndarray]]:
    """bench/chunks.make_pool's chunks, as the arrays of each (the same generator)."""
    spec = importlib.util.spec_from_file_location("workload", REPO / "server" / "workload.py")
    assert spec is not None and spec.loader is not None
    workload = importlib.util.module_from_spec(spec)
    sys.modules["workload"] = workload  # dataclasses look their module up
    spec.loader.exec_module(workload)
    env = workload.SyntheticVecEnv(num_envs, seed=seed, done_prob=done_prob)
    pool = []
    for _ in range(size):
        rollout, states = env.collect(length)
        pool.append(
            {
                "action": rollout.action,
                "reward": rollout.reward,
                "done": rollout.done,
                "player_positions": states.player_positions,
                "player_inventory": states.player_inventory,
            }
        )
    return pool


def serve(spec: dict[str, Any]) -> int:
    import reverb

    table = reverb.Table(
        name=TABLE,
        sampler=reverb.selectors.Fifo(),
        remover=reverb.selectors.Fifo(),
        max_size=int(spec["max_size"]),
        # Sampling waits for one item; inserts never wait (no sampler runs in the bench).
        rate_limiter=reverb.rate_limiters.MinSize(1),
    )
    server = reverb.Server(tables=[table], port=None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = reverb.Client(f"127.0.0.1:{server.port}")
    print(f"reverb listening on 127.0.0.1:{server.port}", flush=True)

    def answer() -> None:
        for line in sys.stdin:
            if line.strip() == "info":
                info = client.server_info()[TABLE]
                emit("info", current_size=int(info.current_size), max_size=int(info.max_size))
            elif line.strip() == "reset":  # an empty table for the next round
                client.reset(TABLE)
                emit("reset")
        stop.set()

    threading.Thread(target=answer, daemon=True).start()
    stop.wait()
    server.stop()
    return 0


def write(spec: dict[str, Any]) -> int:
    import reverb

    threads, n = int(spec["threads"]), int(spec["chunks"])
    pool = make_pool(
        int(spec["pool"]),
        length=int(spec["length"]),
        num_envs=int(spec["num_envs"]),
        seed=int(spec["seed"]),
        done_prob=float(spec["done_prob"]),
    )
    chunk_bytes = sum(a.nbytes for a in pool[0].values())
    # Unconfirmed items a writer may keep: `window`, or as many chunks as `window_bytes` holds
    # (our client's max_bytes_in_flight).
    window = int(spec.get("window") or max(1, int(spec["window_bytes"]) // chunk_bytes))
    clients = [reverb.Client(spec["target"]) for _ in range(threads)]
    for c in clients:
        c.server_info(timeout=120)  # connected before the clock starts
    steps = int(spec["length"]) if spec.get("per_step") else 1
    writers = [c.trajectory_writer(num_keep_alive_refs=steps) for c in clients]
    from importlib.metadata import version

    versions = {d: version(d) for d in ("dm-reverb", "tensorflow", "numpy", "grpcio")}
    emit("ready", rss_ready=vhwm(), chunk_raw_bytes=chunk_bytes, versions=versions)
    # A round at each "go" line (the writers kept between a scenario's rounds), until EOF.
    while sys.stdin.readline().strip() == "go":
        emit("result", **round_of(writers, pool, n, window, steps), chunk_raw_bytes=chunk_bytes)
    for w in writers:
        w.close()
    return 0


def round_of(
    writers: list, pool: list[dict[str, np.ndarray]], n: int, window: int, steps: int
) -> dict:
    """Each writer, in a thread of its own, inserts `n` items and waits for them all. An item
    is one step of whole (T, N, ...) arrays (`steps` 1), or `steps` appends of one time step
    each (N, ...) and an item over the last `steps` (as an actor stepping a vector env)."""
    if steps > 1:
        pool = [[{k: a[t] for k, a in c.items()} for t in range(steps)] for c in pool]
    else:
        pool = [[c] for c in pool]
    spans: list[tuple[int, int]] = [(0, 0)] * len(writers)
    errors: list[str] = []

    def run(j: int) -> None:
        w = writers[j]
        try:
            start = time.perf_counter_ns()
            for i in range(n):
                # Each writer starts at its own place in the pool: its items are distinct.
                for step in pool[(j + i) % len(pool)]:
                    w.append(step)
                w.create_item(TABLE, 1.0, {k: col[-steps:] for k, col in w.history.items()})
                w.flush(block_until_num_items=window)
            w.flush()  # every item confirmed in the table
            spans[j] = (start, time.perf_counter_ns())
            w.end_episode()  # the next round starts with an empty history
        except Exception as exc:  # reported with the result
            errors.append(f"writer {j}: {type(exc).__name__}: {exc}")

    t0 = os.times()
    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = os.times()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    items = len(writers) * n
    return {
        "start_ns": min(s for s, _ in spans),
        "end_ns": max(e for _, e in spans),
        "items": items,
        "raw_bytes": items * sum(a.nbytes for step in pool[0] for a in step.values()),
        "window": window,
        "cpu_s": (t1.user + t1.system) - (t0.user + t0.system),
        "maxrss": vhwm(),
    }


def main() -> int:
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    try:
        return {"server": serve, "writers": write}[mode](spec)
    except BaseException as exc:  # reported to the parent, which shows the log
        emit("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main())
