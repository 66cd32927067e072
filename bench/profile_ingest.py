"""`bench/run.py --profile`: a 4-worker ingest with py-spy attached to the server and a worker.

Four py-spy samplers (`--nonblocking --threads -f raw`): the server and worker 0,
each once for every active thread and once with `--gil` (only the thread that
holds the GIL). Samples are summed by thread, by stage (stack patterns below)
and by leaf function. py-spy is a bench-only dependency (`pip install py-spy`).
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import Context, aggregate, ingest_specs, session_status
from procs import Child, run_workers

RATE = 200  # samples per second

# (stage, substrings of a py-spy stack (short file names); the first stage with a match wins).
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("client: zstd encode", ("encode_chunk", "array_to_proto")),
    ("client: record() caller", ("RolloutRecorder.record", "run_remote")),
    ("server: decode + validate chunk", ("decode_chunk", "chunk_from_proto", "decode_into")),
    (
        "server: episode feeder (store, metrics)",
        ("feeder.py", "tails.py", "window.py", "held.py", "buffers.py"),
    ),
    ("server: episode split, session", ("add_chunk", "session.py", "episodes.py")),
    ("server: WAL / checkpoint", ("wal.py", "checkpoint.py", "records.py", "files.py")),
    (
        "server: store / metrics",
        (
            "processor.py",
            "cells.py",
            "archive.py",
            "repository.py",
            "tracker.py",
            "model.py",
            "gating.py",
            "sinks.py",
        ),
    ),
    ("gRPC Python layer (send, receive, polling)", ("_channel.py", "_server.py", "_common.py")),
    ("client: sender thread (acks, queue)", ("_stream.py",)),
]
NATIVE = "native code, no Python frame (gRPC core threads)"
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def classify(stack: str) -> str:
    if ";" not in stack:
        return NATIVE
    for stage, patterns in STAGES:
        if any(p in stack for p in patterns):
            return stage
    return "other"


def summarize(path: Path, wall_s: float) -> dict[str, Any]:
    by_thread: collections.Counter[str] = collections.Counter()
    by_stage: collections.Counter[str] = collections.Counter()
    by_leaf: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        text = path.read_text()
    except OSError:
        return {"error": f"no profile at {path}"}
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        thread = thread.rstrip("0123456789_-") or thread
        total += count
        by_thread[thread] += count
        by_stage[classify(stack)] += count
        match = _FRAME.match(frames[-1]) if len(frames) > 1 else None
        leaf = f"{match['func']} ({match['file']})" if match else NATIVE
        by_leaf[leaf] += count
    return {
        "samples": total,
        "seconds_sampled": total / RATE,
        "share_of_wall": total / RATE / wall_s if wall_s else None,
        "by_thread": dict(by_thread.most_common()),
        "by_stage": dict(by_stage.most_common()),
        "top_leaf": dict(by_leaf.most_common(10)),
    }


def profile_ingest(ctx: Context, workers: int = 4) -> dict[str, Any]:
    exe = py_spy()
    if exe is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    d = ctx.tmp / "profile"
    d.mkdir(parents=True, exist_ok=True)
    server = ctx.server("profile")
    spies: list[tuple[str, subprocess.Popen, Path]] = []

    def attach(children: list[Child]) -> None:
        for label, pid, gil in (
            ("server", server.pid, False),
            ("server_gil", server.pid, True),
            ("worker0", children[0].pid, False),
            ("worker0_gil", children[0].pid, True),
        ):
            out = d / f"{label}.txt"
            argv = [exe, "record", "--pid", str(pid), "--rate", str(RATE), "--nonblocking"]
            argv += ["--threads", "-f", "raw", "-o", str(out), *(["--gil"] if gil else [])]
            log = open(d / f"{label}.log", "w")  # noqa: SIM115 - closed with the process
            spies.append((label, subprocess.Popen(argv, stdout=log, stderr=log), out))
        time.sleep(2.0)  # let every sampler attach before the clock starts

    try:
        specs = ingest_specs(ctx, "remote", workers, server.address)
        results, go_ns, machine = run_workers(specs, d, on_ready=attach)
        agg = aggregate(ctx, results, go_ns, machine)
        agg["status"] = session_status(server.address, "ingest")
    finally:
        for _, spy, _ in spies:
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)
        for _, spy, _ in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        server.stop()
    wall = agg["wall_s"]
    return {
        "workers": workers,
        "rate_hz": RATE,
        "ingest": {k: v for k, v in agg.items() if k != "per_worker"},
        "profiles": {label: summarize(out, wall) for label, _, out in spies},
        "note": "py-spy samples Python threads only; time inside C (zstd, gRPC core, memcpy) "
        "is attributed to the Python frame that called it. The *_gil profiles count only "
        "samples where that thread held the GIL.",
    }


def profile_markdown(prof: dict[str, Any]) -> list[str]:
    if "error" in prof:
        return [f"Profile: {prof['error']}", ""]
    ing = prof["ingest"]
    lines = [
        f"py-spy profile of a {prof['workers']}-worker ingest (`bench/run.py --profile`, "
        f"{prof.get('timestamp', '?')}; {prof['rate_hz']} Hz; {ing['raw_mb_s']:.0f} MB/s raw "
        f"under the profiler, wall {ing['wall_s']:.2f} s). Seconds of samples by stage "
        "(share of the ingest wall; a process can exceed 1.0 with several busy threads):",
        "",
        "| Stage | " + " | ".join(prof["profiles"]) + " |",
        "|---|" + "---:|" * len(prof["profiles"]),
    ]
    stages = [s for s, _ in STAGES] + [NATIVE, "other"]
    wall = ing["wall_s"]
    for stage in stages:
        cells = []
        for summary in prof["profiles"].values():
            n = summary.get("by_stage", {}).get(stage, 0)
            cells.append(
                f"{n / prof['rate_hz']:.2f} s ({n / prof['rate_hz'] / wall:.2f})" if n else ""
            )
        if any(cells):
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    totals = []
    for summary in prof["profiles"].values():
        share = summary.get("share_of_wall") or 0
        totals.append(f"**{summary.get('seconds_sampled', 0):.2f} s ({share:.2f})**")
    lines.append("| total | " + " | ".join(totals) + " |")
    lines.append("")
    for label, summary in prof["profiles"].items():
        top = ", ".join(
            f"`{k}` {v / prof['rate_hz']:.2f}s"
            for k, v in list(summary.get("top_leaf", {}).items())[:6]
        )
        lines.append(f"- {label} leaf frames: {top}")
    lines += ["", prof["note"], ""]
    return lines
