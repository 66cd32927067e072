"""One server with default flags holds a thousand open Record streams and still answers.

Four worker processes run 250 recorder threads each; every recorder joins one session,
records, and keeps its stream open. Meanwhile `rollout-recorder health` is asked again and
again, and a 1,001st client's finish() must answer within two seconds.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import ServerProcess

from recorder_client import RolloutRecorder

PROCESSES, THREADS = 4, 250
T, N = 4, 2

WORKERS = textwrap.dedent(
    """
    import sys, threading, traceback
    import numpy as np
    from recorder_client import RolloutRecorder

    target, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    T, N = {t}, {n}
    recorders = [None] * count
    failures = []

    def chunk(seed):
        rng = np.random.default_rng(seed)
        return {{
            "action": rng.integers(0, 4, (T, N), dtype=np.int32),
            "reward": rng.random((T, N), dtype=np.float32),
            "done": rng.random((T, N)) < 0.3,
        }}

    def start(i):
        try:
            rec = RolloutRecorder(target=target, session="many", worker_id=f"w{{first + i}}",
                                  connect_timeout=120)
            rec.record(chunk(first + i))
            rec.flush(120)
            recorders[i] = rec
        except Exception:
            failures.append(traceback.format_exc(limit=-12))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("ready", len(failures), failures[:3], flush=True)
    sys.stdin.readline()  # every stream stays open until the test says so
    for rec in recorders:
        if rec is not None:
            rec.record(chunk(0))
    for rec in recorders:
        if rec is not None:
            rec.close()
    print("closed", flush=True)
    """
).format(t=T, n=N)


def _rss_peak(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


class HealthWatch:
    """`rollout-recorder health` asked in a loop; every answer kept."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            done = subprocess.run(
                [sys.executable, "-m", "recorder_server", "health", "--target", self.target],
                capture_output=True,
                text=True,
                timeout=60,
            )
            self.answers.append((done.returncode, done.stdout.strip()))

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        self._thread.join(90)
        return self.answers


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_thousand_open_streams_and_finish_answers_at_once(tmp_path):
    server = ServerProcess(tmp_path / "data")  # default flags but the port and data dir
    watch = HealthWatch(server.address)
    procs = []
    try:
        for p in range(PROCESSES):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKERS, server.address, str(p * THREADS), str(THREADS)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            line = proc.stdout.readline()
            assert line.startswith("ready 0 "), line
        # 1,000 workers joined, recorded, and hold their streams open.
        with RolloutRecorder(target=server.address, session="many", worker_id="viewer") as viewer:
            began = time.perf_counter()
            out = viewer.finish()
            finish_s = time.perf_counter() - began
            status = viewer.status()
            began = time.perf_counter()
            viewer.status()
            status_s = time.perf_counter() - began
        workers = [w for w in status.workers if w.worker_id != "viewer"]
        assert len(workers) == PROCESSES * THREADS
        assert all(w.chunks_stored == 1 and w.num_envs == N for w in workers)
        assert out.num_episodes >= PROCESSES * THREADS * N
        assert finish_s < 2.0, finish_s
        assert status_s < 2.0, status_s
        for proc in procs:
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout.readline().startswith("closed")
            assert proc.wait(120) == 0
        rss = _rss_peak(server.pid)
    finally:
        answers = watch.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        server.stop()
    print(
        f"{len(workers)} open streams: finish {finish_s:.3f}s, status {status_s:.3f}s, "
        f"{len(answers)} health answers, server peak RSS {rss / 2**20:.0f} MiB"
    )
    assert len(answers) >= 3, answers
    assert all(code == 0 and text.startswith("SERVING") for code, text in answers), answers
    assert rss < 1 << 30, f"server peak RSS {rss / 2**20:.0f} MiB"
