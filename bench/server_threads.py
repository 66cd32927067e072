"""Where a recorder server's CPU goes, thread by thread, with and without a trajectory store.

Usage: .venv/bin/python bench/server_threads.py [--rounds 3] [--chunks 80] [--workers 4]
                                                [--py-spy FILE [--gil]]

Alternates a store-off and a store-on 4-worker ingest (the bench workload and store
configuration) against a real `rollout-recorder serve`, and prints the ingest MB/s, the CPU
seconds and minor page faults of each server thread during the run (from /proc/PID/task),
the server's page faults per chunk and the machine's busy cores. `--py-spy FILE` also
records the store-on runs' server with py-spy (raw folded stacks, every thread) into FILE;
with `--gil`, only the samples of the thread holding the GIL. A diagnostic, not a bench row:
the store numbers in docs/performance.md come from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Context, Params, ingest_specs  # noqa: E402
from procs import RecorderServer, run_workers  # noqa: E402

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> list[str]:
    # Fields after the command name; utime, stime are [11], [12] and minflt is [7].
    return path.read_text().rsplit(")", 1)[1].split()


def thread_cpu(pid: int) -> dict[str, tuple[float, int]]:
    """CPU seconds and minor page faults so far of each thread (by thread id) of a process."""
    out: dict[str, tuple[float, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = _stat(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
        out[task.name] = ((int(fields[11]) + int(fields[12])) / _CLK_TCK, int(fields[7]))
    return out


def one_run(
    ctx: Context, workers: int, capture: bool, spy_file: str | None, gil: bool = False
) -> str:
    tmp = ctx.tmp
    server = RecorderServer(tmp / f"data-{time.time_ns()}", [], tmp / "server.log")
    try:
        pid = server.proc.pid
        before, faults0 = thread_cpu(pid), int(_stat(Path(f"/proc/{pid}/stat"))[7])
        spy = None
        if spy_file and capture:
            argv = ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--threads"]
            argv += ["--nonblocking", "-f", "raw", "-o", spy_file] + (["--gil"] if gil else [])
            spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
        specs = ingest_specs(
            ctx, "remote", workers, server.address, compression_level=1, capture=capture
        )
        results, go_ns, machine = run_workers(specs, tmp / "workers")
        after, faults1 = thread_cpu(pid), int(_stat(Path(f"/proc/{pid}/stat"))[7])
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
    finally:
        server.stop()
    wall_ns = max(r["end_ns"] for r in results) - go_ns
    raw = sum(r["raw_bytes"] for r in results)
    chunks = workers * ctx.params.ingest_chunks
    used = {
        t: (c - before.get(t, (0.0, 0))[0], f - before.get(t, (0.0, 0))[1])
        for t, (c, f) in after.items()
    }
    busy = sorted((v for v in used.values() if v[0] >= 0.01), reverse=True)
    acked_ns = max(r["acked_ns"] for r in results) - go_ns
    return (
        f"store {'on ' if capture else 'off'}: {raw / wall_ns * 1e3:6.0f} MB/s, wall "
        f"{wall_ns / 1e9:.2f} s (last ack at {acked_ns / 1e9:.2f} s), server CPU "
        f"{sum(c for c, _ in used.values()):.2f} s, threads "
        f"[{', '.join(f'{c:.2f}' for c, _ in busy)}] s, their page faults per chunk "
        f"[{', '.join(f'{f / chunks:.0f}' for _, f in busy)}], "
        f"{(faults1 - faults0) / chunks:.0f} page faults per chunk; machine "
        f"{machine.get('busy_cores', float('nan')):.2f} busy cores"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=80, help="chunks per worker")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--py-spy", dest="spy", help="record the store-on runs into this file")
    ap.add_argument("--gil", action="store_true", help="py-spy keeps only GIL-holding samples")
    args = ap.parse_args()
    params = dataclasses.replace(Params(), ingest_chunks=args.chunks)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(params, False, Path(tmp), [])
        for _ in range(args.rounds):
            for capture in (False, True):
                print(one_run(ctx, args.workers, capture, args.spy, args.gil), flush=True)


if __name__ == "__main__":
    main()
