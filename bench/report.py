"""Machine facts, the targets (bench/targets.toml), and the markdown written to bench/RESULTS.md."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import platform
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import MB, Row
from procs import REPO

# -- machine ----------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine_info() -> dict[str, Any]:
    dirty = _git("status", "--porcelain")
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_total_bytes": _mem_total(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {
            name: _version(name)
            for name in (
                "numpy",
                "grpcio",
                "protobuf",
                "zstandard",
                "ray",
                "factoriax",
                "rollout-recorder",
            )
        },
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty_paths": len(dirty.splitlines()) if dirty else 0,
        "loadavg_start": loadavg(),
    }


# -- targets ------------------------------------------------------------------------

TARGETS_FILE = Path(__file__).resolve().parent / "targets.toml"
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


@dataclass(frozen=True)
class Target:
    """One entry of bench/targets.toml."""

    text: str
    value: str  # arithmetic over `scenario.key.key` paths into the run's results
    op: str  # ">=" or "<="
    threshold: float
    unit: str

    def measure(self, results: dict[str, Any]) -> float | None:
        """The value on these results; None when a scenario or key is missing."""
        try:
            return float(_evaluate(ast.parse(self.value, mode="eval").body, results))
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    def evaluate(self, results: dict[str, Any]) -> dict[str, Any]:
        value = self.measure(results)
        if value is None:
            verdict = "n/a"
        elif self.op == ">=":
            verdict = "PASS" if value >= self.threshold else "MISS"
        else:
            verdict = "PASS" if value <= self.threshold else "MISS"
        return {
            "target": self.text,
            "value": value,
            "op": self.op,
            "threshold": self.threshold,
            "unit": self.unit,
            "verdict": verdict,
            "source": self.value,
        }


def _evaluate(node: ast.expr, results: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.Name):
        return results[node.id]
    if isinstance(node, ast.Attribute):
        return _evaluate(node.value, results)[node.attr]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, results)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, results), _evaluate(node.right, results))
    raise ValueError(f"targets.toml: unsupported expression {ast.unparse(node)!r}")


def load_targets(path: Path = TARGETS_FILE) -> list[Target]:
    """The targets of bench/targets.toml, each checked: ValueError names a bad entry."""
    with path.open("rb") as f:
        entries = tomllib.load(f).get("target", [])
    targets = []
    for i, entry in enumerate(entries):
        try:
            target = Target(**entry)
        except TypeError as exc:
            raise ValueError(f"{path.name}: target {i + 1}: {exc}") from None
        if target.op not in (">=", "<="):
            raise ValueError(
                f"{path.name}: {target.text!r}: op must be >= or <=, got {target.op!r}"
            )
        target.measure({})  # parses the expression; unsupported syntax raises ValueError
        targets.append(target)
    return targets


# -- markdown -------------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _ratio(row: Row) -> str:
    ratio = row.ratio
    if ratio is None:
        return "—"
    good = ratio >= 1 if row.better == "higher" else ratio <= 1
    return f"{ratio:.2f}x {'(better)' if good else '(worse)'}"


def rows_table(rows: list[Row]) -> list[str]:
    lines = [
        "| Section | Row | Ours | Reference | Ref. value | Ratio ours/ref | Better |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for row in rows:
        unit = f" {row.unit}"
        lines.append(
            f"| {row.section} | {row.name} | {_num(row.ours, row.digits)}{unit} | "
            f"{row.reference_name} | {_num(row.reference, row.digits)}"
            f"{unit if row.reference is not None else ''} | {_ratio(row)} | {row.better} |"
        )
    return lines


def targets_table(verdicts: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| Target | Measured | Threshold | Result |",
        "|---|---:|---:|---|",
    ]
    for v in verdicts:
        digits = 2 if v["unit"] == "x" else 1
        lines.append(
            f"| {v['target']} | {_num(v['value'], digits)} {v['unit']} | "
            f"{v['op']} {v['threshold']:g} {v['unit']} | **{v['verdict']}** |"
        )
    return lines


def cpu_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Where CPU went during each ingest-like run (the median run of each scenario)."""
    cores = len(os.sched_getaffinity(0))
    lines = [
        "| Run | Wall s | MB/s raw | Server CPU s | Clients CPU s | All our processes: "
        f"busy cores | Machine: busy cores of {cores} (+ stolen by the hypervisor) | "
        "MB raw per CPU-s (all ours) | "
        "Server CPU s/GB | Clients CPU s/GB | Wire/raw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if "wall_s" not in r or "client_cpu_s" not in r:
            continue
        gb = r["raw_bytes"] / 1e9
        server = r.get("server_cpu_s", r.get("actor_cpu_s"))
        label = name if "actor_cpu_s" not in r else f"{name} (server = the Ray actor)"
        machine = r.get("machine", {})
        ours_cpu = machine.get("ours_cpu_s")
        wire = r.get("wire_bytes")
        if r.get("status"):
            wire = r["status"]["wire_bytes"]
        wire_txt = f"{wire / r['raw_bytes']:.3f}" if wire else "—"
        machine_txt = _num(machine.get("busy_cores"), 2)
        if machine.get("steal_cores"):
            machine_txt += f" (+{machine['steal_cores']:.2f} stolen)"
        lines.append(
            f"| {label} | {r['wall_s']:.2f} | {r['raw_mb_s']:.0f} | "
            f"{_num(server, 2)} | {r['client_cpu_s']:.2f} | "
            f"{_num(machine.get('ours_busy_cores'), 2)} | {machine_txt} | "
            f"{_num(r['raw_bytes'] / MB / ours_cpu if ours_cpu else None, 0)} | "
            f"{_num(None if server is None else server / gb, 2)} | "
            f"{r['client_cpu_s'] / gb:.2f} | {wire_txt} |"
        )
    return lines


def render_markdown(doc: dict[str, Any], rows: list[Row], extra_sections: list[str]) -> str:
    m = doc["machine"]
    v = m["versions"]
    results = doc["results"]
    params = doc["params"]
    dirty = f" + {m['git_dirty_paths']} uncommitted paths" if m["git_dirty_paths"] else ""
    code = doc.get("code", {})
    if code.get("commit"):
        code_text = f"Code measured: {code['source']}."
    else:
        code_text = f"Code measured: the working tree at commit `{m['git_commit'][:12]}`{dirty}."
    lines = [
        "# Rollout Recorder benchmarks",
        "",
        f"Generated by `bench/run.py{' --quick' if doc['quick'] else ''}` at {doc['timestamp']} "
        f"in {doc['elapsed_s']:.0f} s. Raw numbers: `bench/results/{doc['file']}` "
        "(and `latest.json`; neither committed). Regenerated by every full run; do not edit by hand.",
        "",
        f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable cores of {m['cpu_count']}, "
        f"{m['mem_total_bytes'] / 2**30:.0f} GiB; {m['platform']}; Python {m['python']}; "
        f"numpy {v['numpy']}, grpcio {v['grpcio']}, protobuf {v['protobuf']}, "
        f"zstandard {v['zstandard']}, ray {v['ray']}, factoriax {v['factoriax']}. "
        f"{code_text} "
        f"Load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')} "
        "(a shared machine: other jobs can move these numbers).",
        "",
        "Workload (the statistics of `recorder_server.workload.SyntheticVecEnv`, the demo's "
        f"environment): T={params['length']}, N={params['num_envs']}; int32 actions in [0, 12), "
        "float32 rewards 2% non-zero, done p=1/500; `player_positions` int32 (T, N, 1, 2) "
        "random walk on 64x64; `player_inventory` int32 (T, N, 1, 16) slowly increasing counts; "
        f"{results.get('latency', {}).get('chunk_raw_bytes', 2654208) / MB:.2f} MB raw per chunk, "
        f"{params['pool']} distinct pre-generated chunks per worker reused cyclically; "
        f"{params['ingest_chunks']} chunks per worker for ingest. "
        + (
            f"Pixel rows: the same at N={params['pixel_num_envs']} plus a `frames` state field "
            f"(T, N, 84, 84) uint8 (a tiled grey map, the player, an inventory bar), "
            f"{params['pixel_chunks']} distinct chunks per worker. "
            if "pixel_chunks" in params
            else ""
        )
        + "Servers and workers are separate "
        "processes on this machine; ours compresses with zstd level 1.",
        "",
        "## Targets",
        "",
        *targets_table(doc["targets"]),
        "",
        "## Side by side",
        "",
        "Ratio is ours / reference; the Better column says which direction wins for that row.",
        "",
        *rows_table(rows),
        "",
        "How each row is measured:",
        "",
        "- **record() latency**: `time.perf_counter_ns()` around `record()` only, in one "
        "process, against a `rollout-recorder serve` process on 127.0.0.1; back-to-back "
        "calls (the background encoder competes for the GIL) and with a 10 ms sleep between "
        "calls (a training step that releases the GIL). The cap rows use "
        "`max_bytes_in_flight` of a few chunks.",
        f"- **ingest** ({params['repeats']} interleaved rounds: every ingest, Ray and raw-gRPC "
        "scenario once per round, a fresh server each time; the median round is shown, every "
        "round is in the details): "
        "worker processes pre-generate their chunks, connect, wait at a barrier; "
        "wall = first `record()` of any worker to the last worker's `flush()` returning "
        "(everything acknowledged); with a trajectory store, to the last worker's store call "
        "answering after its flush (`snapshot_potential`, which waits until the store has "
        "recorded every acknowledged chunk: acks do not wait for the store). "
        "Ray: each worker process is a Ray driver calling "
        f"`actor.record.remote(traj_dict, states_dict)` with at most {params['ray_window']} "
        "outstanding refs, done when all refs resolved; the actor wraps factoriax's "
        "in-process recorder (`ray.init(num_cpus=2, include_dashboard=False)`). Raw gRPC: the "
        "same uncompressed bytes (pre-joined, one message per chunk) over a generic "
        "stream-stream method with identity (de)serialisers, acked per message.",
        "- **finish()**: one worker records enough chunks at done p=1/50 for >= 20,000 "
        "episodes into a fresh server; the same chunks go into factoriax in-process; each "
        "`finish()` is timed once (remote includes streaming the result back); the arrays are "
        "compared for equality afterwards, outside the timed region.",
        "- **memory**: server VmHWM from /proc after the ingest run, against the raw bytes the "
        "session holds (`status().raw_bytes`, which an in-process recorder would keep as "
        "arrays).",
        "",
        *extra_sections,
    ]
    return "\n".join(lines) + "\n"


def details_section(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["## Details", ""]
    for name, r in results.items():
        if name.startswith(("ingest", "ray", "raw_grpc")) and "per_worker" in r:
            rss = r["client_maxrss_max"] / MB
            ready = r["client_rss_ready_max"] / MB
            extra = ""
            if "status" in r:
                st = r["status"]
                extra = (
                    f"; server idle RSS {r['server_idle_vm'].get('VmRSS', 0) / MB:.0f} MB, "
                    f"peak {r['server_vm'].get('VmHWM', 0) / MB:.0f} MB; held raw "
                    f"{st['raw_bytes'] / MB:.0f} MB / wire {st['wire_bytes'] / MB:.0f} MB "
                    f"(peak RSS = {r['server_vm'].get('VmHWM', 0) / max(st['raw_bytes'], 1):.3f}x "
                    f"raw, {r['server_vm'].get('VmHWM', 0) / max(st['wire_bytes'], 1):.2f}x wire)"
                )
            if "actor" in r:
                extra = f"; actor VmHWM {r['actor'].get('VmHWM', 0) / MB:.0f} MB"
            lat = [w.get("record_latency") or {} for w in r["per_worker"]]
            p99 = max((x.get("p99_us", 0) for x in lat), default=0)
            p50 = max((x.get("p50_us", 0) for x in lat), default=0)
            lat_txt = (
                f"; caller p50/p99 per call (worst worker) {p50:.0f}/{p99:.0f} us" if p99 else ""
            )
            per = ", ".join(f"{w['raw_mb_s']:.0f}" for w in r["per_worker"])
            rounds = ", ".join(f"{x:.0f}" for x in r.get("runs_raw_mb_s", []))
            busy_runs = ", ".join(
                "?" if x is None else f"{x:.2f}" for x in r.get("runs_machine_busy_cores", [])
            )
            extra += f"; MB/s of each round {rounds} (machine busy cores {busy_runs})"
            lines.append(
                f"- `{name}`: {r['workers']} workers, {r['chunks']} chunks, "
                f"{r['raw_bytes'] / MB:.0f} MB raw in {r['wall_s']:.2f} s; per-worker MB/s "
                f"{per}; client peak RSS "
                f"{rss:.0f} MB ({ready:.0f} MB of it before the first record: interpreter, "
                f"imports and the chunk pool){lat_txt}{extra}."
            )
    lat = results.get("latency")
    if lat:
        b = lat["remote_back_to_back"]
        lines.append(
            f"- `latency`: {b['n']} back-to-back calls took {b['submit_s']:.2f} s to submit and "
            f"{b['drain_s']:.2f} s more to drain ({b['one_worker_raw_mb_s']:.0f} MB/s raw, one "
            f"in-process client); at the cap ({lat['remote_cap_block']['max_bytes_in_flight'] / MB:.1f} MB) "
            f"blocking mean {lat['remote_cap_block']['mean_us']:.0f} us/call; "
            f"dropping instead of blocking dropped {lat['remote_cap_drop']['dropped']} of "
            f"{lat['remote_cap_drop']['calls']} chunks."
        )
    fin = results.get("finish")
    if fin:
        vb, va = fin["server_vm_before"], fin["server_vm_after"]
        lines.append(
            f"- `finish`: {fin['chunks']} chunks, {fin['raw_bytes'] / MB:.0f} MB raw, "
            f"{fin['status']['episodes_finished']:,} done flags; result {fin['episodes']:,} "
            f"episodes x {fin['max_length']} steps = {fin['result_bytes'] / MB:.0f} MB; server "
            f"RSS {vb.get('VmRSS', 0) / MB:.0f} MB before finish, peak "
            f"{va.get('VmHWM', 0) / MB:.0f} MB after; arrays equal to factoriax: "
            f"{'yes' if fin['matched'] else 'NO ' + '; '.join(fin['mismatches'])}; "
            f"each call, alternating: remote {', '.join(f'{x:.2f}' for x in fin['remote_runs_s'])} s, "
            f"in-process {', '.join(f'{x:.2f}' for x in fin['inprocess_runs_s'])} s."
        )
    wl = results.get("_workload")
    if wl:
        text = f"- workload: zstd-1 wire/raw {wl['workload_wire_over_raw']:.3f} per chunk"
        if "pixels_wire_over_raw" in wl:
            text += (
                f"; the pixel workload {wl['pixels_wire_over_raw']:.3f} "
                f"(its frames alone {wl['frames_wire_over_raw']:.3f})"
            )
        lines.append(text + ".")
    lines.append("")
    return lines
