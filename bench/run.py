"""Rollout Recorder benchmarks: `make bench` (`python bench/run.py`).

Runs every scenario in `scenarios.SCENARIOS` side by side with its reference, printing
a progress line per scenario run, then writes bench/results/<UTC timestamp>.json and
bench/results/latest.json (neither committed), regenerates bench/RESULTS.md (the targets of
bench/targets.toml and the current table), and prints the table.

    python bench/run.py                 # the full run (~8 min on 2 cores)
    python bench/run.py --quick         # a smoke run (~1 min)
    python bench/run.py --only latency,ingest_4w   # (--quick, --only, --skip: partial runs,
                                                   # which leave latest.json and RESULTS.md)
    python bench/run.py --serve-args "--some-flag x"   # appended to every recorder server
    python bench/run.py --profile       # also: 4-worker ingest under py-spy (bench extra)
    python bench/run.py --keep-tmp      # keep bench/results/tmp/<stamp> (servers' data dirs)

Each recorder server's data directory (its write-ahead log and checkpoints, ~70 MB, ~2.8 GB
over a full run) is removed once its scenario is done; the run's scratch directory
bench/results/tmp/<stamp> (server and worker logs) is removed at the end unless a scenario
failed, so that its logs can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
import traceback
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunks import compression_check  # noqa: E402
from harness import Context, Params, Row, Scenario, Skipped, median_run  # noqa: E402
from procs import BENCH_DIR, extract_code  # noqa: E402
from report import (  # noqa: E402
    cpu_table,
    details_section,
    load_targets,
    loadavg,
    machine_info,
    render_markdown,
    rows_table,
    targets_table,
)
from scenarios import OPTIONAL_SCENARIOS, SCENARIOS  # noqa: E402

RESULTS_DIR = BENCH_DIR / "results"
PROFILE_JSON = RESULTS_DIR / "profile-latest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a ~1 minute smoke run")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--skip", default="", help="comma-separated scenario names")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds of the repeated scenarios (default 5, --quick 1); fewer make a partial run",
    )
    parser.add_argument(
        "--with",
        dest="with_",
        default="",
        help="comma-separated optional scenarios to run as well (see --list)",
    )
    parser.add_argument(
        "--serve-args", default="", help="extra `rollout-recorder serve` flags for every server"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile a 4-worker ingest with py-spy"
    )
    parser.add_argument(
        "--code",
        default="",
        metavar="REV",
        help="benchmark client/ and server/ as committed at git REV (a snapshot on "
        "PYTHONPATH) instead of the working tree",
    )
    parser.add_argument(
        "--keep-tmp",
        action="store_true",
        help="keep bench/results/tmp/<stamp> with every server's data dir (default: removed)",
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite RESULTS.md from results/latest.json (e.g. after editing targets.toml)",
    )
    return parser.parse_args(argv)


def use_snapshot(rev: str, tmp: Path) -> dict[str, str]:
    """Extract client/ and server/ at `rev` and put them first on every process's path."""
    pkgs, sha = extract_code(rev, tmp / "src")
    # PathFinder (PYTHONPATH, sys.path) runs before the editable install's finder.
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(pkgs), old) if p)
    sys.path.insert(0, str(pkgs))
    return {"source": f"git {sha} (snapshot via --code {rev})", "commit": sha}


def where_the_time_goes(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "## Where the time goes",
        "",
        "CPU seconds of each process during the timed window (from /proc and `os.times()`), "
        "per GB of raw data:",
        "",
        *cpu_table(results),
        "",
    ]
    if PROFILE_JSON.exists():
        from profile_ingest import profile_markdown

        lines += profile_markdown(json.loads(PROFILE_JSON.read_text()))
    lines += [
        "What these numbers mean, what was tried and what was kept: "
        "[docs/performance.md](../docs/performance.md).",
        "",
    ]
    return lines


def drop_server_data(tmp: Path) -> None:
    """The data directories of the scenario servers under ``tmp`` (their logs stay)."""
    for data in tmp.glob("*/data"):
        shutil.rmtree(data, ignore_errors=True)


class Progress:
    """Counts scenario runs: each progress line says which of how many, and the time so far."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()

    def line(self, text: str) -> str:
        return f"[{self.done}/{self.total}, {time.monotonic() - self.started:.0f} s] {text}"


def run_scenario(
    ctx: Context,
    doc: dict[str, Any],
    sc: Scenario,
    rep: int,
    progress: Progress,
    keep_tmp: bool = False,
) -> dict | None:
    """One run of a scenario; a failure is recorded, and the other scenarios go on."""
    try:
        return _run_scenario(ctx, doc, sc, rep, progress)
    finally:
        if not keep_tmp:
            drop_server_data(ctx.tmp)


def _run_scenario(
    ctx: Context, doc: dict[str, Any], sc: Scenario, rep: int, progress: Progress
) -> dict | None:
    rounds = ctx.params.repeats
    label = f"{sc.name}" + (f" (round {rep + 1}/{rounds})" if sc.repeated else "")
    ctx.log(progress.line(f"{label}: {sc.description}"))
    t0 = time.monotonic()
    try:
        result = sc.run(ctx, rep)
    except Exception as exc:
        if isinstance(exc, Skipped):
            doc["skipped"][sc.name] = str(exc)
            outcome = f"skipped: {exc}"
        else:
            doc["errors"][sc.name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            outcome = f"FAILED: {type(exc).__name__}: {exc}"
        # A repeated scenario that failed or was skipped does not run in later rounds.
        progress.total -= rounds - rep - 1 if sc.repeated else 0
        progress.done += 1
        ctx.log(progress.line(f"{label} {outcome}"))
        return None
    result["elapsed_s"] = time.monotonic() - t0
    if not sc.repeated:
        ctx.results[sc.name] = result
    progress.done += 1
    ctx.log(progress.line(f"{label} done in {result['elapsed_s']:.1f} s"))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        return render_only()
    if args.list:
        for sc in SCENARIOS:
            print(f"{sc.name:28s} {sc.description}")
        for sc in OPTIONAL_SCENARIOS:
            print(f"{sc.name:28s} {sc.description} (optional: --with)")
        return 0
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    with_ = {s for s in args.with_.split(",") if s}
    everything = SCENARIOS + OPTIONAL_SCENARIOS
    unknown = (only | skip | with_) - {sc.name for sc in everything}
    if unknown:
        print(f"unknown scenarios: {sorted(unknown)}; see --list", file=sys.stderr)
        return 2
    started = time.monotonic()
    now = datetime.now(UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    params = Params().quick() if args.quick else Params()
    if args.repeats is not None:
        params = replace(params, repeats=args.repeats)
    tmp = RESULTS_DIR / "tmp" / stamp
    tmp.mkdir(parents=True, exist_ok=True)
    code = {"source": "working tree"}
    if args.code:
        code = use_snapshot(args.code, tmp)
    import recorder_client

    code["recorder_client"] = str(Path(recorder_client.__file__).parent)
    ctx = Context(params, args.quick, tmp, shlex.split(args.serve_args))
    doc: dict[str, Any] = {
        "timestamp": now.isoformat(timespec="seconds"),
        "quick": args.quick,
        "params": params.__dict__,
        "serve_args": ctx.serve_args,
        "machine": machine_info(),
        "code": code,
        "results": ctx.results,
        "errors": {},
        "skipped": {},
    }
    ctx.results["_workload"] = compression_check()
    try:
        default = {sc.name for sc in SCENARIOS}
        selected = [
            sc
            for sc in everything
            if (sc.name in only or sc.name in with_ or (not only and sc.name in default))
            and sc.name not in skip
        ]
        progress = Progress(
            sum(params.repeats if sc.repeated else 1 for sc in selected) + bool(args.profile)
        )
        for sc in selected:
            if not sc.repeated:
                run_scenario(ctx, doc, sc, 0, progress, args.keep_tmp)
        runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(params.repeats):
            for sc in selected:
                if sc.repeated and sc.name not in doc["errors"] and sc.name not in doc["skipped"]:
                    result = run_scenario(ctx, doc, sc, rep, progress, args.keep_tmp)
                    if result is not None:
                        runs.setdefault(sc.name, []).append(result)
        by_name = {sc.name: sc for sc in selected}
        for name, results in runs.items():
            ctx.results[name] = (by_name[name].combine or median_run)(results)
        if args.profile:
            from profile_ingest import profile_ingest

            ctx.log(progress.line("profile: 4-worker ingest under py-spy"))
            try:
                prof = profile_ingest(ctx)
            except Exception as exc:
                doc["errors"]["profile"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                ctx.log(f"profile FAILED: {type(exc).__name__}: {exc}")
            else:
                prof["timestamp"] = doc["timestamp"]
                PROFILE_JSON.write_text(json.dumps(prof, indent=1))
    finally:
        ctx.close()
        if not args.keep_tmp:
            drop_server_data(tmp)

    doc["machine"]["loadavg_end"] = loadavg()
    doc["elapsed_s"] = time.monotonic() - started
    # Only a full run (every default scenario, full sizes) stands for the code: a partial one
    # leaves latest.json and RESULTS.md as they are.
    partial = args.quick or bool(only or skip) or params.repeats < Params().repeats
    doc["partial"] = partial
    doc["file"] = f"{stamp}{'-quick' if args.quick else '-partial' if partial else ''}.json"
    rows = finalize(doc)
    RESULTS_DIR.mkdir(exist_ok=True)
    text = json.dumps(doc, indent=1, default=str)
    (RESULTS_DIR / doc["file"]).write_text(text)
    written = [f"bench/results/{doc['file']}"]
    if not partial:
        (RESULTS_DIR / "latest.json").write_text(text)
        write_markdown(doc, rows)
        written += ["bench/results/latest.json", "bench/RESULTS.md"]
    print()
    print("\n".join(targets_table(doc["targets"])))
    print()
    print("\n".join(rows_table(rows)))
    print()
    print(
        f"wrote {', '.join(written)} ({doc['elapsed_s']:.0f} s)"
        + ("; a partial run: latest.json and RESULTS.md left as they were" if partial else "")
    )
    for name in doc["errors"]:
        print(f"scenario {name} failed; see the JSON for the traceback", file=sys.stderr)
    if doc["errors"]:
        print(f"logs kept in {tmp}", file=sys.stderr)
    elif not args.keep_tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if doc["errors"] else 0


def finalize(doc: dict[str, Any]) -> list[Row]:
    """Rows and target verdicts from the results (also for --render-only)."""
    results = doc["results"]
    rows = [row for sc in SCENARIOS + OPTIONAL_SCENARIOS for row in sc.rows(results)]
    doc["targets"] = [t.evaluate(results) for t in load_targets()]
    doc["rows"] = [{**row.__dict__, "ratio": row.ratio} for row in rows]
    return rows


def write_markdown(doc: dict[str, Any], rows: list[Row]) -> None:
    results = doc["results"]
    errors = ["## Errors and skipped scenarios", ""] + [
        f"- `{name}` failed: {err.splitlines()[0]}" for name, err in doc["errors"].items()
    ]
    errors += [f"- `{name}` skipped: {why}" for name, why in doc.get("skipped", {}).items()]
    markdown = render_markdown(
        doc,
        rows,
        [
            *details_section(results),
            *(errors + [""] if doc["errors"] or doc.get("skipped") else []),
            *where_the_time_goes(results),
        ],
    )
    (BENCH_DIR / "RESULTS.md").write_text(markdown)


def render_only() -> int:
    """Rewrite bench/RESULTS.md from bench/results/latest.json without running anything."""
    doc = json.loads((RESULTS_DIR / "latest.json").read_text())
    write_markdown(doc, finalize(doc))
    print(f"rewrote bench/RESULTS.md from bench/results/latest.json ({doc['file']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
