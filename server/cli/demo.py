"""`rollout-recorder demo`: a server, worker processes on the synthetic env, a table.

Each worker is a separate process recording into one session, exactly as
parallel trainers would; the demo then calls finish(), prints what arrived,
and says what to try next. The server writes the run's episodes as a Parquet
dataset (under demo-data/ by default), which the last lines query.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import Credentials, add_flags, fail

STATE_FIELDS = ["player_positions", "player_inventory"]


def run_worker(args: argparse.Namespace) -> int:
    """One trainer: collect chunks from the synthetic env and record them."""
    from recorder_client import RecorderError, RolloutRecorder

    from ..workload import SyntheticVecEnv

    env = SyntheticVecEnv(args.envs, seed=args.seed, done_prob=args.done_prob)
    start = time.perf_counter()
    try:
        credentials = Credentials.from_args(args)
        with RolloutRecorder(
            max_episodes=args.max_episodes,
            record_states=True,
            state_fields=STATE_FIELDS,
            target=args.target,
            session=args.session,
            worker_id=args.worker_id,
            **credentials.client_kwargs(),
        ) as recorder:
            for _ in range(args.chunks):
                rollout, states = env.collect(args.length)
                recorder.record(rollout, states)
            recorder.flush()
            stats, worker_id = recorder.stats, recorder.worker_id
    except (RecorderError, ValueError) as exc:  # unreachable, refused, unusable credentials
        return fail("demo-worker", str(exc))
    # One write per line: the demo's workers share its stdout.
    sys.stdout.write(
        f"worker {worker_id}: {args.chunks} chunks, {stats.raw_bytes} raw bytes, "
        f"{stats.wire_bytes} wire bytes, {time.perf_counter() - start:.2f}s\n"
    )
    sys.stdout.flush()
    return 0


def _dataset_dir(path: str) -> Path | None:
    """The demo's dataset directory, emptied of an earlier demo's dataset; None when the
    path holds something else (the demo never deletes what it did not write)."""
    directory = Path(path)
    if directory.exists():
        if not (directory / "_dataset.json").is_file() and any(directory.iterdir()):
            return None
        shutil.rmtree(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    return directory


def run_demo(args: argparse.Namespace) -> int:
    from recorder_client import RecorderUnavailableError, RolloutRecorder
    from recorder_client._launch import ServerProcess

    dataset = _dataset_dir(args.dataset_dir)
    if dataset is None:
        print(
            f"demo: --dataset-dir: expected a new directory or an earlier demo's dataset, "
            f"got {args.dataset_dir!r}, which holds other files",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="rollout-recorder-demo-") as tmp:
        try:
            server = ServerProcess(
                ["--listen", "127.0.0.1:0", "--data-dir", tmp, "--dataset-uri", str(dataset)],
                exit_with_stdin=True,
            )
        except RecorderUnavailableError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 1
        try:
            target = server.address
            print(f"recorder server at {target}; {args.workers} worker processes", flush=True)
            # Join first so the table's finish() client fixes the configuration.
            viewer = RolloutRecorder(
                record_states=True,
                state_fields=STATE_FIELDS,
                target=target,
                session="demo",
                worker_id="demo-viewer",
            )
            start = time.perf_counter()
            workers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "recorder_server",
                        "demo-worker",
                        "--target",
                        target,
                        "--session",
                        "demo",
                        "--worker-id",
                        f"worker-{i}",
                        "--seed",
                        str(i),
                        "--chunks",
                        str(args.chunks),
                        "--length",
                        str(args.length),
                        "--envs",
                        str(args.envs),
                        "--done-prob",
                        str(args.done_prob),
                    ]
                )
                for i in range(args.workers)
            ]
            codes = [w.wait() for w in workers]
            ingest = time.perf_counter() - start
            if any(codes):
                print(f"demo: a worker failed: exit codes {codes}", file=sys.stderr)
                return 1
            t0 = time.perf_counter()
            traj = viewer.finish()
            finish_s = time.perf_counter() - t0
            status = viewer.status()
            viewer.close()
        finally:
            server.stop(10)
    raw_mb, wire_mb = status.raw_bytes / 1e6, status.wire_bytes / 1e6
    rows = [
        ("workers", f"{len(status.workers) - 1}"),
        ("chunks stored", f"{status.chunks_stored}"),
        (
            "env steps",
            f"{status.num_recorded_steps * args.envs:,} ({status.num_recorded_steps} x {args.envs} envs)",
        ),
        ("episodes finished", f"{status.episodes_finished}"),
        (
            "episodes returned",
            f"{traj.num_episodes} (incl. unfinished tails), T_max {traj.max_length}",
        ),
        ("raw bytes", f"{raw_mb:,.1f} MB"),
        ("wire bytes", f"{wire_mb:,.1f} MB ({raw_mb / max(wire_mb, 1e-9):.1f}x smaller)"),
        ("ingest time", f"{ingest:.2f} s ({raw_mb / ingest:,.0f} MB/s raw, incl. process start)"),
        ("finish time", f"{finish_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    print(f"| {'':<{width}} | value")
    print(f"|-{'-' * width}-|------")
    for key, value in rows:
        print(f"| {key:<{width}} | {value}")
    print(next_steps(dataset))
    return 0


def _shown(path: str) -> str:
    """A path as short as the user can type it from here."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def next_steps(dataset: Path) -> str:
    """What to try after the demo: the dashboard, a query over its dataset, the examples."""
    python = _shown(sys.executable)
    script = Path(sys.executable).parent / "rollout-recorder"
    command = _shown(str(script)) if script.is_file() else f"{python} -m recorder_server"
    glob = f"{_shown(str(dataset))}/*/*.parquet"
    query = (
        "SELECT episode_id, count(*) AS length, sum(reward) AS return "
        f"FROM '{glob}' GROUP BY episode_id ORDER BY return DESC LIMIT 5"
    )
    examples = Path("examples")
    lines = [
        "",
        "What to try next:",
        "  - Watch a run on the dashboard: start a server with it,",
        f"      {command} serve --data-dir demo-data/server --http-listen 127.0.0.1:8080",
        "    open http://127.0.0.1:8080/?session=live, and record into it from another shell:",
        f"      {command} demo-worker --target 127.0.0.1:50051 --session live --chunks 2000",
        "  - Query this run's episodes (the Parquet dataset the server wrote), e.g. the best",
        "    returns, with DuckDB (pip install duckdb):",
        f'      {python} -c "import duckdb; duckdb.sql(\\"{query}\\").show()"',
    ]
    if (examples / "gymnasium_cartpole.py").is_file():
        lines += [
            "  - Record your own loop: the README's examples, as scripts:",
            f"      {python} examples/gymnasium_cartpole.py   (Gymnasium, CartPole)",
            f"      {python} examples/jax_rollout.py          (a jitted JAX rollout)",
        ]
    else:
        lines += ["  - Record your own loop: the examples in the README."]
    return "\n".join(lines)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--chunks", type=int, default=20)
    demo.add_argument("--length", type=int, default=128)
    demo.add_argument("--envs", type=int, default=64)
    demo.add_argument("--done-prob", type=float, default=1 / 200)
    demo.add_argument(
        "--dataset-dir",
        default="demo-data/dataset",
        metavar="DIR",
        help="where the server writes the run's episodes as Parquet (an earlier demo's dataset "
        "there is replaced); default demo-data/dataset",
    )
    demo.set_defaults(func=run_demo)

    worker = sub.add_parser("demo-worker", help="one synthetic trainer (used by demo and compose)")
    worker.add_argument("--target", default=None, help="default: $ROLLOUT_RECORDER_TARGET")
    worker.add_argument("--session", default="demo")
    worker.add_argument("--worker-id", default=None)
    worker.add_argument("--seed", type=int, default=0)
    worker.add_argument("--chunks", type=int, default=20)
    worker.add_argument("--length", type=int, default=128)
    worker.add_argument("--envs", type=int, default=64)
    worker.add_argument("--done-prob", type=float, default=1 / 200)
    worker.add_argument("--max-episodes", type=int, default=None)
    add_flags(worker)
    worker.set_defaults(func=run_worker)
