"""The many-workers scenario: hundreds of recorders in a few processes into one server."""

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
from procs import (
    run_workers,
)

# -- many workers into one server -----------------------------------------------


def fleet_scenario(
    name: str,
    *,
    processes: int,
    recorders: int,
    num_envs: int,
    chunks: int,
    window: int,
    compare_to: str,
) -> Scenario:
    """`processes` x `recorders` workers of one session, each its own worker id and stream,
    recording `chunks` (T, num_envs) chunks with at most `window` unacknowledged (worker.py's
    `fleet` mode: one thread per process drives its recorders in turn). The row: aggregate
    MB/s against `compare_to`'s, and the ack latency of every chunk."""

    def run(ctx: Context, rep: int) -> dict[str, Any]:
        n = max(window + 1, chunks // 4) if ctx.quick else chunks
        server = ctx.server(f"{name}-{rep}")
        try:
            idle = server.status()
            cpu0 = server.cpu_s()
            specs = ingest_specs(
                ctx,
                "fleet",
                processes,
                server.address,
                recorders=recorders,
                window=window,
                chunks=n,
                pool=n,
                num_envs=num_envs,
            )
            results, go_ns, machine = run_workers(specs, ctx.tmp / f"{name}-{rep}")
            out = aggregate(ctx, results, go_ns, machine, num_envs=num_envs)
            out["server_cpu_s"] = server.cpu_s() - cpu0
            out["server_idle_vm"] = idle
            out["server_vm"] = server.status()
            out["status"] = session_status(server.address, "ingest")
        finally:
            server.stop()
        acks_ms = np.asarray([x for r in results for x in r["ack_latency_us"]]) / 1e3
        out["ack_latency"] = {
            "n": int(acks_ms.size),
            **{f"p{q}_ms": float(np.percentile(acks_ms, q)) for q in (50, 90, 99)},
            "max_ms": float(acks_ms.max()),
            "poll_s": results[0]["poll_s"],
        }
        # Workers are the recorders; `per_worker` holds one entry per process.
        out["workers"] = processes * recorders
        out["processes"] = processes
        out["chunks_per_recorder"] = n
        out["window"] = window
        out["num_envs"] = num_envs
        out["chunk_raw_bytes"] = results[0]["chunk_raw_bytes"]
        return out

    def rows(results: dict[str, dict[str, Any]]) -> list[Row]:
        r = results.get(name)
        if not r:
            return []
        other = results.get(compare_to)
        a = r["ack_latency"]
        ref = compare_to
        if other:
            ref += (
                f" (N={other['num_envs']}, {other['chunks'] // other['workers']} chunks a worker)"
            )
        return [
            Row(
                "ingest",
                f"ingest MB/s raw, {r['workers']} workers ({processes} processes x "
                f"{recorders} recorders, one thread each driving them in turn), N={num_envs}: "
                f"{r['chunk_raw_bytes'] / MB:.2f} MB chunks, {r['chunks_per_recorder']} a "
                f"worker, at most {window} unacknowledged; ack latency p50 {a['p50_ms']:.0f} "
                f"ms, p99 {a['p99_ms']:.0f} ms, max {a['max_ms']:.0f} ms (n={a['n']}: from the "
                f"record() call to the worker's next look at bytes_in_flight, every "
                f"{a['poll_s'] * 1e3:g} ms when idle)",
                r["raw_mb_s"],
                other["raw_mb_s"] if other else None,
                ref,
                "MB/s",
                "higher",
            )
        ]

    return Scenario(
        name,
        run,
        rows,
        description=f"ingest, {processes * recorders} workers "
        f"({processes} processes x {recorders} recorders), N={num_envs}",
        # Once, against the median of ingest_4w's rounds (10-11 s a run).
        repeated=False,
    )
