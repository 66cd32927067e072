"""The metrics-and-dashboard cost measured side by side: two servers up at once, one with
metrics and its dashboard polled, one with --no-metrics, fed in turns."""

from __future__ import annotations

import time
from typing import Any

from harness import (
    MB,
    Context,
    Row,
    Scenario,
    Skipped,
    ingest_specs,
    median_run,
    serve_has_flag,
)
from poller import DashboardPoller
from procs import (
    Child,
    DashboardServer,
    RecorderServer,
    machine_snapshot,
    machine_window,
    start_workers,
)


def side_by_side_scenario(name: str, *, workers: int, bursts: int, chunks: int) -> Scenario:
    """Two servers up at once, `workers` workers on each: one with metrics on and its
    dashboard polled once a second (as an open page would), one with --no-metrics. Their
    workers take turns, a burst at a time (`chunks` chunks each, then a flush), in the order
    ABBA BAAB ..., `bursts` bursts a side; each side's MB/s is its bytes over the summed
    wall time of its bursts.

    Load from other jobs changes over seconds, and by more than this cost between rounds
    run one after the other; bursts a fraction of a second long, in turns, see the same
    load. The page polls only while its server's workers run. The round kept is the one
    with the median cost.
    """

    def run(ctx: Context, rep: int) -> dict[str, Any]:
        if not serve_has_flag("--http-listen"):
            raise Skipped("this server has no `serve --http-listen` (the dashboard) yet")
        servers: dict[str, RecorderServer] = {}
        children: list[Child] = []
        poller = None
        try:
            servers["off"] = ctx.server(f"{name}-off-{rep}", ("--no-metrics",))
            on = ctx.server(f"{name}-on-{rep}", (), dashboard=True)
            servers["on"] = on
            assert isinstance(on, DashboardServer)
            poller = DashboardPoller(f"http://{on.http_address}")
            specs = {
                side: ingest_specs(
                    ctx, "remote", workers, server.address, chunks=chunks, bursts=True
                )
                for side, server in servers.items()
            }
            sides: dict[str, list[Child]] = {}
            for side in servers:
                sides[side] = start_workers(specs[side], ctx.tmp / f"{name}-{rep}" / side)
                children += sides[side]
            for w in children:
                w.read_json("ready", 300)
            poller.pause()
            poller.start()
            # ABBA BAAB ...: a drift in the load, or the first burst's warm-up, falls on
            # both sides alike.
            first = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
            pattern = [first, first[::-1], first[::-1], first]
            order = [side for k in range(bursts) for side in pattern[k % 4]]
            wall = {"on": 0.0, "off": 0.0}
            raw = {"on": 0, "off": 0}
            cpu0 = {side: server.cpu_s() for side, server in servers.items()}
            machine0 = machine_snapshot()
            t_start = time.perf_counter_ns()
            for side in order:
                if side == "on":
                    poller.resume()
                t0 = time.perf_counter_ns()
                for w in sides[side]:
                    w.send("burst")
                raw[side] += sum(w.read_json("burst", 120)["raw_bytes"] for w in sides[side])
                wall[side] += (time.perf_counter_ns() - t0) / 1e9
                poller.pause()
            window = (time.perf_counter_ns() - t_start) / 1e9
            machine = machine_window(machine0, machine_snapshot(), window)
            poller.stop()
            if poller.errors:
                raise RuntimeError(f"the dashboard did not answer a poll: {poller.errors[0]}")
            out: dict[str, Any] = {"bursts": bursts, "chunks": chunks, "machine": machine}
            for side, server in servers.items():
                out[side] = {
                    "raw_bytes": raw[side],
                    "wall_s": wall[side],
                    "raw_mb_s": raw[side] / MB / wall[side],
                    "server_cpu_s": server.cpu_s() - cpu0[side],
                }
            out["dashboard"] = poller.summary()
            out["order"] = order
            out["raw_mb_s"] = out["on"]["raw_mb_s"]
            out["cost"] = 1 - out["on"]["raw_mb_s"] / out["off"]["raw_mb_s"]
            on_cpu = out["on"]["server_cpu_s"] / out["on"]["raw_bytes"]
            off_cpu = out["off"]["server_cpu_s"] / out["off"]["raw_bytes"]
            out["server_cpu_per_byte_ratio"] = on_cpu / off_cpu
            for side in sides:
                for w in sides[side]:
                    w.send("stop")
                for w in sides[side]:
                    w.read_json("result", 120)
            return out
        finally:
            if poller is not None:
                poller.stop()
            for w in children:
                w.stop()
            for server in servers.values():
                server.stop()

    def rows(results: dict[str, dict[str, Any]]) -> list[Row]:
        r = results.get(name)
        if not r:
            return []
        d = r.get("dashboard", {})
        both = r["all_rounds"]
        costs = ", ".join(f"{c:+.3f}" for c in r.get("runs_cost", []))
        cpu = ", ".join(f"{c:.2f}" for c in r.get("runs_server_cpu_per_byte_ratio", []))
        return [
            Row(
                "ingest",
                f"ingest MB/s raw, {workers} workers, metrics on and the dashboard polled once "
                f"a second, in turns with a --no-metrics server: {bursts} bursts of {chunks} "
                f"chunks a worker on each side, in each of {both['rounds']} rounds, all "
                f"together (each round's cost {costs}; median round {r['cost']:+.3f}, "
                f"{d.get('polls', 0)} polls of {d.get('poll_ms_median') or 0:.1f} ms)",
                both["on_raw_mb_s"],
                both["off_raw_mb_s"],
                f"the --no-metrics server, in turns, {workers}w",
                "MB/s",
                "higher",
            ),
            Row(
                "server CPU",
                "server CPU per raw byte, metrics + dashboard against --no-metrics, in turns "
                f"(median round; each round {cpu})",
                r["server_cpu_per_byte_ratio"],
                1.0,
                "--no-metrics",
                "x",
                "lower",
                digits=2,
            ),
        ]

    def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
        """The median-cost round, and the cost over every round's bursts together."""
        out = median_run(runs, "cost")
        mb_s = {
            side: sum(r[side]["raw_bytes"] for r in runs)
            / MB
            / sum(r[side]["wall_s"] for r in runs)
            for side in ("on", "off")
        }
        out["all_rounds"] = {
            "on_raw_mb_s": mb_s["on"],
            "off_raw_mb_s": mb_s["off"],
            "cost": 1 - mb_s["on"] / mb_s["off"],
            "rounds": len(runs),
        }
        out["runs_server_cpu_per_byte_ratio"] = [r["server_cpu_per_byte_ratio"] for r in runs]
        return out

    return Scenario(
        name,
        run,
        rows,
        description=f"ingest, {workers} workers, metrics and dashboard on, in turns with a "
        "--no-metrics server",
        repeated=True,
        combine=combine,
    )
