"""The ingest scenarios: worker processes streaming into one recorder server, with a
configuration per row (store, metrics, sinks, dataset, idle streams, the previous server core,
pixels); `ingest_scenario` makes one."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from harness import (
    DATASET_FLUSH_S,
    MB,
    PREVIOUS_CORE,
    Context,
    Row,
    Scenario,
    Skipped,
    aggregate,
    dataset_drain,
    frames_proved,
    free_port,
    ingest_specs,
    serve_has_flag,
    session_status,
)
from poller import DashboardPoller
from procs import (
    BENCH_DIR,
    Child,
    DashboardServer,
    run_workers,
)

# -- (b, e) ingest into one recorder server ---------------------------------


def ingest_scenario(
    name: str,
    *,
    workers: int,
    serve_args: tuple[str, ...] = (),
    compare_to: str | None = None,
    compression_level: int = 1,
    serve_env: dict[str, str] | None = None,
    description: str = "",
    capture: bool = False,
    idle_streams: int = 0,
    previous_core: bool = False,
    pixels: bool = False,
    dashboard: bool = False,
    references: tuple[tuple[str, str], ...] | None = None,
    rows: Callable[[dict[str, dict[str, Any]]], list[Row]] | None = None,
    dataset: str | None = None,
    longer: int = 1,
    verify_lag: bool = False,
) -> Scenario:
    """`workers` processes record `ingest_chunks` chunks each into one session (`longer`
    times as many: a longer timed run, for a small cost measured beside the same).

    `serve_args` / `serve_env`: extra flags / environment for this scenario's server;
    `compare_to`: another scenario whose MB/s is this row's reference; `idle_streams`:
    that many more workers of the session hold open streams with no data throughout;
    `previous_core`: the server runs PREVIOUS_CORE's code (the workers this tree's client);
    `pixels`: the pixel workload (`Params.pixel_*`, a frames state field); `dashboard`: the
    server also serves its dashboard (`--http-listen`), polled once a second as an open page
    would; `references`: (scenario, label) pairs to compare MB/s with (default: the Ray and
    raw gRPC scenarios of as many workers); `dataset`: "local" or "s3", the server writes
    every finished episode there (`--dataset-uri`), and the run also times how long after
    the last ack the dataset holds them all; `verify_lag`: after the timed run, also how
    long until every acknowledged frame is proved to decode, and the server's CPU with it.
    """
    if references is None:
        references = (
            (f"ray_{workers}w", f"Ray actor + factoriax, {workers}w"),
            (f"raw_grpc_{workers}w", f"raw gRPC bytes stream, {workers}w"),
        )
    first_round: dict[str, Any] = {}

    def run(ctx: Context, rep: int) -> dict[str, Any]:
        env = dict(serve_env or {})
        if previous_core:
            env["PYTHONPATH"] = str(ctx.previous_core())
        if dashboard and not serve_has_flag("--http-listen"):
            raise Skipped("this server has no `serve --http-listen` (the dashboard) yet")
        extra = serve_args
        metrics_port = None
        if dataset is not None:
            if not serve_has_flag("--dataset-uri"):
                raise Skipped("this server has no `serve --dataset-uri` (the dataset sink) yet")
            if dataset == "s3":
                s3 = ctx.s3()
                env.update(s3.environment)
                uri = f"{s3.make_bucket(f'{name}-{rep}'.replace('_', '-'))}/episodes"
            else:
                uri = "{tmp}/dataset"
            metrics_port = free_port()
            extra = (
                *serve_args,
                *("--dataset-uri", uri, "--dataset-flush-seconds", str(DATASET_FLUSH_S)),
                *("--metrics-listen", f"127.0.0.1:{metrics_port}"),
            )
        server = ctx.server(f"{name}-{rep}", extra, env or None, dashboard=dashboard)
        holders = None
        poller = None
        try:
            if isinstance(server, DashboardServer):
                poller = DashboardPoller(f"http://{server.http_address}")
            if idle_streams:
                spec = {
                    "mode": "idle",
                    "target": server.address,
                    "session": "ingest",
                    "count": idle_streams,
                }
                log = ctx.tmp / f"{name}-{rep}" / "idle.log"
                holders = Child(
                    [sys.executable, str(BENCH_DIR / "worker.py"), json.dumps(spec)], log_path=log
                )
                holders.read_json("ready", 300)
            idle = server.status()
            cpu0 = server.cpu_s()
            specs = ingest_specs(
                ctx,
                "remote",
                workers,
                server.address,
                compression_level=compression_level,
                capture=capture,
                pixels=pixels,
                **({"chunks": ctx.params.ingest_chunks * longer} if longer > 1 else {}),
            )
            # The page is opened as the workers are released: a poll at the start, then
            # one a second.
            results, go_ns, machine = run_workers(
                specs,
                ctx.tmp / f"{name}-{rep}",
                on_ready=None if poller is None else lambda _: poller.start(),
            )
            out = aggregate(ctx, results, go_ns, machine, num_envs=specs[0]["num_envs"])
            out["server_cpu_s"] = server.cpu_s() - cpu0
            if verify_lag:
                # The frames acknowledged on their headers, proved in the background after
                # the last ack: how long that takes, and the server's CPU including it.
                proved = frames_proved(server.address, "ingest")
                if proved is not None:
                    out["frames_proved_s"] = proved
                    out["server_cpu_with_proof_s"] = server.cpu_s() - cpu0
            out["server_idle_vm"] = idle
            out["server_vm"] = server.status()
            out["status"] = session_status(server.address, "ingest")
            if metrics_port is not None:
                # The wait for the dataset to hold every episode is timed in the first round
                # only (5-7 s); later rounds carry that figure and are killed at once.
                if "dataset" not in first_round:
                    episodes = out["status"]["episodes_finished"]
                    cpu_before = server.cpu_s()
                    first_round["dataset"] = dataset_drain(metrics_port, episodes)
                    # The server's CPU while the backlog is written: steadier than the wall
                    # time on a machine others share.
                    first_round["dataset"]["drain_cpu_s"] = server.cpu_s() - cpu_before
                    first_round["dataset"]["round"] = rep + 1
                    # The peak through the writes of the whole backlog, against raw held.
                    first_round["dataset"]["server_vm"] = server.status()
                    first_round["dataset"]["raw_bytes"] = out["status"]["raw_bytes"]
                out["dataset"] = dict(first_round["dataset"])
                out["dataset"]["sustained_raw_mb_s"] = (
                    out["raw_bytes"] / MB / (out["wall_s"] + out["dataset"]["drain_s"])
                )
            http = ("--http-listen", "127.0.0.1:0") if dashboard else ()
            out["serve_args"] = [*extra, *http, *ctx.serve_args]
            out["serve_env"] = env
            out["idle_streams"] = idle_streams
            out["num_envs"] = specs[0]["num_envs"]
            if poller is not None:
                poller.stop()
                window = (min(r["start_ns"] for r in results), max(r["end_ns"] for r in results))
                out["dashboard"] = poller.summary(window)
                if poller.errors:
                    raise RuntimeError(f"the dashboard did not answer a poll: {poller.errors[0]}")
            return out
        finally:
            if poller is not None:
                poller.stop()
            if holders is not None:
                holders.send("stop")
                holders.read_json("result", 120)
                holders.stop()
            if dataset is not None:
                server.kill()  # a stop would write the dataset's backlog first
            else:
                server.stop()

    def default_rows(results: dict[str, dict[str, Any]]) -> list[Row]:
        r = results.get(name)
        if not r:
            return []
        label = f"{workers} worker{'s' if workers > 1 else ''}"
        if longer > 1:
            label += f", {r.get('chunks', 0) // workers} chunks each"
        if pixels:
            label += f", pixel frames (T, {r.get('num_envs')}, 84, 84) uint8"
        if capture:
            label += ", trajectory store on (2 cell fields, 1 utility)"
        if compression_level != 1:
            wire = r.get("status", {}).get("wire_bytes", 0) / 1e6
            label += f", client zstd level {compression_level} ({wire:.0f} MB on the wire)"
        if serve_args:
            label += f", serve {' '.join(serve_args)}"
        if dataset is not None:
            d = r.get("dataset", {})
            where = (
                "a local directory" if dataset == "local" else "the local S3 server (moto, nice 19)"
            )
            label += (
                f", dataset sink on: every finished episode to {where}, flushed every "
                f"{DATASET_FLUSH_S:g} s; all {d.get('episodes', 0)} episodes in the dataset "
                f"{d.get('drain_s', 0):.2f} s after the last ack, the server using "
                f"{d.get('drain_cpu_s', 0):.2f} CPU-s meanwhile (round {d.get('round', 1)})"
            )
        if dashboard:
            d = r.get("dashboard", {})
            label += (
                f", serve --http-listen, dashboard polled once a second "
                f"({d.get('polls_in_window', 0)} polls in the timed run, "
                f"{d.get('poll_ms_median') or 0:.1f} ms each)"
            )
        if serve_env:
            label += ", server env " + " ".join(f"{k}={v}" for k, v in serve_env.items())
        out = []
        if compare_to is not None:
            other = results.get(compare_to)
            out.append(
                Row(
                    "ingest",
                    f"ingest MB/s raw, {label}",
                    r["raw_mb_s"],
                    other["raw_mb_s"] if other else None,
                    compare_to,
                    "MB/s",
                    "higher",
                )
            )
            return out
        refs = [
            (ref_label, results[ref_name]["raw_mb_s"])
            for ref_name, ref_label in references
            if results.get(ref_name)
        ]
        for ref_label, ref_value in refs or [("(no baseline run)", None)]:
            out.append(
                Row(
                    "ingest",
                    f"ingest MB/s raw, {label} ({r['env_steps_s'] / 1e6:.2f} M env steps/s)",
                    r["raw_mb_s"],
                    ref_value,
                    ref_label,
                    "MB/s",
                    "higher",
                )
            )
        ours_cpu = r.get("machine", {}).get("ours_cpu_s")
        other_name, other_label = references[0] if references else ("", "")
        other = results.get(other_name)
        other_cpu = (other or {}).get("machine", {}).get("ours_cpu_s")
        if ours_cpu:
            out.append(
                Row(
                    "ingest",
                    f"ingest efficiency, {label}: MB raw per CPU-second of every process "
                    "involved (less sensitive than wall clock to other jobs on the machine)",
                    r["raw_bytes"] / MB / ours_cpu,
                    other["raw_bytes"] / MB / other_cpu if other_cpu else None,
                    other_label if other_cpu else "(no baseline run)",
                    "MB/CPU-s",
                    "higher",
                    digits=0,
                )
            )
            proof = r.get("server_cpu_with_proof_s")
            if proof is not None:
                later = proof - r["server_cpu_s"]
                out.append(
                    Row(
                        "ingest",
                        f"the same, counting the server's CPU until every acknowledged frame "
                        f"is proved to decode ({r['frames_proved_s']:.2f} s after the run, "
                        f"{later:.2f} CPU-s at nice 19)",
                        r["raw_bytes"] / MB / (ours_cpu + later),
                        other["raw_bytes"] / MB / other_cpu if other_cpu else None,
                        other_label if other_cpu else "(no baseline run)",
                        "MB/CPU-s",
                        "higher",
                        digits=0,
                    )
                )
        held = r["status"]["raw_bytes"]
        vm = r["server_vm"]
        out.append(
            Row(
                "memory",
                f"server peak RSS, {label} ({held / MB:.0f} MB raw held, "
                f"{r['status']['wire_bytes'] / MB:.0f} MB wire; RSS idle "
                f"{r['server_idle_vm'].get('VmRSS', 0) / MB:.0f} MB, at the end "
                f"{vm.get('VmRSS', 0) / MB:.0f} MB)",
                vm.get("VmHWM", 0) / MB,
                held / MB,
                "raw bytes held (what in-process keeps)",
                "MB",
                "lower",
                digits=0,
            )
        )
        return out

    return Scenario(
        name,
        run,
        rows or default_rows,
        serve_args,
        description or f"ingest, {workers} worker processes",
        dict(serve_env or {}),
        repeated=True,
    )


def rows_idle_streams(results: dict[str, dict[str, Any]]) -> list[Row]:
    r, base = results.get("ingest_4w_idle_200"), results.get("ingest_4w")
    if not r:
        return []
    return [
        Row(
            "ingest",
            f"ingest MB/s raw, 4 busy workers beside {r['idle_streams']} idle open streams "
            "(workers of the same session with no data)",
            r["raw_mb_s"],
            base["raw_mb_s"] if base else None,
            "ingest_4w (no idle streams)",
            "MB/s",
            "higher",
        )
    ]


def _mb_per_cpu_s(r: dict[str, Any] | None) -> float | None:
    cpu = (r or {}).get("machine", {}).get("ours_cpu_s")
    return r["raw_bytes"] / MB / cpu if cpu else None


def rows_previous_core(results: dict[str, dict[str, Any]]) -> list[Row]:
    ours, previous = results.get("ingest_4w"), results.get("ingest_4w_previous_core")
    if not previous:
        return []
    label = f"previous core ({PREVIOUS_CORE}: a thread per stream), 4w"
    return [
        Row(
            "ingest",
            "ingest MB/s raw, 4 workers: this server core against the previous one "
            "(same client, same run)",
            ours["raw_mb_s"] if ours else None,
            previous["raw_mb_s"],
            label,
            "MB/s",
            "higher",
        ),
        Row(
            "ingest",
            "ingest efficiency, 4 workers: MB raw per CPU-second of every process, this "
            "server core against the previous one",
            _mb_per_cpu_s(ours),
            _mb_per_cpu_s(previous),
            label,
            "MB/CPU-s",
            "higher",
            digits=0,
        ),
    ]
