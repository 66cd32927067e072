"""Reverb side by side: DeepMind's Reverb server fed the same chunks as items, by
`TrajectoryWriter` writers each in its own client, beside our server's rows of the same run.

Reverb runs in its own virtualenv (`REVERB_PYTHON`, made by `make bench` from
bench/requirements-reverb.txt), its server and writers as subprocesses (bench/reverb_proc.py);
without that virtualenv the scenarios skip and say why. The rows put our items/s and server
CPU per item (from `compare_to`, a scenario of this run with the same workload) against
Reverb's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from harness import MB, Context, Row, Scenario, Skipped, median_run
from procs import BENCH_DIR, Child, machine_snapshot, machine_window

REVERB_VENV = BENCH_DIR / ".venv-reverb"
REVERB_PYTHON = REVERB_VENV / "bin" / "python"
REVERB_STAMP = REVERB_VENV / ".installed"  # written by `make bench` once the install succeeded
INSTALL_LOG = BENCH_DIR / "results" / "reverb-install.log"
PROC = BENCH_DIR / "reverb_proc.py"


def reverb_missing() -> str | None:
    """Why Reverb cannot run here (None when its virtualenv is installed)."""
    if REVERB_STAMP.exists() and REVERB_PYTHON.exists():
        return None
    why = f"Reverb's virtualenv {REVERB_VENV.relative_to(BENCH_DIR.parent)} is not installed"
    if INSTALL_LOG.exists():
        tail = [ln for ln in INSTALL_LOG.read_text(errors="replace").splitlines() if ln.strip()]
        return f"{why}; the install log ends: {' | '.join(tail[-3:])}"
    return f"{why} (`make bench` installs it from bench/requirements-reverb.txt)"


def _child(mode: str, spec: dict[str, Any], log) -> Child:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    # -I: none of bench/'s modules (nor PYTHONPATH's project packages) shadow Reverb's.
    argv = [str(REVERB_PYTHON), "-I", str(PROC), mode, json.dumps(spec)]
    return Child(argv, log_path=log, env=env)


class ReverbProcesses:
    """A Reverb server with a table for `items` items and a writers process per spec, started
    together; `round()` runs one timed round into the empty table, and empties it after."""

    def __init__(self, items: int, specs: list[dict[str, Any]], logs: Path) -> None:
        self.items = items
        self.server = _child("server", {"max_size": items}, logs / "server.log")
        self.writers: list[Child] = []
        try:
            line = self.server.read_line(300, prefix="reverb listening on ")
            target = line.rsplit(" ", 1)[1]
            for i, spec in enumerate(specs):
                spec = {**spec, "target": target}
                self.writers.append(_child("writers", spec, logs / f"writers-{i}.log"))
            self.ready = [w.read_json("ready", 300) for w in self.writers]
        except BaseException:
            self.close()
            raise

    def round(self) -> dict[str, Any]:
        server = self.server
        cpu0 = server.cpu_s()
        machine0 = machine_snapshot()
        for w in self.writers:
            w.send("go")
        results = [w.read_json("result", 300) for w in self.writers]
        server_cpu = server.cpu_s() - cpu0
        start = min(r["start_ns"] for r in results)
        wall = (max(r["end_ns"] for r in results) - start) / 1e9
        machine = machine_window(machine0, machine_snapshot(), wall)
        server.send("info")
        info = server.read_json("info", 60)
        if info["current_size"] != self.items:
            raise RuntimeError(f"Reverb's table holds {info['current_size']} of {self.items} items")
        # Emptied now: the held items would sit in memory through the other scenarios' rounds.
        server.send("reset")
        server.read_json("reset", 60)
        raw = sum(r["raw_bytes"] for r in results)
        return {
            "items": self.items,
            "chunks": self.items,
            "chunk_raw_bytes": results[0]["chunk_raw_bytes"],
            "window": results[0]["window"],
            "raw_bytes": raw,
            "wall_s": wall,
            "items_s": self.items / wall,
            "raw_mb_s": raw / MB / wall,
            "server_cpu_s": server_cpu,
            "server_cpu_ms_per_item": server_cpu / self.items * 1e3,
            "server_vm": server.status(),
            "table": info,
            "client_cpu_s": sum(r["cpu_s"] for r in results),
            "client_rss_ready_max": max(r["rss_ready"] for r in self.ready),
            "machine": machine,
            "versions": self.ready[0]["versions"],
        }

    def close(self) -> None:
        for w in self.writers:
            w.stop()
        self.server.stop()


def reverb_scenario(
    name: str,
    *,
    processes: int,
    threads: int,
    num_envs: int,
    chunks: int | None,
    window: int | None,
    compare_to: str,
    repeated: bool,
    once_rounds: int = 3,
    per_step: bool = False,
) -> Scenario:
    """`processes` x `threads` Reverb writers, each its own client and `TrajectoryWriter`,
    insert `chunks` chunks each (None: `Params.ingest_chunks`) of N=`num_envs` into one Reverb
    server's table, keeping at most `window` items unconfirmed (None: as many as our client's
    256 MB in flight). Each process makes its chunks as worker.py does for the same worker
    index: the same bytes our workers record, each chunk one item: one append of whole arrays,
    or (`per_step`) T appends of a time step each. `repeated`: a round in each of the bench's
    rounds (the processes kept between them); otherwise the median of `once_rounds`."""

    def start(ctx: Context, n: int) -> ReverbProcesses:
        p = ctx.params
        d = ctx.tmp / name
        d.mkdir(parents=True, exist_ok=True)
        items = processes * threads * n
        specs = [
            {
                "threads": threads,
                "chunks": n,
                # As worker.py: worker i at seed 1000 + i; a pool as long as the ingest run's,
                # or as the fleet's `chunks`.
                "pool": n if chunks else p.pool,
                "seed": 1000 + i,
                "length": p.length,
                "num_envs": num_envs,
                "done_prob": p.done_prob,
                **({"window": window} if window else {"window_bytes": 256 << 20}),
                "per_step": per_step,
            }
            for i in range(processes)
        ]
        return ReverbProcesses(items, specs, d)

    def run(ctx: Context, rep: int) -> dict[str, Any]:
        why = reverb_missing()
        if why:
            raise Skipped(why)
        n = chunks or ctx.params.ingest_chunks
        if ctx.quick:
            n = max(2, n // 4)
        # Started once a run (TensorFlow's import takes seconds a process); each round
        # starts on an empty table.
        procs = ctx.kept(name, lambda: start(ctx, n))
        try:
            # A scenario run once takes the median of a few rounds (a second or two each).
            outs = [procs.round() for _ in range(1 if repeated or ctx.quick else once_rounds)]
            out = median_items(outs) if len(outs) > 1 else outs[0]
        except BaseException:
            ctx.drop(name)
            raise
        if not repeated:
            ctx.drop(name)
        return {"workers": processes * threads, "processes": processes, "threads": threads,
                "num_envs": num_envs, "length": ctx.params.length, "per_step": per_step,
                **out}  # fmt: skip

    def rows(results: dict[str, dict[str, Any]]) -> list[Row]:
        r = results.get(name)
        if not r:
            return []
        ours = ours_per_item(results.get(compare_to))
        who = (
            f"{r['workers']} workers ({processes} processes x {threads} threads)"
            if threads > 1
            else f"{r['workers']} workers"
        )
        label = (
            f"{who}, N={num_envs}: {r['chunk_raw_bytes'] / MB:.2f} MB chunks, "
            f"{r['items'] // r['workers']} a worker, at most {r['window']} unconfirmed; ours "
            f"= {compare_to} of this run"
        )
        how = f"{r.get('length')} appends of a time step" if per_step else "one append"
        ref = f"Reverb {r['versions']['dm-reverb']} (TrajectoryWriter, an item a chunk: {how})"
        return [
            Row("Reverb", f"items (chunks) per second, {label}", ours["items_s"],
                r["items_s"], ref, "items/s", "higher", digits=0),
            Row("Reverb", f"server CPU ms per item, {label}{ours['cpu_note']}",
                ours["cpu_ms"], r["server_cpu_ms_per_item"], ref, "ms", "lower", digits=2),
        ]  # fmt: skip

    return Scenario(
        name,
        run,
        rows,
        description=f"Reverb server, {processes * threads} TrajectoryWriter writers "
        + (f"({processes} processes x {threads} threads)" if threads > 1 else "(a process each)")
        + f", N={num_envs}",
        repeated=repeated,
        combine=median_items if repeated else None,
    )


def ours_per_item(r: dict[str, Any] | None) -> dict[str, Any]:
    """Our items/s and server CPU ms per item in scenario result `r` (None where it did not
    run). The server's CPU counts the proof that every acknowledged frame decodes where the
    scenario waited for it (`server_cpu_with_proof_s`): our whole work for those chunks."""
    if not r:
        return {"items_s": None, "cpu_ms": None, "cpu_note": ""}
    cpu = r.get("server_cpu_with_proof_s")
    note = "; ours counted until every frame is proved to decode" if cpu is not None else ""
    cpu = r["server_cpu_s"] if cpu is None else cpu
    return {
        "items_s": r["chunks"] / r["wall_s"],
        "cpu_ms": cpu / r["chunks"] * 1e3,
        "cpu_note": note,
    }


def median_items(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median items/s, with every round's items/s and CPU per item."""
    out = median_run(runs, "items_s")
    out["runs_server_cpu_ms_per_item"] = [r["server_cpu_ms_per_item"] for r in runs]
    return out
