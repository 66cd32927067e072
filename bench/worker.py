"""One benchmark worker process: pre-generate chunks, wait for "go", record, report JSON.

    python bench/worker.py '{"mode": "remote", "target": "127.0.0.1:PORT", ...}'

Modes:
  remote  RolloutRecorder into a `rollout-recorder serve` process; done = flush() returned
          (with a trajectory store: and a store call answered, which waits until the store
          has recorded every acknowledged chunk)
  ray     a Ray actor wrapping the in-process factoriax recorder; done = every ref resolved
  raw     a generic gRPC bytes stream of the same uncompressed bytes; done = every ack read
  idle    `count` recorders with open streams and no data, until a line on stdin
  fleet   `recorders` RolloutRecorders driven round-robin by one thread, each keeping at most
          `window` chunks unacknowledged; reports every chunk's ack latency
  raw_fleet, steady   many small actors (fleet_worker.py)

Protocol on stdout, one JSON object a line: {"event": "ready"} once the pool is
generated and the connection is up, then (after a line on stdin)
{"event": "result", ...} with perf_counter_ns timestamps (CLOCK_MONOTONIC, so
comparable across processes on Linux).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from typing import Any

import numpy as np
from chunks import STATE_FIELDS, make_pool, store_configuration, timed_records
from fleet_worker import run_raw_fleet, run_steady


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def maxrss_bytes() -> int:
    """Peak RSS of this process image: VmHWM (ru_maxrss is inherited from the parent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def summarize_ns(samples: list[int]) -> dict[str, float]:
    if not samples:
        return {}
    arr = np.asarray(samples, dtype=np.float64) / 1e3
    return {
        "n": int(arr.size),
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "max_us": float(arr.max()),
        "mean_us": float(arr.mean()),
    }


def wait_for_go() -> None:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("no go signal (stdin closed)")


def run_remote(spec: dict[str, Any], pool: list) -> dict[str, Any]:
    from recorder_client import RolloutRecorder

    capture = None
    if spec.get("capture"):
        capture = store_configuration()
    rec = RolloutRecorder(
        record_states=True,
        state_fields=list(pool[0].state_fields),
        capture=capture,
        target=spec["target"],
        session=spec["session"],
        worker_id=spec["worker_id"],
        max_bytes_in_flight=int(spec.get("max_bytes_in_flight", 256 << 20)),
        compression_level=int(spec.get("compression_level", 1)),
    )
    rss_ready = maxrss_bytes()
    emit("ready", rss_ready=rss_ready)
    if spec.get("bursts"):
        return run_bursts(spec, pool, rec)
    wait_for_go()
    cpu0 = cpu_s()
    start = time.perf_counter_ns()
    lat = timed_records(rec, pool, spec["chunks"])
    submitted = time.perf_counter_ns()
    rec.flush()
    acked = time.perf_counter_ns()
    if capture is not None:
        # Acks do not wait for the store: a store call waits until every acknowledged chunk
        # is recorded, so the store's whole work is inside the timed run.
        rec.capture.snapshot_potential(capture.utilities[0].name, ["x", "y"])
    end = time.perf_counter_ns()
    cpu = cpu_s() - cpu0
    stats = rec.stats
    out = {
        "start_ns": start,
        "submitted_ns": submitted,
        "acked_ns": acked,
        "end_ns": end,
        "chunks": spec["chunks"],
        "raw_bytes": stats.raw_bytes,
        "wire_bytes": stats.wire_bytes,
        "chunks_acked": stats.chunks_acked,
        "dropped_in_flight": stats.chunks_dropped_in_flight,
        "record_latency": summarize_ns(lat),
        "cpu_s": cpu,
        "rss_ready": rss_ready,
        "maxrss": maxrss_bytes(),
    }
    rec.close()
    import recorder_client

    out["recorder_client"] = recorder_client.__file__
    return out


def run_bursts(spec: dict[str, Any], pool: list, rec: Any) -> dict[str, Any]:
    """On each "burst" line: record `chunks` chunks, flush, and report the bytes acked; on
    any other line, stop. The parent times the bursts."""
    done = 0
    cpu0 = cpu_s()
    while sys.stdin.readline().strip() == "burst":
        before = rec.stats.raw_bytes
        for _ in range(spec["chunks"]):
            c = pool[done % len(pool)]
            rec.record(c.rollout, c.states)
            done += 1
        rec.flush()
        emit("burst", raw_bytes=rec.stats.raw_bytes - before)
    out = {"chunks": done, "raw_bytes": rec.stats.raw_bytes, "cpu_s": cpu_s() - cpu0}
    rec.close()
    return out


def run_ray(spec: dict[str, Any], pool: list) -> dict[str, Any]:
    import logging

    import ray

    ray.init(
        address=spec["ray_address"],
        namespace=spec["ray_namespace"],
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    actor = ray.get_actor(spec["actor"], namespace=spec["ray_namespace"])
    ray.get(actor.ping.remote())
    payloads = [c.as_dicts() for c in pool]
    window = int(spec.get("window", 4))
    rss_ready = maxrss_bytes()
    emit("ready", rss_ready=rss_ready)
    wait_for_go()
    lat: list[int] = []
    refs: list[Any] = []
    cpu0 = cpu_s()
    start = time.perf_counter_ns()
    for i in range(spec["chunks"]):
        traj, states = payloads[i % len(payloads)]
        t0 = time.perf_counter_ns()
        refs.append(actor.record.remote(traj, states))
        if len(refs) >= window:
            _, refs = ray.wait(refs, num_returns=len(refs) - window + 1)
        lat.append(time.perf_counter_ns() - t0)
    submitted = time.perf_counter_ns()
    ray.get(refs)
    end = time.perf_counter_ns()
    cpu = cpu_s() - cpu0
    raw = sum(pool[i % len(pool)].raw_bytes for i in range(spec["chunks"]))
    return {
        "start_ns": start,
        "submitted_ns": submitted,
        "end_ns": end,
        "chunks": spec["chunks"],
        "raw_bytes": raw,
        "wire_bytes": None,
        "record_latency": summarize_ns(lat),
        "window": window,
        "cpu_s": cpu,
        "rss_ready": rss_ready,
        "maxrss": maxrss_bytes(),
    }


def run_raw(spec: dict[str, Any], pool: list) -> dict[str, Any]:
    import grpc

    payloads = [c.to_bytes() for c in pool]
    channel = grpc.insecure_channel(
        spec["target"],
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    grpc.channel_ready_future(channel).result(timeout=30)
    stream = channel.stream_stream("/bench.Raw/Stream")  # no (de)serializers: bytes as-is
    rss_ready = maxrss_bytes()
    emit("ready", rss_ready=rss_ready)
    wait_for_go()
    n = spec["chunks"]
    cpu0 = cpu_s()
    start = time.perf_counter_ns()

    def requests():
        for i in range(n):
            yield payloads[i % len(payloads)]

    acked = 0
    acked_bytes = 0
    for ack in stream(requests()):
        acked += 1
        acked_bytes = int(ack)
    end = time.perf_counter_ns()
    cpu = cpu_s() - cpu0
    channel.close()
    return {
        "start_ns": start,
        "submitted_ns": None,
        "end_ns": end,
        "chunks": n,
        "chunks_acked": acked,
        "raw_bytes": sum(len(payloads[i % len(payloads)]) for i in range(n)),
        "wire_bytes": acked_bytes,
        "cpu_s": cpu,
        "rss_ready": rss_ready,
        "maxrss": maxrss_bytes(),
    }


def run_idle(spec: dict[str, Any], pool: list) -> dict[str, Any]:
    """``count`` recorders that join the session and keep their Record streams open with no
    data, until the parent says stop; their threads sit in one process."""
    from concurrent.futures import ThreadPoolExecutor

    from recorder_client import RolloutRecorder

    def open_one(i: int) -> Any:
        return RolloutRecorder(
            record_states=True,
            state_fields=list(STATE_FIELDS),
            target=spec["target"],
            session=spec["session"],
            worker_id=f"idle-{i}",
            connect_timeout=120,
        )

    with ThreadPoolExecutor(16) as pool_:
        recorders = list(pool_.map(open_one, range(spec["count"])))
    emit("ready", rss_ready=maxrss_bytes())
    wait_for_go()  # "stop"
    for rec in recorders:
        rec.close()
    return {"idle": len(recorders)}


def run_fleet(spec: dict[str, Any], pool: list) -> dict[str, Any]:
    """``recorders`` workers of one session in this process (worker ids
    ``{worker_id}-{j}``), driven round-robin by this thread: each records ``chunks``
    chunks and keeps at most ``window`` of them unacknowledged.

    A chunk's ack latency runs from its record() call to the first pass of this thread
    that sees it acknowledged: `bytes_in_flight` (public, lock-free) fell by its bytes.
    Acks arrive in order on a stream, and every chunk of the pool has the same size, so
    that count names the chunk. A pass that recorded nothing and saw no ack sleeps
    `poll_s`, which bounds the measurement's resolution.
    """
    from concurrent.futures import ThreadPoolExecutor

    from recorder_client import RolloutRecorder

    sizes = {c.raw_bytes for c in pool}
    if len(sizes) != 1:
        raise ValueError(f"fleet: every chunk of the pool must have one size, got {sizes}")
    chunk_bytes = sizes.pop()
    count, n, window = int(spec["recorders"]), int(spec["chunks"]), int(spec["window"])
    poll_s = float(spec.get("poll_s", 0.001))

    def open_one(j: int) -> Any:
        return RolloutRecorder(
            record_states=True,
            state_fields=list(pool[0].state_fields),
            target=spec["target"],
            session=spec["session"],
            worker_id=f"{spec['worker_id']}-{j}",
            connect_timeout=120,
            compression_level=int(spec.get("compression_level", 1)),
        )

    with ThreadPoolExecutor(8) as threads:
        recorders = list(threads.map(open_one, range(count)))
    rss_ready = maxrss_bytes()
    emit("ready", rss_ready=rss_ready)
    wait_for_go()
    recorded = [0] * count
    acked = [0] * count
    queued_at = [[0] * n for _ in range(count)]
    record_ns: list[int] = []
    ack_ns: list[int] = []
    total = count * n
    done = 0
    cpu0 = cpu_s()
    start = time.perf_counter_ns()
    submitted = start
    while done < total:
        progressed = False
        for j, rec in enumerate(recorders):
            unacked, rest = divmod(rec.bytes_in_flight, chunk_bytes)
            if rest:
                raise RuntimeError(f"fleet: {rest} bytes in flight are not whole chunks")
            seen = recorded[j] - unacked
            if seen > acked[j]:
                now = time.perf_counter_ns()
                ack_ns.extend(now - queued_at[j][k] for k in range(acked[j], seen))
                done += seen - acked[j]
                acked[j] = seen
                progressed = True
            while recorded[j] < n and recorded[j] - acked[j] < window:
                # Each recorder starts at its own place in the pool: its chunks are distinct.
                c = pool[(j + recorded[j]) % len(pool)]
                t0 = time.perf_counter_ns()
                rec.record(c.rollout, c.states)
                submitted = time.perf_counter_ns()
                queued_at[j][recorded[j]] = t0
                record_ns.append(submitted - t0)
                recorded[j] += 1
                progressed = True
        if not progressed:
            time.sleep(poll_s)
    for rec in recorders:
        rec.flush()  # already acknowledged: raises a refusal, if any
    end = time.perf_counter_ns()
    cpu = cpu_s() - cpu0
    stats = [rec.stats for rec in recorders]
    out = {
        "start_ns": start,
        "submitted_ns": submitted,
        "acked_ns": end,
        "end_ns": end,
        "recorders": count,
        "window": window,
        "poll_s": poll_s,
        "chunks": total,
        "chunk_raw_bytes": chunk_bytes,
        "raw_bytes": sum(s.raw_bytes for s in stats),
        "wire_bytes": sum(s.wire_bytes for s in stats),
        "chunks_acked": sum(s.chunks_acked for s in stats),
        "dropped_in_flight": sum(s.chunks_dropped_in_flight for s in stats),
        "record_latency": summarize_ns(record_ns),
        "ack_latency": summarize_ns(ack_ns),
        "ack_latency_us": [round(x / 1e3) for x in ack_ns],
        "cpu_s": cpu,
        "rss_ready": rss_ready,
        "maxrss": maxrss_bytes(),
    }
    with ThreadPoolExecutor(8) as threads:
        list(threads.map(lambda rec: rec.close(), recorders))
    return out


MODES = {
    "raw_fleet": lambda spec, pool: run_raw_fleet(spec, pool, emit, wait_for_go),
    "steady": lambda spec, pool: run_steady(spec, pool, emit, wait_for_go),
    "remote": run_remote,
    "ray": run_ray,
    "raw": run_raw,
    "idle": run_idle,
    "fleet": run_fleet,
}


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        pool = (
            []
            if spec["mode"] == "idle"
            else make_pool(
                spec.get("pool", 16),
                length=spec.get("length", 128),
                num_envs=spec.get("num_envs", 256),
                seed=spec.get("seed", 0),
                done_prob=spec.get("done_prob", 1 / 500),
                frame_size=spec.get("frame_size"),
            )
        )
        result = MODES[spec["mode"]](spec, pool)
    except BaseException as exc:  # reported to the parent, which shows the log
        emit("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1
    emit("result", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
