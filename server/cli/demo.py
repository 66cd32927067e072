"""`rollout-recorder demo`: a server, worker processes on the synthetic env, a table.

Each worker is a separate process recording into one session, exactly as
parallel trainers would; the demo then calls finish() and prints what
arrived.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

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
            stats = recorder.stats
    except (RecorderError, ValueError) as exc:  # unreachable, refused, unusable credentials
        return fail("demo-worker", str(exc))
    # One write per line: the demo's workers share its stdout.
    sys.stdout.write(
        f"worker {args.worker_id}: {args.chunks} chunks, {stats.raw_bytes} raw bytes, "
        f"{stats.wire_bytes} wire bytes, {time.perf_counter() - start:.2f}s\n"
    )
    sys.stdout.flush()
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from recorder_client import RecorderUnavailableError, RolloutRecorder
    from recorder_client._launch import ServerProcess

    with tempfile.TemporaryDirectory(prefix="rollout-recorder-demo-") as tmp:
        try:
            server = ServerProcess(
                ["--listen", "127.0.0.1:0", "--data-dir", tmp], exit_with_stdin=True
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
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--chunks", type=int, default=20)
    demo.add_argument("--length", type=int, default=128)
    demo.add_argument("--envs", type=int, default=64)
    demo.add_argument("--done-prob", type=float, default=1 / 200)
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
