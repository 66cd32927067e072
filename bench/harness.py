"""What every benchmark scenario shares: the workload sizes (`Params`), the run's `Context`,
a table `Row`, the `Scenario` record the registry in `scenarios` lists, and the helpers that
start workers and read a server's status, metrics and proof state.

The bottom layer of the bench's scenario modules: each scenario family imports it, and it
imports none of them.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from chunks import FRAME_SIZE
from moto_s3 import S3Server
from procs import (
    BENCH_DIR,
    DashboardServer,
    RecorderServer,
    extract_code,
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
    paced_sleep_s: float = 0.010  # the counters rows' step between calls
    # record() paced: a training step of 5 ms between calls, as many calls as
    # back to back so that p99 is not the second-largest of 100.
    record_step_s: float = 0.005
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
    _kept: dict[str, Any] = field(default_factory=dict)

    def kept(self, key: str, start: Callable[[], Any]) -> Any:
        """What `start()` returns, made once per run under `key` (processes a repeated
        scenario keeps between its rounds); its `close()` is called by `drop` or at the end."""
        if key not in self._kept:
            self._kept[key] = start()
        return self._kept[key]

    def drop(self, key: str) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            kept.close()

    def s3(self) -> S3Server:
        """The local S3 server (moto), started once per run."""
        if self._s3 is None:
            self._s3 = S3Server(log_path=self.tmp / "moto.log", niceness=19, access_key="bench")
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
        for key in list(self._kept):
            self.drop(key)
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


def ingest_specs(
    ctx: Context, mode: str, count: int, target: str, **extra: Any
) -> list[dict[str, Any]]:
    """The specs of ``count`` workers w0, w1, ... recording to session "ingest" at ``target``."""
    return [
        worker_spec(ctx, mode, i, target=target, session="ingest", **extra) for i in range(count)
    ]


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
