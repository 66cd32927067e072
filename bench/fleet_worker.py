"""Worker modes for many small actors (worker.py dispatches to them).

raw_fleet  `recorders` gRPC bytes streams to bench/raw_server.py, one thread each, each
           sending the RecordRequest bytes a recorder would send (zstd level 1, packed
           integers), at most `window` unacknowledged; every ack's latency
steady     `recorders` RolloutRecorders, each recording one chunk every `period_s` for
           `seconds` (their phases spread over the period), driven by one thread; every
           chunk's ack latency
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from chunks import Chunk


def request_bytes(chunk: Chunk, sequence: int) -> bytes:
    """The serialized RecordRequest a RolloutRecorder sends for this chunk."""
    from recorder_client._pending import PendingChunk, encode_chunk

    arrays = {
        "action": chunk.rollout.action,
        "reward": chunk.rollout.reward,
        "done": chunk.rollout.done,
        **{f"state:{n}": getattr(chunk.states, n) for n in chunk.state_fields},
    }
    item = PendingChunk(sequence, chunk.raw_bytes, arrays)
    return encode_chunk(item, 1, pack=True).SerializeToString()


def run_raw_fleet(
    spec: dict[str, Any], pool: list[Chunk], emit: Callable[..., None], wait: Callable
) -> dict[str, Any]:
    import grpc

    count, n, window = int(spec["recorders"]), int(spec["chunks"]), int(spec["window"])
    payloads = [request_bytes(c, i + 1) for i, c in enumerate(pool)]
    opts = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    channels = [grpc.insecure_channel(spec["target"], options=opts) for _ in range(count)]
    for ch in channels:
        grpc.channel_ready_future(ch).result(timeout=60)
    go = threading.Event()
    ack_ns: list[list[int]] = [[] for _ in range(count)]
    wire = [0] * count
    errors: list[BaseException] = []

    def one(j: int) -> None:
        slots = threading.Semaphore(window)
        sent_at: list[int] = []

        def requests():
            for k in range(n):
                slots.acquire()
                sent_at.append(time.perf_counter_ns())
                yield payloads[(j + k) % len(payloads)]

        try:
            stream = channels[j].stream_stream("/bench.Raw/Stream")
            go.wait()
            for k, ack in enumerate(stream(requests())):
                ack_ns[j].append(time.perf_counter_ns() - sent_at[k])
                wire[j] = int(ack)
                slots.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(j,), daemon=True) for j in range(count)]
    for t in threads:
        t.start()
    emit("ready", rss_ready=0)
    wait()
    cpu0 = _cpu_s()
    start = time.perf_counter_ns()
    go.set()
    for t in threads:
        t.join()
    end = time.perf_counter_ns()
    if errors:
        raise errors[0]
    for ch in channels:
        ch.close()
    lat = [x for per in ack_ns for x in per]
    return {
        "start_ns": start,
        "submitted_ns": None,
        "acked_ns": end,
        "end_ns": end,
        "recorders": count,
        "window": window,
        "chunks": count * n,
        "chunks_acked": len(lat),
        "chunk_raw_bytes": pool[0].raw_bytes,
        "raw_bytes": count * n * pool[0].raw_bytes,
        "wire_bytes": sum(wire),
        "ack_latency_us": [round(x / 1e3) for x in lat],
        "poll_s": 0.0,
        "cpu_s": _cpu_s() - cpu0,
        "rss_ready": 0,
        "maxrss": 0,
    }


def run_steady(
    spec: dict[str, Any], pool: list[Chunk], emit: Callable[..., None], wait: Callable
) -> dict[str, Any]:
    """Recorder j records its k-th chunk at go + (k + j / count) * period_s; a chunk's ack
    latency runs from its record() call to the first look at `bytes_in_flight` that finds
    it acknowledged (looks every `poll_s` while any chunk is in flight)."""
    from concurrent.futures import ThreadPoolExecutor

    from recorder_client import RolloutRecorder

    count, period = int(spec["recorders"]), float(spec["period_s"])
    n = max(1, round(float(spec["seconds"]) / period))
    poll_s = float(spec.get("poll_s", 0.001))
    chunk_bytes = pool[0].raw_bytes

    def open_one(j: int) -> Any:
        return RolloutRecorder(
            record_states=True,
            state_fields=list(pool[0].state_fields),
            target=spec["target"],
            session=spec["session"],
            worker_id=f"{spec['worker_id']}-{j}",
            connect_timeout=120,
        )

    with ThreadPoolExecutor(8) as threads:
        recorders = list(threads.map(open_one, range(count)))
    emit("ready", rss_ready=0)
    wait()
    # Every process starts its clock at the same go line; phases spread within each one.
    cpu0 = _cpu_s()
    start = time.perf_counter_ns()
    period_ns = int(period * 1e9)
    phase = float(spec.get("phase", 0.0))  # this process's offset, a fraction of a slot
    due = [start + int((j + phase) * period_ns / count) for j in range(count)]
    recorded = [0] * count
    acked = [0] * count
    queued_at: dict[tuple[int, int], int] = {}
    inflight: set[int] = set()
    ack_ns: list[int] = []
    late_ns: list[int] = []
    total, done, next_j = count * n, 0, 0
    # A fleet the machine cannot keep up with stops recording at twice its planned time.
    cutoff = start + 2 * n * period_ns
    while done < total:
        now = time.perf_counter_ns()
        if now > cutoff and next_j < total:
            total = next_j
        while next_j < total and due[next_j % count] <= now:
            j = next_j % count
            c = pool[(j + recorded[j]) % len(pool)]
            t0 = time.perf_counter_ns()
            late_ns.append(t0 - due[j])
            recorders[j].record(c.rollout, c.states)
            queued_at[(j, recorded[j])] = t0
            recorded[j] += 1
            due[j] += period_ns
            inflight.add(j)
            next_j += 1
        for j in list(inflight):
            unacked = recorders[j].bytes_in_flight // chunk_bytes
            seen = recorded[j] - unacked
            if seen > acked[j]:
                t = time.perf_counter_ns()
                ack_ns.extend(t - queued_at.pop((j, k)) for k in range(acked[j], seen))
                done += seen - acked[j]
                acked[j] = seen
            if not unacked:
                inflight.discard(j)
        wake = due[next_j % count] if next_j < total else now + int(poll_s * 1e9)
        nap = (wake - time.perf_counter_ns()) / 1e9
        time.sleep(max(0.0, min(poll_s, nap) if inflight else nap))
    end = time.perf_counter_ns()
    cpu = _cpu_s() - cpu0
    stats = [rec.stats for rec in recorders]
    with ThreadPoolExecutor(8) as threads:
        list(threads.map(lambda rec: rec.close(), recorders))
    return {
        "start_ns": start,
        "acked_ns": end,
        "end_ns": end,
        "recorders": count,
        "chunks": total,
        "chunks_planned": count * n,
        "chunks_acked": sum(s.chunks_acked for s in stats),
        "chunk_raw_bytes": chunk_bytes,
        "raw_bytes": sum(s.raw_bytes for s in stats),
        "wire_bytes": sum(s.wire_bytes for s in stats),
        "ack_latency_us": [round(x / 1e3) for x in ack_ns],
        "late_p99_ms": sorted(late_ns)[int(0.99 * (len(late_ns) - 1))] / 1e6,
        "poll_s": poll_s,
        "cpu_s": cpu,
        "rss_ready": 0,
        "maxrss": 0,
    }


def _cpu_s() -> float:
    import os

    t = os.times()
    return t.user + t.system
