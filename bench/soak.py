"""Soak: 64 workers record, finish and drop sessions in cycles; the server must stay flat.

`make soak` (``python bench/soak.py``) runs for 20 minutes by default:

    python bench/soak.py                 # 20 minutes, a line every 30 s
    python bench/soak.py --minutes 3     # shorter
    python bench/soak.py --interval 10   # a line every 10 s
    python bench/soak.py --serve-args=--no-metrics   # extra serve flags (mind the "=")

One `rollout-recorder serve` (its data directory under bench/results/tmp/soak-<stamp>,
removed at the end unless the run failed) and 8 worker processes of 8 threads: 64 workers,
each with its own RolloutRecorder. The 8 threads of a process are a group; in every cycle
the group joins a fresh session, each thread records its chunks (with a state field and
outcome codes), flushes and closes (leaving the session), one thread calls finish() and
checks that every step came back, and the session is dropped with
``recorder_client.drop_session``.

It prints the server's RSS and thread count (and open files, sessions held and the data
directory's size) over time, then the verdict. After warm-up (the first --warmup fraction of
the run), RSS and threads must each be flat: the median of the last third of the samples at
most --tolerance (10%) above the median of the first third; a leak grows, pools that come and
go do not. PASS or FAIL (exit status 1). The samples go to bench/results/soak-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

# Per worker and cycle: CHUNKS chunks of (T, N) steps.
CHUNKS, T, N = 8, 64, 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="default %(default)s")
    parser.add_argument(
        "--interval", type=float, default=30.0, help="seconds between samples (%(default)s)"
    )
    parser.add_argument("--processes", type=int, default=8, help="default %(default)s")
    parser.add_argument("--threads", type=int, default=8, help="per process (%(default)s)")
    parser.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of the run not judged (%(default)s)"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.10, help="allowed rise after warm-up (%(default)s)"
    )
    parser.add_argument(
        "--serve-args", default="", help="extra `rollout-recorder serve` flags (split on spaces)"
    )
    parser.add_argument("--keep-tmp", action="store_true", help="keep the server's data dir")
    # Internal: one worker process.
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- a worker process --------------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """`--threads` workers in lockstep: join, record, finish, leave, drop; one JSON line per
    cycle on stdout. Stops after the cycle in which stdin closes."""
    import numpy as np

    from recorder_client import RolloutRecorder, drop_session

    proc, threads, target = args.worker, args.threads, args.target
    stop = threading.Event()
    # Decided once per cycle, for every thread of the group, as they meet.
    stopping = [False]
    barrier = threading.Barrier(threads, action=lambda: stopping.__setitem__(0, stop.is_set()))
    failures: list[str] = []
    steps_per_worker = CHUNKS * T * N

    def watch_stdin() -> None:
        while os.read(0, 4096):
            pass
        stop.set()

    def run(thread: int) -> None:
        rng = np.random.default_rng([proc, thread])
        cycle = 0
        try:
            while True:
                barrier.wait()
                if stopping[0]:
                    return
                session = f"soak-p{proc}-c{cycle}"
                rec = RolloutRecorder(
                    record_states=True,
                    state_fields=["player_positions"],
                    target=target,
                    session=session,
                    worker_id=f"p{proc}-t{thread}",
                    reconnect_timeout=60,
                    rpc_timeout=120,
                )
                for _ in range(CHUNKS):
                    done = rng.random((T, N)) < 0.02
                    rec.record(
                        {
                            "action": rng.integers(0, 12, (T, N), dtype=np.int32),
                            "reward": rng.standard_normal((T, N)).astype(np.float32),
                            "done": done,
                        },
                        {"player_positions": rng.integers(0, 64, (T, N, 1, 2), dtype=np.int32)},
                        outcome=np.where(done, 1, 0).astype(np.int8),
                    )
                rec.flush(timeout=120)
                barrier.wait()
                if thread == 0:
                    out = rec.finish()
                    got = int(out.lengths.sum())
                    if got != threads * steps_per_worker:
                        failures.append(
                            f"{session}: finish() returned {got} steps, sent "
                            f"{threads * steps_per_worker}"
                        )
                rec.close()
                barrier.wait()
                if thread == 0:
                    drop_session(target, session, timeout=120)
                    print(
                        json.dumps({"proc": proc, "cycle": cycle, "failures": failures}),
                        flush=True,
                    )
                    failures.clear()
                cycle += 1
        except threading.BrokenBarrierError:
            return
        except BaseException as exc:
            print(json.dumps({"proc": proc, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            barrier.abort()
            raise

    threading.Thread(target=watch_stdin, daemon=True).start()
    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return 0


# -- the driver --------------------------------------------------------------------------------


def proc_sample(pid: int) -> dict[str, int]:
    """RSS (bytes), thread count and open file descriptors of a process."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            out["rss"] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of a process carry each name (for a thread count that grows)."""
    names: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                pass
    return total


class Workers:
    """The worker processes and the cycles they report."""

    def __init__(self, args: argparse.Namespace, target: str, logs: Path) -> None:
        self.cycles = 0
        self.failures: list[str] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.procs = []
        for p in range(args.processes):
            log = open(logs / f"worker-{p}.log", "w")  # noqa: SIM115 - the child holds it
            cmd = [sys.executable, __file__, "--worker", str(p), "--target", target]
            cmd += ["--threads", str(args.threads)]
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
            log.close()
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
            self.procs.append(proc)

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "error" in msg:
                    self.errors.append(f"process {msg['proc']}: {msg['error']}")
                else:
                    self.cycles += 1
                    self.failures += msg["failures"]

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def stop(self, timeout: float = 300.0) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                self.errors.append(f"worker {p.pid} did not stop within {timeout:.0f} s")


def flat(values: list[int], tolerance: float) -> tuple[bool, float]:
    """Whether a series stays flat: the median of its last third at most `tolerance` above
    the median of its first third (a leak grows; pools that come and go do not). Returns
    the verdict and the rise."""
    third = max(1, len(values) // 3)
    first = statistics.median(values[:third])
    last = statistics.median(values[-third:])
    rise = last / first - 1 if first else float("inf")
    return rise <= tolerance, rise


def driver_main(args: argparse.Namespace) -> int:
    from recorder_client import list_sessions
    from recorder_client._launch import ServerProcess

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    tmp = RESULTS_DIR / "tmp" / f"soak-{stamp}"
    tmp.mkdir(parents=True)
    data_dir = tmp / "data"
    workers_n = args.processes * args.threads
    duration = args.minutes * 60
    print(
        f"soak: {workers_n} workers ({args.processes} processes x {args.threads} threads) "
        f"for {args.minutes:g} min; each cycle: join, {CHUNKS} chunks of ({T}, {N}) per worker, "
        "finish, leave, drop",
        flush=True,
    )
    with open(tmp / "server.log", "w") as server_log:
        server = ServerProcess(
            ["--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *args.serve_args.split()],
            stderr=server_log,
        )
    print(f"server pid {server.pid} at {server.address}; scratch {tmp}", flush=True)
    header = f"{'t (s)':>7} {'RSS MiB':>8} {'threads':>7} {'fds':>5} {'sessions':>8} "
    header += f"{'cycles':>7} {'data MiB':>8}"
    print(header, flush=True)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    first_names = thread_names(server.pid)
    workers = Workers(args, server.address, tmp)
    ok = False
    try:
        next_at = started
        while True:
            now = time.monotonic()
            if now >= next_at:
                sample = {"t": round(now - started, 1), **proc_sample(server.pid)}
                sample["sessions"] = len(list_sessions(server.address, timeout=60))
                sample["cycles"] = workers.cycles
                sample["data_bytes"] = dir_bytes(data_dir)
                samples.append(sample)
                print(
                    f"{sample['t']:7.0f} {sample['rss'] / 2**20:8.1f} {sample['threads']:7d} "
                    f"{sample['fds']:5d} {sample['sessions']:8d} {sample['cycles']:7d} "
                    f"{sample['data_bytes'] / 2**20:8.1f}",
                    flush=True,
                )
                next_at += args.interval
            if now - started >= duration:
                break
            if workers.errors or workers.alive() < args.processes or not server.alive():
                break
            time.sleep(min(1.0, max(0.0, next_at - time.monotonic())))
        names = {"start": first_names, "end": thread_names(server.pid)}
        workers.stop()
        ok = report(args, samples, workers, server.alive(), stamp, duration, names)
    finally:
        workers.stop(timeout=10)
        code = server.stop()
        print(f"server stopped with exit status {code}")
        if ok and not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs and data kept in {tmp}")
    return 0 if ok else 1


def report(
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    workers: Workers,
    server_alive: bool,
    stamp: str,
    duration: float,
    names: dict[str, dict[str, int]],
) -> bool:
    judged = [s for s in samples if s["t"] >= args.warmup * duration]
    problems = list(workers.errors) + workers.failures[:10]
    if not server_alive:
        problems.append("the server died")
    if samples and samples[-1]["t"] < duration - args.interval:
        problems.append(f"the run stopped early, at {samples[-1]['t']:.0f} s")
    if len(judged) < 3:
        problems.append(f"only {len(judged)} samples after warm-up: shorten --interval")
    verdicts = {}
    for key in ("rss", "threads"):
        if len(judged) >= 3:
            is_flat, rise = flat([s[key] for s in judged], args.tolerance)
            verdicts[key] = {"flat": is_flat, "rise": rise}
            low = min(s[key] for s in judged)
            high = max(s[key] for s in judged)
            unit = (lambda v: f"{v / 2**20:.1f} MiB") if key == "rss" else str
            print(
                f"{key} after warm-up: {unit(low)} .. {unit(high)}; last third over first "
                f"third (medians): {rise:+.1%} ({'flat' if is_flat else 'NOT flat'}, "
                f"tolerance {args.tolerance:.0%})"
            )
            if not is_flat:
                problems.append(f"{key} rose {rise:.1%} after warm-up")
    ok = not problems
    print(f"server threads by name, at the start: {names['start']}; at the end: {names['end']}")
    print(f"cycles: {workers.cycles} ({workers.cycles * args.threads} sessions' worth of workers)")
    for problem in problems:
        print(f"problem: {problem}")
    print(f"VERDICT: {'PASS' if ok else 'FAIL'}")
    RESULTS_DIR.mkdir(exist_ok=True)
    doc = {
        "stamp": stamp,
        "minutes": args.minutes,
        "workers": args.processes * args.threads,
        "warmup": args.warmup,
        "tolerance": args.tolerance,
        "samples": samples,
        "verdicts": verdicts,
        "cycles": workers.cycles,
        "thread_names": names,
        "problems": problems,
        "pass": ok,
    }
    path = RESULTS_DIR / f"soak-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path.relative_to(BENCH_DIR.parent)}")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
