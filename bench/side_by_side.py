"""The metrics and dashboard costs measured side by side: three servers up at once (metrics
with the dashboard polled, metrics alone, --no-metrics), fed in turns."""

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
    """Three servers up at once, `workers` workers on each: "on", metrics on and its
    dashboard polled once a second (as an open page would); "metrics", metrics on and no
    dashboard; "off", --no-metrics. Their workers take turns, a burst at a time (`chunks`
    chunks each, then a flush), in the order ABC CBA CBA ABC ..., `bursts` bursts a side;
    each side's MB/s is its bytes over the summed wall time of its bursts.

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
            servers["metrics"] = ctx.server(f"{name}-metrics-{rep}", ())
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
            # ABC CBA CBA ABC ...: a linear drift in the load, or the first burst's warm-up,
            # falls on every side alike; which side runs in the middle rotates by round.
            sides3 = ["on", "metrics", "off"]
            first = sides3[rep % 3 :] + sides3[: rep % 3]
            pattern = [first, first[::-1], first[::-1], first]
            order = [side for k in range(bursts) for side in pattern[k % 4]]
            wall = dict.fromkeys(servers, 0.0)
            raw = dict.fromkeys(servers, 0)
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
            out["metrics_cost"] = 1 - out["metrics"]["raw_mb_s"] / out["off"]["raw_mb_s"]
            cpu = {side: out[side]["server_cpu_s"] / out[side]["raw_bytes"] for side in servers}
            out["server_cpu_per_byte_ratio"] = cpu["on"] / cpu["off"]
            out["metrics_server_cpu_per_byte_ratio"] = cpu["metrics"] / cpu["off"]
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
        metrics_costs = ", ".join(f"{c:+.3f}" for c in r.get("runs_metrics_cost", []))
        metrics_cpu = ", ".join(
            f"{c:.2f}" for c in r.get("runs_metrics_server_cpu_per_byte_ratio", [])
        )
        rows = []
        if "metrics_raw_mb_s" in both:
            rows += [
                Row(
                    "ingest",
                    f"ingest MB/s raw, {workers} workers, metrics on (no dashboard), in turns "
                    f"with a --no-metrics server and the dashboard row's server: {bursts} "
                    f"bursts of {chunks} chunks a worker on each side, in each of "
                    f"{both['rounds']} rounds, all together (each round's cost "
                    f"{metrics_costs})",
                    both["metrics_raw_mb_s"],
                    both["off_raw_mb_s"],
                    f"the --no-metrics server, in turns, {workers}w",
                    "MB/s",
                    "higher",
                ),
                Row(
                    "server CPU",
                    "server CPU per raw byte, metrics against --no-metrics, in turns "
                    f"(median round; each round {metrics_cpu})",
                    r["metrics_server_cpu_per_byte_ratio"],
                    1.0,
                    "--no-metrics",
                    "x",
                    "lower",
                    digits=2,
                ),
            ]
        return rows + [
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
            for side in ("on", "metrics", "off")
        }
        out["all_rounds"] = {
            "on_raw_mb_s": mb_s["on"],
            "metrics_raw_mb_s": mb_s["metrics"],
            "off_raw_mb_s": mb_s["off"],
            "cost": 1 - mb_s["on"] / mb_s["off"],
            "metrics_cost": 1 - mb_s["metrics"] / mb_s["off"],
            "rounds": len(runs),
        }
        for key in ("metrics_cost", "server_cpu_per_byte_ratio"):
            out[f"runs_{key}"] = [r[key] for r in runs]
        out["runs_metrics_server_cpu_per_byte_ratio"] = [
            r["metrics_server_cpu_per_byte_ratio"] for r in runs
        ]
        return out

    return Scenario(
        name,
        run,
        rows,
        description=f"ingest, {workers} workers, metrics with the dashboard, and metrics "
        "alone, in turns with a --no-metrics server",
        repeated=True,
        combine=combine,
    )
