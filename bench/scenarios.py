"""The benchmark scenarios: one function each, registered in `SCENARIOS`.

A scenario takes a `Context` and returns a JSON-able dict of measurements; its
`rows` function turns the results of the whole run into table rows (so a row
can compare against another scenario). New rows are a few lines: for example,

    SCENARIOS.append(ingest_scenario(
        "ingest_4w_no_wal", workers=4, serve_args=("--no-wal",), compare_to="ingest_4w"))

runs the 4-worker ingest against a server started with that flag and adds a
row "ours vs ingest_4w". `--serve-args` on the command line appends flags to
every recorder server of the run.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from chunks import FRAME_SIZE, STATE_FIELDS, make_pool
from jax_rollout import rows_latency_jax, run_latency_jax
from poller import DashboardPoller
from procs import (
    BENCH_DIR,
    Child,
    DashboardServer,
    RawGrpcServer,
    RecorderServer,
    S3Server,
    extract_code,
    machine_snapshot,
    machine_window,
    proc_cpu_s,
    run_workers,
    start_workers,
)

MB = 1e6

# The last commit of the server core that held a thread per open stream: the
# `ingest_4w_previous_core` rows run its server beside this one.
PREVIOUS_CORE = "926cf27"


@dataclass(frozen=True)
class Params:
    """Workload sizes; `quick()` gives the smoke-run sizes."""

    length: int = 128  # T
    num_envs: int = 256  # N
    done_prob: float = 1 / 500
    # Distinct chunks per worker (reused cyclically past that). As many as an ingest run
    # records: a reused done pattern would leave some envs never finishing an episode.
    pool: int = 80
    latency_calls: int = 200
    paced_calls: int = 100
    paced_sleep_s: float = 0.010
    cap_calls: int = 100
    cap_chunks: int = 4  # max_bytes_in_flight for the "at the cap" rows, in chunks
    ingest_chunks: int = 80  # per worker
    repeats: int = 5  # ingest-like runs: each repeated on a fresh server; the median is kept
    ray_window: int = 4  # outstanding actor calls per worker
    finish_episodes: int = 20_000
    finish_done_prob: float = 1 / 50
    finish_calls: int = 5  # each side; the median is compared
    # Pixel rows: N environments with a (T, N, 84, 84) uint8 frame state field (~14.6 MB a
    # chunk at T=128, N=16); every chunk of a worker distinct.
    pixel_num_envs: int = 16
    pixel_chunks: int = 16  # per worker

    def quick(self) -> Params:
        return replace(
            self,
            pool=8,
            latency_calls=60,
            paced_calls=30,
            cap_calls=30,
            ingest_chunks=20,
            repeats=1,
            finish_episodes=3_000,
            finish_calls=1,
            pixel_chunks=4,
        )


@dataclass
class Context:
    params: Params
    quick: bool
    tmp: Path  # logs and server data dirs
    serve_args: list[str]  # appended to every recorder server's flags
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    _ray: Any = None
    _previous_core: Path | None = None
    _s3: S3Server | None = None

    def s3(self) -> S3Server:
        """The local S3 server (moto), started once per run."""
        if self._s3 is None:
            self._s3 = S3Server(self.tmp / "moto.log")
        return self._s3

    def previous_core(self) -> Path:
        """PREVIOUS_CORE's packages, extracted once per run (for a server's PYTHONPATH)."""
        if self._previous_core is None:
            self._previous_core, _ = extract_code(PREVIOUS_CORE, self.tmp / "previous-core")
        return self._previous_core

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def server(
        self,
        name: str,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        *,
        dashboard: bool = False,
    ) -> RecorderServer | DashboardServer:
        """A recorder server with these flags; `dashboard`: also `--http-listen` (a port of
        its choosing, in `http_address`)."""
        d = self.tmp / name
        d.mkdir(parents=True, exist_ok=True)
        extra = tuple(a.replace("{tmp}", str(d)) for a in extra)
        kind = DashboardServer if dashboard else RecorderServer
        return kind(d / "data", [*extra, *self.serve_args], d / "server.log", env)

    def ray(self) -> Any:
        """Start Ray once per run (num_cpus=2, no dashboard); bench/ on the workers' path."""
        if self._ray is None:
            import logging
            import os

            paths = [str(BENCH_DIR), os.environ.get("PYTHONPATH", "")]
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
            import ray

            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
            self._ray = ray
        return self._ray

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.stop()
            self._s3 = None
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None


class Skipped(Exception):
    """A scenario that cannot run here (a missing optional dependency); not a failure."""


@dataclass
class Row:
    """One table row: ours next to a reference, and which direction is better."""

    section: str
    name: str
    ours: float | None
    reference: float | None
    reference_name: str
    unit: str
    better: str  # "lower" or "higher"
    digits: int = 1
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.reference in (None, 0):
            return None
        return self.ours / self.reference


@dataclass
class Scenario:
    """`run(ctx, round)` returns one run's measurements.

    A `repeated` scenario runs once per round (`Params.repeats` rounds, every
    repeated scenario in each round, so ours and the baselines take turns under
    the same background load); the run with the median MB/s is kept, with every
    run's MB/s beside it. Other scenarios run once, before the rounds.
    """

    name: str
    run: Callable[[Context, int], dict[str, Any]]
    rows: Callable[[dict[str, dict[str, Any]]], list[Row]] = lambda results: []
    serve_args: tuple[str, ...] = ()
    description: str = ""
    serve_env: dict[str, str] = field(default_factory=dict)
    repeated: bool = False
    # How a repeated scenario's rounds become its result (default: the median MB/s round).
    combine: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None


# -- helpers ----------------------------------------------------------------


def latency_summary(samples_ns: list[int]) -> dict[str, Any]:
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {
        "n": int(arr.size),
        "p50_us": float(np.percentile(arr, 50)),
        "p90_us": float(np.percentile(arr, 90)),
        "p99_us": float(np.percentile(arr, 99)),
        "max_us": float(arr.max()),
        "mean_us": float(arr.mean()),
        "over_200us": int((arr > 200).sum()),
        "over_1ms": int((arr > 1000).sum()),
        "samples_us": [round(float(x), 1) for x in arr],
    }


DATASET_FLUSH_S = 0.25


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dataset_drain(metrics_port: int, episodes: int, timeout: float = 300.0) -> dict[str, Any]:
    """Seconds until the server's dataset holds `episodes` episodes (its Prometheus counter)."""
    import urllib.request

    start = time.monotonic()
    written = 0.0
    while time.monotonic() - start < timeout:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        written = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("rollout_recorder_dataset_episodes_written_total{")
        )
        if written >= episodes:
            return {"drain_s": time.monotonic() - start, "episodes": int(written)}
        time.sleep(0.05)
    raise RuntimeError(f"the dataset holds {written:.0f} of {episodes} episodes after {timeout} s")


def frames_proved(address: str, session: str, timeout: float = 120.0) -> float | None:
    """Seconds until the server has proved every acknowledged frame of `session` decodes
    (its `Recorder/chunks_unverified` gauge reads 0); None for a server without that
    gauge (an older core, or --no-metrics)."""
    import grpc

    from recorder_client._proto import recorder_pb2 as pb
    from recorder_client._proto import recorder_pb2_grpc as pb_grpc

    key = f"Recorder/chunks_unverified/session={session}"
    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RecorderStub(channel)
        while time.monotonic() - start < timeout:
            values = stub.GetMetrics(pb.MetricsRequest(), timeout=60).values
            if key not in values:
                return None
            if values[key] == 0:
                return time.monotonic() - start
            time.sleep(0.02)
    raise RuntimeError(f"frames of {session!r} still unproved after {timeout} s")


def session_status(address: str, session: str) -> dict[str, int]:
    """GetStatus of a session, without joining it as a worker."""
    import grpc

    from recorder_client._proto import recorder_pb2 as pb
    from recorder_client._proto import recorder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.RecorderStub(channel).GetStatus(
            pb.StatusRequest(session=session), timeout=60
        )
    return {
        "raw_bytes": int(reply.raw_bytes),
        "wire_bytes": int(reply.wire_bytes),
        "chunks_stored": int(reply.chunks_stored),
        "num_recorded_steps": int(reply.num_recorded_steps),
        "episodes_finished": int(reply.episodes_finished),
    }


def worker_spec(
    ctx: Context, mode: str, i: int, *, pixels: bool = False, **extra: Any
) -> dict[str, Any]:
    """A worker's JSON spec; `pixels`: the pixel workload's sizes and frames."""
    p = ctx.params
    sizes: dict[str, Any] = {"chunks": p.ingest_chunks, "pool": p.pool, "num_envs": p.num_envs}
    if pixels:
        sizes = {
            "chunks": p.pixel_chunks,
            "pool": p.pixel_chunks,
            "num_envs": p.pixel_num_envs,
            "frame_size": FRAME_SIZE,
        }
    return {
        "mode": mode,
        "worker_id": f"w{i}",
        "seed": 1000 + i,
        "length": p.length,
        "done_prob": p.done_prob,
        **sizes,
        **extra,
    }


@functools.cache
def serve_has_flag(flag: str) -> bool:
    """Whether this code's `rollout-recorder serve` takes `flag` (per its --help)."""
    help_text = subprocess.run(
        [sys.executable, "-m", "recorder_server", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return flag in help_text


def aggregate(
    ctx: Context,
    results: list[dict[str, Any]],
    go_ns: int,
    machine: dict[str, float] | None = None,
    *,
    num_envs: int | None = None,
) -> dict[str, Any]:
    """Wall from the first record() of any worker to the last worker's end."""
    p = ctx.params
    start = min(r["start_ns"] for r in results)
    end = max(r["end_ns"] for r in results)
    wall = (end - start) / 1e9
    raw = sum(r["raw_bytes"] for r in results)
    chunks = sum(r["chunks"] for r in results)
    steps = chunks * p.length * (num_envs or p.num_envs)
    wires = [r.get("wire_bytes") for r in results]
    return {
        "workers": len(results),
        "chunks": chunks,
        "raw_bytes": raw,
        "wire_bytes": sum(wires) if all(w is not None for w in wires) else None,
        "wall_s": wall,
        "go_to_first_record_ms": (start - go_ns) / 1e6,
        # Until the last ack; with a store, the wall also waits for the store to catch up.
        "acked_wall_s": (
            (max(r["acked_ns"] for r in results) - start) / 1e9
            if all("acked_ns" in r for r in results)
            else None
        ),
        "raw_mb_s": raw / MB / wall,
        "env_steps_s": steps / wall,
        "client_cpu_s": sum(r["cpu_s"] for r in results),
        "machine": machine or {},
        "client_maxrss_max": max(r["maxrss"] for r in results),
        "client_rss_ready_max": max(r["rss_ready"] for r in results),
        "per_worker": [
            {
                "wall_s": (r["end_ns"] - r["start_ns"]) / 1e9,
                "raw_mb_s": r["raw_bytes"] / MB / ((r["end_ns"] - r["start_ns"]) / 1e9),
                "cpu_s": r["cpu_s"],
                "maxrss": r["maxrss"],
                "rss_ready": r["rss_ready"],
                "record_latency": r.get("record_latency"),
                "dropped_in_flight": r.get("dropped_in_flight"),
                "recorder_client": r.get("recorder_client"),
            }
            for r in results
        ],
    }


def median_run(runs: list[dict[str, Any]], key: str = "raw_mb_s") -> dict[str, Any]:
    """The run with the median `key` (default MB/s), with every run's MB/s (and server peak
    RSS) listed."""
    order = sorted(range(len(runs)), key=lambda i: runs[i][key])
    median = dict(runs[order[len(order) // 2]])
    median[f"runs_{key}"] = [r[key] for r in runs]
    median["runs_raw_mb_s"] = [r["raw_mb_s"] for r in runs]
    median["runs_machine_busy_cores"] = [r.get("machine", {}).get("busy_cores") for r in runs]
    if all("server_vm" in r for r in runs):
        median["runs_server_vmhwm"] = [r["server_vm"].get("VmHWM") for r in runs]
    return median


# -- (a) record() latency -----------------------------------------------------


def backpressure_kwargs(block: bool) -> dict[str, Any]:
    """Block or drop at the cap, in whichever spelling this client version takes."""
    import inspect

    from recorder_client import RolloutRecorder

    params = inspect.signature(RolloutRecorder).parameters
    if "on_backpressure" in params:
        return {"on_backpressure": "block" if block else "drop"}
    return {"block_when_full": block}


def run_latency(ctx: Context, rep: int = 0) -> dict[str, Any]:
    from reference import load_reference_recorder

    from recorder_client import RolloutRecorder

    p = ctx.params
    pool = make_pool(p.pool, length=p.length, num_envs=p.num_envs, seed=1, done_prob=p.done_prob)
    chunk_bytes = pool[0].raw_bytes
    out: dict[str, Any] = {"chunk_raw_bytes": chunk_bytes}
    server = ctx.server("latency")
    try:
        uncapped = max(1 << 30, int(chunk_bytes * (p.latency_calls + 8) * 1.1))

        def remote(session: str, **kwargs: Any) -> RolloutRecorder:
            return RolloutRecorder(
                record_states=True,
                state_fields=list(STATE_FIELDS),
                target=server.address,
                session=session,
                **{"worker_id": session, **kwargs},
            )

        # Back-to-back, the cap far away: what the caller's thread pays per call.
        rec = remote("latency", max_bytes_in_flight=uncapped)
        for c in pool[:3]:  # warm-up: connection, first-chunk schema
            rec.record(c.rollout, c.states)
        rec.flush()
        lat = []
        t_start = time.perf_counter_ns()
        for i in range(p.latency_calls):
            c = pool[i % len(pool)]
            t0 = time.perf_counter_ns()
            rec.record(c.rollout, c.states)
            lat.append(time.perf_counter_ns() - t0)
        t_submitted = time.perf_counter_ns()
        rec.flush()
        t_done = time.perf_counter_ns()
        out["remote_back_to_back"] = {
            **latency_summary(lat),
            "max_bytes_in_flight": uncapped,
            "submit_s": (t_submitted - t_start) / 1e9,
            "drain_s": (t_done - t_submitted) / 1e9,
            "one_worker_raw_mb_s": chunk_bytes * p.latency_calls / MB / ((t_done - t_start) / 1e9),
        }
        # Paced: a training step (sleep, GIL released) between calls.
        lat = []
        for i in range(p.paced_calls):
            time.sleep(p.paced_sleep_s)
            c = pool[i % len(pool)]
            t0 = time.perf_counter_ns()
            rec.record(c.rollout, c.states)
            lat.append(time.perf_counter_ns() - t0)
        rec.flush()
        out["remote_paced"] = {**latency_summary(lat), "sleep_s": p.paced_sleep_s}
        rec.close()

        # is_full and num_recorded_steps asked after each record(), as a training loop
        # does, with max_episodes set (never reached) and 3 other workers recording.
        out["counters"] = counters_latency(
            lambda name, **kw: remote("counters", **{**kw, "worker_id": name}), pool, p
        )

        # At the cap: max_bytes_in_flight of a few chunks, block (default) or drop.
        cap = chunk_bytes * p.cap_chunks
        for block in (True, False):
            name = "remote_cap_block" if block else "remote_cap_drop"
            rec = remote(
                name.replace("_", "-"), max_bytes_in_flight=cap, **backpressure_kwargs(block)
            )
            for c in pool[:2]:
                rec.record(c.rollout, c.states)
            rec.flush()
            lat = []
            t_start = time.perf_counter_ns()
            for i in range(p.cap_calls):
                c = pool[i % len(pool)]
                t0 = time.perf_counter_ns()
                rec.record(c.rollout, c.states)
                lat.append(time.perf_counter_ns() - t0)
            rec.flush()
            wall = (time.perf_counter_ns() - t_start) / 1e9
            stats = rec.stats
            out[name] = {
                **latency_summary(lat),
                "max_bytes_in_flight": cap,
                "calls": p.cap_calls,
                "dropped": stats.chunks_dropped_in_flight,
                "wall_s": wall,
            }
            rec.close()
        out["server_vm"] = server.status()
    finally:
        server.stop()

    ref_cls, _ = load_reference_recorder()
    ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS))
    for c in pool[:3]:
        ref.record(c.rollout, c.states)
    lat = []
    for i in range(p.latency_calls):
        c = pool[i % len(pool)]
        t0 = time.perf_counter_ns()
        ref.record(c.rollout, c.states)
        lat.append(time.perf_counter_ns() - t0)
    out["inprocess_back_to_back"] = latency_summary(lat)
    lat = []
    for i in range(p.paced_calls):
        time.sleep(p.paced_sleep_s)
        c = pool[i % len(pool)]
        t0 = time.perf_counter_ns()
        ref.record(c.rollout, c.states)
        lat.append(time.perf_counter_ns() - t0)
    out["inprocess_paced"] = latency_summary(lat)
    ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS), max_episodes=10**9)
    out["inprocess_counters"] = time_counters(ref, pool, p.paced_calls)
    return out


def time_counters(rec: Any, pool: list[Any], calls: int, sleep_s: float = 0.0) -> dict[str, Any]:
    """is_full and num_recorded_steps, each timed right after a record()."""
    full, steps = [], []
    for i in range(calls):
        if sleep_s:
            time.sleep(sleep_s)
        c = pool[i % len(pool)]
        rec.record(c.rollout, c.states)
        t0 = time.perf_counter_ns()
        rec.is_full  # noqa: B018
        t1 = time.perf_counter_ns()
        rec.num_recorded_steps  # noqa: B018
        steps.append(time.perf_counter_ns() - t1)
        full.append(t1 - t0)
    return {"is_full": latency_summary(full), "steps": latency_summary(steps)}


def counters_latency(make: Callable[..., Any], pool: list[Any], p: Params) -> dict[str, Any]:
    """is_full / num_recorded_steps after each record(): paced (a 10 ms step) and
    back-to-back, while 3 other workers of the session record."""
    big = 10**9
    rec = make("counters-0", max_episodes=big, max_bytes_in_flight=1 << 30)
    others = [make(f"counters-{i}", max_episodes=big) for i in (1, 2, 3)]
    stop = threading.Event()

    def other(r: Any) -> None:
        i = 0
        while not stop.is_set():
            c = pool[i % len(pool)]
            r.record(c.rollout, c.states)
            i += 1
            time.sleep(p.paced_sleep_s)

    threads = [threading.Thread(target=other, args=(r,), daemon=True) for r in others]
    out: dict[str, Any] = {}
    try:
        for t in threads:
            t.start()
        out["paced"] = time_counters(rec, pool, p.paced_calls, p.paced_sleep_s)
        rec.flush()
        out["back_to_back"] = time_counters(rec, pool, p.latency_calls)
        rec.flush()
        stop.set()
        for t in threads:
            t.join()
        for r in others:
            r.flush()
        # Exact once the others' last chunks have reached this worker (an update).
        truth = rec.status().num_recorded_steps
        waited = time.perf_counter()
        while rec.num_recorded_steps != truth and time.perf_counter() - waited < 5:
            time.sleep(0.001)
        out["caught_up_s"] = time.perf_counter() - waited
        out["exact"] = rec.num_recorded_steps == truth
    finally:
        stop.set()
        for r in [rec, *others]:
            r.close()
    return out


def rows_latency(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("latency")
    if not r:
        return []
    mb = r["chunk_raw_bytes"] / MB
    ref = "factoriax in-process record()"
    rows = []
    for key, label in (("back_to_back", "back-to-back"), ("paced", "10 ms step between calls")):
        ours, theirs = r[f"remote_{key}"], r[f"inprocess_{key}"]
        for stat in ("p50", "p99", "max"):
            rows.append(
                Row(
                    "record() latency",
                    f"record() {stat}, {label}, {mb:.2f} MB chunk (n={ours['n']}"
                    + (
                        f"; {ours['over_200us']} calls > 200 us, {ours['over_1ms']} > 1 ms)"
                        if stat == "p99"
                        else ")"
                    ),
                    ours[f"{stat}_us"],
                    theirs[f"{stat}_us"],
                    ref,
                    "us",
                    "lower",
                )
            )
    counters, ref_counters = r.get("counters"), r.get("inprocess_counters")
    if counters and ref_counters:
        for key, label in (
            ("paced", "after each record(), 10 ms step between calls"),
            ("back_to_back", "after each back-to-back record()"),
        ):
            for field, name in (("is_full", "is_full"), ("steps", "num_recorded_steps")):
                ours = counters[key][field]
                rows.append(
                    Row(
                        "counters",
                        f"{name} p99 {label}, max_episodes set, 3 other workers recording "
                        f"(n={ours['n']}; answered in the client; exact "
                        f"{counters['caught_up_s'] * 1e3:.1f} ms after the last chunk: "
                        f"{'yes' if counters['exact'] else 'NO'})",
                        ours["p99_us"],
                        ref_counters[field]["p99_us"],
                        f"factoriax in-process {name}",
                        "us",
                        "lower",
                    )
                )
    block, drop = r["remote_cap_block"], r["remote_cap_drop"]
    cap_mb = block["max_bytes_in_flight"] / MB
    for stat in ("p50", "p99"):
        rows.append(
            Row(
                "record() latency",
                f"record() {stat} at the cap ({cap_mb:.1f} MB in flight, blocking)",
                block[f"{stat}_us"],
                r["inprocess_back_to_back"][f"{stat}_us"],
                ref,
                "us",
                "lower",
                note="the caller waits for acks; shows the drain rate, not the call cost",
            )
        )
    rows.append(
        Row(
            "record() latency",
            f"record() p99 at the cap, dropping instead of blocking "
            f"({drop['dropped']}/{drop['calls']} chunks dropped)",
            drop["p99_us"],
            r["inprocess_back_to_back"]["p99_us"],
            ref,
            "us",
            "lower",
        )
    )
    return rows


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
                uri = f"{s3.bucket(f'{name}-{rep}'.replace('_', '-'))}/episodes"
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
            specs = [
                worker_spec(
                    ctx,
                    "remote",
                    i,
                    target=server.address,
                    session="ingest",
                    compression_level=compression_level,
                    capture=capture,
                    pixels=pixels,
                    **({"chunks": ctx.params.ingest_chunks * longer} if longer > 1 else {}),
                )
                for i in range(workers)
            ]
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
                    first_round["dataset"] = dataset_drain(metrics_port, episodes)
                    first_round["dataset"]["round"] = rep + 1
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
                f"{d.get('drain_s', 0):.2f} s after the last ack (round {d.get('round', 1)})"
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
                side: [
                    worker_spec(
                        ctx,
                        "remote",
                        i,
                        target=server.address,
                        session="ingest",
                        chunks=chunks,
                        bursts=True,
                    )
                    for i in range(workers)
                ]
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
            specs = [
                worker_spec(
                    ctx,
                    "fleet",
                    i,
                    target=server.address,
                    session="ingest",
                    recorders=recorders,
                    window=window,
                    chunks=n,
                    pool=n,
                    num_envs=num_envs,
                )
                for i in range(processes)
            ]
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


# -- (c) baselines: Ray actor around factoriax, raw gRPC bytes -----------------


def ray_scenario(name: str, *, workers: int) -> Scenario:
    def run(ctx: Context, rep: int) -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise Skipped("ray is not installed (pip install -r bench/requirements.txt)")
        ray = ctx.ray()
        from ray_recorder import NAMESPACE, FactoriaxRecorderActor

        actor_name = f"factoriax-recorder-{name}-{rep}"
        actor = (
            ray.remote(FactoriaxRecorderActor)
            .options(name=actor_name, namespace=NAMESPACE)
            .remote(True, list(STATE_FIELDS))
        )
        actor_pid = ray.get(actor.ping.remote(), timeout=120)
        try:
            cpu0 = proc_cpu_s(actor_pid)
            address = ray.get_runtime_context().gcs_address
            specs = [
                worker_spec(
                    ctx,
                    "ray",
                    i,
                    ray_address=address,
                    ray_namespace=NAMESPACE,
                    actor=actor_name,
                    window=ctx.params.ray_window,
                )
                for i in range(workers)
            ]
            results, go_ns, machine = run_workers(specs, ctx.tmp / f"{name}-{rep}")
            out = aggregate(ctx, results, go_ns, machine)
            out["actor_cpu_s"] = proc_cpu_s(actor_pid) - cpu0
            out["actor"] = ray.get(actor.stats.remote(), timeout=120)
            out["window"] = ctx.params.ray_window
            return out
        finally:
            ray.kill(actor)

    return Scenario(
        name, run, description=f"Ray actor wrapping factoriax, {workers} workers", repeated=True
    )


def raw_scenario(name: str, *, workers: int, pixels: bool = False) -> Scenario:
    def run(ctx: Context, rep: int) -> dict[str, Any]:
        d = ctx.tmp / f"{name}-{rep}"
        d.mkdir(parents=True, exist_ok=True)
        server = RawGrpcServer(d / "server.log")
        try:
            cpu0 = server.cpu_s()
            specs = [
                worker_spec(ctx, "raw", i, pixels=pixels, target=server.address)
                for i in range(workers)
            ]
            results, go_ns, machine = run_workers(specs, d)
            out = aggregate(ctx, results, go_ns, machine, num_envs=specs[0]["num_envs"])
            out["server_cpu_s"] = server.cpu_s() - cpu0
            out["server_vm"] = server.status()
            return out
        finally:
            server.stop()

    what = ", pixel workload" if pixels else ""
    return Scenario(
        name, run, description=f"raw gRPC bytes stream, {workers} workers{what}", repeated=True
    )


# -- (d) finish() ---------------------------------------------------------------


def run_finish(ctx: Context, rep: int = 0) -> dict[str, Any]:
    from reference import load_reference_recorder

    from recorder_client import RolloutRecorder

    p = ctx.params
    per_chunk = p.length * p.num_envs * p.finish_done_prob
    n_chunks = math.ceil(p.finish_episodes / per_chunk * 1.03)
    pool = make_pool(
        n_chunks, length=p.length, num_envs=p.num_envs, seed=7, done_prob=p.finish_done_prob
    )
    raw = sum(c.raw_bytes for c in pool)
    dones = int(sum(int(c.rollout.done.sum()) for c in pool))
    out: dict[str, Any] = {"chunks": n_chunks, "raw_bytes": raw, "done_flags": dones}
    calls = ctx.params.finish_calls
    ref_cls, _ = load_reference_recorder()
    ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS))
    for c in pool:
        ref.record(c.rollout, c.states)
    server = ctx.server("finish")
    try:
        rec = RolloutRecorder(
            record_states=True,
            state_fields=list(STATE_FIELDS),
            target=server.address,
            session="finish",
            worker_id="finish",
            max_bytes_in_flight=max(1 << 30, int(raw * 1.1)),
        )
        for c in pool:
            rec.record(c.rollout, c.states)
        rec.flush()
        out["server_vm_before"] = server.status()
        # Equality first, once, untimed; then only the timed calls, each result freed
        # before the next call so neither side pays for the other's 1 GB of arrays.
        ours, theirs = rec.finish(), ref.finish()
        check = compare_results(ours, theirs)
        del ours, theirs
        gc.collect()
        # Remote and in-process calls alternate, so both see the same background load.
        remote_s: list[float] = []
        inprocess_s: list[float] = []
        busy: list[dict[str, float]] = []
        for _ in range(calls):
            for side, times in (("remote", remote_s), ("inprocess", inprocess_s)):
                cpu0 = machine_snapshot()
                t0 = time.perf_counter_ns()
                got = rec.finish() if side == "remote" else ref.finish()
                times.append((time.perf_counter_ns() - t0) / 1e9)
                busy.append({"side": side, **machine_window(cpu0, machine_snapshot(), times[-1])})
                del got
                gc.collect()
        out["server_vm_after"] = server.status()
        out["status"] = session_status(server.address, "finish")
        rec.close()
    finally:
        server.stop()
    out["remote_runs_s"] = remote_s
    out["inprocess_runs_s"] = inprocess_s
    out["machine"] = busy
    out["remote_s"] = float(np.median(remote_s))
    out["inprocess_s"] = float(np.median(inprocess_s))
    out.update(check)
    del ref
    gc.collect()
    return out


def compare_results(ours: Any, theirs: Any) -> dict[str, Any]:
    """Equality of the remote and in-process results, field by field."""
    from reference import reference_arrays

    ref_fields = reference_arrays(theirs)
    our_fields = ours.fields
    mismatches = []
    if set(ref_fields) != set(our_fields):
        mismatches.append(f"fields {sorted(our_fields)} vs {sorted(ref_fields)}")
    for key in sorted(set(ref_fields) & set(our_fields)):
        a, b = our_fields[key], ref_fields[key]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            mismatches.append(f"{key}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
    return {
        "matched": not mismatches,
        "mismatches": mismatches,
        "episodes": int(ours.num_episodes),
        "max_length": int(ours.max_length),
        "result_bytes": int(sum(a.nbytes for a in our_fields.values())),
    }


def rows_finish(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("finish")
    if not r:
        return []
    return [
        Row(
            "finish()",
            f"finish() s (median of {len(r['remote_runs_s'])}), {r['episodes']:,} episodes "
            f"x T_max {r['max_length']} "
            f"({r['result_bytes'] / MB:.0f} MB result; equal: {'yes' if r['matched'] else 'NO'})",
            r["remote_s"],
            r["inprocess_s"],
            "factoriax in-process finish()",
            "s",
            "lower",
            digits=2,
        )
    ]


# -- server CPU per chunk, in process (low noise) -------------------------------


def run_server_cpu(ctx: Context, rep: int = 0) -> dict[str, Any]:
    """Server-side CPU per chunk of the ingest path (decode, validate, split, log, feed),
    with and without metrics / store, in this process: no network and no other process
    in the measurement, so a few percent are visible. Variants alternate in rounds."""
    import tempfile

    from chunks import STATE_FIELDS as FIELDS
    from chunks import store_configuration

    from recorder_client._messages import array_to_proto
    from recorder_client._proto import recorder_pb2 as pb
    from recorder_server.chunks import SessionConfig
    from recorder_server.metrics import MetricsConfig, MetricsTracker, NullMetrics, WriteGate
    from recorder_server.rpc.convert import chunk_from_proto
    from recorder_server.session import Session
    from recorder_server.sessions import ServiceLimits

    p = ctx.params
    pool = make_pool(p.pool, length=p.length, num_envs=p.num_envs, seed=3, done_prob=p.done_prob)
    chunks = []
    for i, c in enumerate(pool):
        # Encoded as the client encodes for this server (integer arrays packed).
        msg = pb.Chunk(sequence=i + 1)
        msg.action.CopyFrom(array_to_proto(c.rollout.action, pack=True))
        msg.reward.CopyFrom(array_to_proto(c.rollout.reward, pack=True))
        msg.done.CopyFrom(array_to_proto(c.rollout.done, pack=True))
        for name in FIELDS:
            msg.states.append(
                pb.NamedArray(name=name, array=array_to_proto(getattr(c.states, name), pack=True))
            )
        chunks.append(msg)
    capture = store_configuration()
    tmp = Path(tempfile.mkdtemp(dir=ctx.tmp))

    def variants() -> dict[str, Any]:
        sinks = MetricsConfig(
            tensorboard_dir=str(tmp / "tb"),
            jsonl_path=str(tmp / "m.jsonl"),
            tensorboard_gate=WriteGate(1.0),
            jsonl_gate=WriteGate(1.0),
        )
        return {
            "no_metrics": (NullMetrics, None),
            "metrics": (MetricsTracker, None),
            "metrics_all_sinks": (lambda: MetricsTracker(sinks), None),
            "store_on": (MetricsTracker, capture),
        }

    limits = ServiceLimits()

    def once(make_metrics, cap) -> float:
        metrics = make_metrics()
        config = SessionConfig(None, True, tuple(FIELDS), cap)
        session = Session("cpu", config, metrics)
        session.join("w", config)
        start = time.process_time()
        for msg in chunks:
            # As the servicer takes a chunk: headers checked at the edge, then the core.
            session.apply("w", chunk_from_proto(msg, limits), log=False)
        session.drain()
        # The proof that every acknowledged frame decodes is the server's work too (a
        # thread at nice 19, or the first reader): counted whole, whoever does it.
        session.verify(c for tl in session.workers.values() for c in tl.chunks)
        used = time.process_time() - start
        session.close()
        metrics.close()
        return used / len(chunks) * 1e3

    rounds = 3 if ctx.quick else 7
    ms: dict[str, list[float]] = {name: [] for name in variants()}
    for _ in range(rounds):
        for name, (make_metrics, cap) in variants().items():
            ms[name].append(once(make_metrics, cap))
    out = {name: float(np.median(v)) for name, v in ms.items()}
    out["rounds"] = {name: v for name, v in ms.items()}
    out["chunks"] = len(chunks)
    return out


def rows_server_cpu(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("server_cpu")
    if not r:
        return []
    base = r["no_metrics"]
    rows = [
        Row(
            "server CPU",
            f"server CPU ms per chunk, metrics on (in process, median of {len(r['rounds']['metrics'])})",
            r["metrics"],
            base,
            "same, --no-metrics",
            "ms",
            "lower",
            digits=2,
        ),
        Row(
            "server CPU",
            "server CPU ms per chunk, Prometheus registry + TensorBoard + JSONL sinks",
            r["metrics_all_sinks"],
            base,
            "same, --no-metrics",
            "ms",
            "lower",
            digits=2,
        ),
        Row(
            "server CPU",
            "server CPU ms per chunk, trajectory store on (2 cell fields, 1 utility)",
            r["store_on"],
            r["metrics"],
            "same, store off",
            "ms",
            "lower",
            digits=2,
        ),
    ]
    return rows


# -- the registry ---------------------------------------------------------------
# SCENARIOS run by default, in this order (repeated ones in interleaved rounds).
# OPTIONAL_SCENARIOS run only when named: `--only NAME` or `--with NAME`.

SCENARIOS: list[Scenario] = [
    Scenario("latency", run_latency, rows_latency, description="record() caller latency"),
    Scenario(
        "latency_jax",
        run_latency_jax,
        rows_latency_jax,
        description="record() caller latency with jax.Array input from a jax.jit rollout (CPU)",
    ),
    Scenario("finish", run_finish, rows_finish, description="finish() on >= 20k episodes"),
    Scenario(
        "server_cpu",
        run_server_cpu,
        rows_server_cpu,
        description="server CPU per chunk with/without metrics and store, in process",
    ),
    ingest_scenario("ingest_1w", workers=1),
    ingest_scenario("ingest_4w", workers=4, verify_lag=True),
    ingest_scenario("ingest_8w", workers=8),
    fleet_scenario(
        "ingest_256w",
        processes=8,
        recorders=32,
        num_envs=16,
        chunks=10,
        window=2,
        compare_to="ingest_4w",
    ),
    raw_scenario("raw_grpc_1w", workers=1),
    raw_scenario("raw_grpc_4w", workers=4),
    ray_scenario("ray_1w", workers=1),
    ray_scenario("ray_4w", workers=4),
    ray_scenario("ray_8w", workers=8),
    # Configuration rows, each compared with ingest_4w (the defaults: no store, metrics on,
    # write-ahead log with fsync "batch"); the dashboard row with its no-metrics twin.
    ingest_scenario(
        "ingest_4w_store_on",
        workers=4,
        capture=True,
        compare_to="ingest_4w",
        description="ingest, 4 workers, trajectory store on (2 cell fields, 1 utility)",
    ),
    ingest_scenario(
        "ingest_4w_no_metrics",
        workers=4,
        serve_args=("--no-metrics",),
        compare_to="ingest_4w",
        description="ingest, 4 workers, server keeping no metrics",
    ),
    # Metrics and dashboard against --no-metrics: two servers fed in turns, a fraction of a
    # second each, so that both see the same background load (the cost is smaller than the
    # load's swings between rounds run one after the other).
    side_by_side_scenario("ingest_4w_dashboard_turns", workers=4, bursts=16, chunks=16),
    ingest_scenario(
        "ingest_4w_dataset_local",
        workers=4,
        dataset="local",
        compare_to="ingest_4w",
        description="ingest, 4 workers, dataset sink writing Parquet to a local directory",
    ),
    ingest_scenario(
        "ingest_4w_dataset_s3",
        workers=4,
        dataset="s3",
        compare_to="ingest_4w",
        description="ingest, 4 workers, dataset sink writing Parquet to a local S3 server",
    ),
    ingest_scenario(
        "ingest_4w_idle_200",
        workers=4,
        idle_streams=200,
        rows=rows_idle_streams,
        description="ingest, 4 busy workers beside 200 workers holding open streams, no data",
    ),
    ingest_scenario(
        "ingest_4w_previous_core",
        workers=4,
        previous_core=True,
        rows=rows_previous_core,
        description=f"ingest, 4 workers, into the previous server core ({PREVIOUS_CORE})",
    ),
    # The pixel workload: a (T, N, 84, 84) uint8 frame state field, against the same bytes
    # over the raw gRPC stream.
    ingest_scenario(
        "ingest_4w_pixels",
        workers=4,
        pixels=True,
        references=(("raw_grpc_4w_pixels", "raw gRPC bytes stream, pixel workload, 4w"),),
        description="ingest, 4 workers, pixel workload (84x84 uint8 frames)",
    ),
    raw_scenario("raw_grpc_4w_pixels", workers=4, pixels=True),
]

OPTIONAL_SCENARIOS: list[Scenario] = [
    # The same cost, measured one server after the other (3x the chunks, several polls a
    # run); the default row above feeds both at once.
    ingest_scenario(
        "ingest_4w_no_metrics_long",
        workers=4,
        serve_args=("--no-metrics",),
        longer=3,
        compare_to="ingest_4w",
        description="ingest, 4 workers, 3x the chunks, server keeping no metrics",
    ),
    ingest_scenario(
        "ingest_4w_dashboard",
        workers=4,
        dashboard=True,
        longer=3,
        compare_to="ingest_4w_no_metrics_long",
        description="ingest, 4 workers, 3x the chunks, metrics on and the dashboard polled "
        "once a second",
    ),
    # Configuration rows without a target, each beside ingest_4w (`--with` names them;
    # they kept the full run over 10 minutes on a busy day).
    ingest_scenario(
        "ingest_4w_all_sinks",
        workers=4,
        serve_args=(
            "--metrics-listen",
            "127.0.0.1:0",
            "--tensorboard-dir",
            "{tmp}/tb",
            "--metrics-jsonl",
            "{tmp}/metrics.jsonl",
        ),
        compare_to="ingest_4w",
        description="ingest, 4 workers, Prometheus + TensorBoard + JSONL sinks on",
    ),
    ingest_scenario(
        "ingest_4w_fsync_always",
        workers=4,
        serve_args=("--wal-fsync", "always"),
        compare_to="ingest_4w",
        description="ingest, 4 workers, write-ahead log fsync before every ack",
    ),
    ingest_scenario(
        "ingest_4w_fsync_never",
        workers=4,
        serve_args=("--wal-fsync", "never"),
        compare_to="ingest_4w",
        description="ingest, 4 workers, write-ahead log without fsync",
    ),
    ingest_scenario(
        "ingest_4w_no_wal",
        workers=4,
        serve_args=("--no-wal",),
        compare_to="ingest_4w",
        description="ingest, 4 workers, no write-ahead log at all",
    ),
    # Diagnostic: does glibc's malloc keep the server's freed decode buffers? (same code,
    # only the server's environment differs; compare the memory rows with ingest_4w).
    ingest_scenario(
        "ingest_4w_mmap_threshold",
        workers=4,
        serve_env={"MALLOC_MMAP_THRESHOLD_": "131072"},
        description="ingest, 4 workers, server with a fixed glibc mmap threshold",
    ),
    # Diagnostic: faster zstd levels on the client (more bytes on the wire, less CPU on
    # both sides); compare with ingest_4w (level 1).
    *(
        ingest_scenario(
            f"ingest_4w_level_{name}",
            workers=4,
            compression_level=level,
            compare_to="ingest_4w",
            description=f"ingest, 4 workers, client zstd level {level}",
        )
        for name, level in (("m1", -1), ("m3", -3), ("m7", -7))
    ),
]
