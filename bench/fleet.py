"""Many small actors: hundreds of recorders in a few processes into one server.

`ingest_256w`: 256 workers (8 processes x 32 recorders) send small chunks as fast as their
acks allow, in turns with a bare gRPC server fed the same RecordRequest bytes over 256
streams (bench/raw_server.py --aio). `fleet_steady`: a ladder of fleets, each worker
sending one small chunk a second; the ack latency and the server's cores at each size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from harness import (
    MB,
    Context,
    Row,
    Scenario,
    aggregate,
    ingest_specs,
    session_status,
)
from procs import RawGrpcServer, run_workers


def _acks(results: list[dict[str, Any]]) -> dict[str, float]:
    acks_ms = np.asarray([x for r in results for x in r["ack_latency_us"]]) / 1e3
    return {
        "n": int(acks_ms.size),
        **{f"p{q}_ms": float(np.percentile(acks_ms, q)) for q in (50, 90, 99)},
        "max_ms": float(acks_ms.max()),
        "poll_s": results[0]["poll_s"],
    }


class CpuAtGo:
    """The server's CPU seconds when every worker is ready (joined, streams open): each
    side's CPU per chunk counts the chunks' own work, not the joins before them."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.value = 0.0

    def mark(self, _workers: Any) -> None:
        self.value = self.server.cpu_s()


def _measured(ctx, results, go_ns, machine, server, cpu0, num_envs) -> dict[str, Any]:
    out = aggregate(ctx, results, go_ns, machine, num_envs=num_envs)
    out["server_cpu_s"] = server.cpu_s() - cpu0
    out["server_vm"] = server.status()
    out["chunks_s"] = out["chunks"] / out["wall_s"]
    out["server_cpu_ms_per_chunk"] = out["server_cpu_s"] / out["chunks"] * 1e3
    out["ack_latency"] = _acks(results)
    out["chunk_raw_bytes"] = results[0]["chunk_raw_bytes"]
    for r in results:  # every sample is in ack_latency; the per-process lists are noise here
        r.pop("ack_latency_us", None)
    return out


def fleet_scenario(
    name: str,
    *,
    processes: int,
    recorders: int,
    num_envs: int,
    chunks: int,
    window: int,
    rounds: int = 2,
) -> Scenario:
    """`processes` x `recorders` workers of one session, each its own worker id and stream,
    recording `chunks` (T, num_envs) chunks with at most `window` unacknowledged (worker.py's
    `fleet` mode: one thread per process drives its recorders in turn), in `rounds` turns
    with the raw gRPC server fed the same bytes by as many streams (one thread each). The
    round with the median chunk rate is kept on each side."""

    def drive(ctx: Context, mode: str, server: Any, d: Any, n: int) -> dict[str, Any]:
        # Both sides: the same workers (worker.py's `mode`), server CPU counted from the go.
        specs = ingest_specs(
            ctx,
            mode,
            processes,
            server.address,
            recorders=recorders,
            window=window,
            chunks=n,
            pool=n,
            num_envs=num_envs,
        )
        cpu0 = CpuAtGo(server)
        results, go_ns, machine = run_workers(specs, d, on_ready=cpu0.mark)
        return _measured(ctx, results, go_ns, machine, server, cpu0.value, num_envs)

    def ours(ctx: Context, tag: str, n: int) -> dict[str, Any]:
        server = ctx.server(tag)
        try:
            idle = server.status()
            out = drive(ctx, "fleet", server, ctx.tmp / tag, n)
            out["server_idle_vm"] = idle
            out["status"] = session_status(server.address, "ingest")
        finally:
            server.stop()
        return out

    def raw(ctx: Context, tag: str, n: int) -> dict[str, Any]:
        d = ctx.tmp / tag
        d.mkdir(parents=True, exist_ok=True)
        server = RawGrpcServer(d / "server.log", aio=True)
        try:
            return drive(ctx, "raw_fleet", server, d, n)
        finally:
            server.stop()

    def run(ctx: Context, rep: int) -> dict[str, Any]:
        n = max(window + 1, chunks // 4) if ctx.quick else chunks
        turns: dict[str, list[dict[str, Any]]] = {"ours": [], "raw": []}
        for k in range(1 if ctx.quick else rounds):
            turns["raw"].append(raw(ctx, f"{name}-raw-{rep}-{k}", n))
            turns["ours"].append(ours(ctx, f"{name}-{rep}-{k}", n))
        mid = {
            side: sorted(v, key=lambda r: r["chunks_s"])[len(v) // 2] for side, v in turns.items()
        }
        out = dict(mid["ours"])
        out["reference"] = mid["raw"]
        out["rounds_chunks_s"] = [r["chunks_s"] for r in turns["ours"]]
        out["reference_rounds_chunks_s"] = [r["chunks_s"] for r in turns["raw"]]
        out["workers"] = processes * recorders
        out["processes"] = processes
        out["chunks_per_recorder"] = n
        out["window"] = window
        out["num_envs"] = num_envs
        return out

    def rows(results: dict[str, dict[str, Any]]) -> list[Row]:
        r = results.get(name)
        if not r:
            return []
        ref, a, b = r["reference"], r["ack_latency"], r["reference"]["ack_latency"]
        what = (
            f"{r['workers']} workers ({processes} processes x {recorders} recorders, one "
            f"thread each driving them in turn), N={num_envs}: {r['chunk_raw_bytes'] / MB:.2f} "
            f"MB chunks, {r['chunks_per_recorder']} a worker, at most {window} unacknowledged"
        )
        reference = (
            f"bare gRPC server (aio), the same RecordRequest bytes on {r['workers']} streams"
        )
        rounds = ", ".join(f"{x:.0f}" for x in r["rounds_chunks_s"])
        ref_rounds = ", ".join(f"{x:.0f}" for x in r["reference_rounds_chunks_s"])
        return [
            Row(
                "ingest",
                f"small chunks a second, {what}; ack latency p50 {a['p50_ms']:.0f} ms, p99 "
                f"{a['p99_ms']:.0f} ms (bare server: {b['p50_ms']:.0f} / {b['p99_ms']:.0f} "
                f"ms); each turn {rounds} (bare {ref_rounds})",
                r["chunks_s"],
                ref["chunks_s"],
                reference,
                "chunks/s",
                "higher",
                digits=0,
            ),
            Row(
                "ingest",
                f"server CPU-ms per small chunk, {what}",
                r["server_cpu_ms_per_chunk"],
                ref["server_cpu_ms_per_chunk"],
                reference,
                "ms",
                "lower",
                digits=3,
            ),
        ]

    return Scenario(
        name,
        run,
        rows,
        description=f"ingest, {processes * recorders} workers "
        f"({processes} processes x {recorders} recorders), N={num_envs}, beside a bare gRPC "
        "server",
    )


def steady_scenario(
    name: str,
    *,
    fleets: tuple[int, ...],
    processes: int,
    length: int,
    num_envs: int,
    period_s: float,
    seconds: float,
    bound_ms: float,
) -> Scenario:
    """For each fleet size: a fresh server, `processes` processes sharing the workers, each
    worker recording one (length, num_envs) chunk every `period_s` for `seconds`. Each size
    gives the ack latency and the server's CPU-s per s; the largest fleet with ack p99 within
    `bound_ms` is quoted."""

    def one(ctx: Context, tag: str, workers: int, seconds: float) -> dict[str, Any]:
        server = ctx.server(tag)
        try:
            specs = [
                {
                    **spec,
                    "recorders": workers // processes,
                    "phase": i / processes,
                }
                for i, spec in enumerate(
                    ingest_specs(
                        ctx,
                        "steady",
                        processes,
                        server.address,
                        length=length,
                        num_envs=num_envs,
                        period_s=period_s,
                        seconds=seconds,
                        pool=8,
                        chunks=0,
                    )
                )
            ]
            cpu0 = CpuAtGo(server)
            results, go_ns, machine = run_workers(specs, ctx.tmp / tag, on_ready=cpu0.mark)
            out = _measured(ctx, results, go_ns, machine, server, cpu0.value, num_envs)
        finally:
            server.stop()
        out["workers"] = workers
        out["offered_chunks_s"] = workers / period_s
        # Fewer than planned: the workers fell behind and stopped at twice the planned time.
        out["chunks_planned"] = sum(r["chunks_planned"] for r in results)
        out["server_cores"] = out["server_cpu_s"] / out["wall_s"]
        # On a small machine the fleet's own processes are the first limit.
        out["client_cores"] = out["client_cpu_s"] / out["wall_s"]
        out["record_late_p99_ms"] = max(r["late_p99_ms"] for r in results)
        return out

    def run(ctx: Context, rep: int) -> dict[str, Any]:
        secs = seconds / 2 if ctx.quick else seconds
        sizes = fleets[:1] if ctx.quick else fleets
        out: dict[str, Any] = {f"w{w}": one(ctx, f"{name}-{w}", w, secs) for w in sizes}
        within = [w for w in sizes if out[f"w{w}"]["ack_latency"]["p99_ms"] <= bound_ms]
        out["largest_within_bound"] = max(within) if within else 0
        out["bound_ms"] = bound_ms
        return out

    def rows(results: dict[str, dict[str, Any]]) -> list[Row]:
        r = results.get(name)
        if not r:
            return []
        out = []
        for w in fleets:
            f = r.get(f"w{w}")
            if f is None:
                continue
            a = f["ack_latency"]
            out.append(
                Row(
                    "ingest",
                    f"steady fleet, {w} workers ({processes} processes) each recording one "
                    f"T={length}, N={num_envs} chunk every {period_s:g} s for {seconds:g} s: "
                    f"ack latency p50 {a['p50_ms']:.1f} ms, p99 {a['p99_ms']:.1f} ms, max "
                    f"{a['max_ms']:.0f} ms (n={a['n']} of {f['chunks_planned']} planned); "
                    f"{f['chunks_s']:.0f} chunks/s; the workers' processes used "
                    f"{f['client_cores']:.2f} CPU-s/s; largest "
                    f"fleet with p99 <= {bound_ms:g} ms: {r['largest_within_bound']}",
                    f["server_cores"],
                    1.0,
                    "one core",
                    "CPU-s/s",
                    "lower",
                    digits=2,
                )
            )
        return out

    return Scenario(
        name,
        run,
        rows,
        description=f"steady fleets of {'/'.join(map(str, fleets))} workers, one T={length}, "
        f"N={num_envs} chunk a second each",
    )
