"""Child processes of the benchmark: servers that print an address, workers that print JSON.

Every child's stdout is read by a thread into a queue, so waiting for a line
has a timeout and never blocks on a pipe. Peak memory and CPU time of a child
come from /proc (VmHWM, utime + stime), read before the child is stopped.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from recorder_client import RecorderUnavailableError
from recorder_client._launch import ServerProcess

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM / VmRSS / VmSize of a process in bytes (empty when it is gone)."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "VmSize"):
            out[key] = int(value.split()[0]) * 1024
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (0.0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the ")": state is field 3 of stat(5); utime and stime are fields 14, 15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_cpu_s() -> dict[str, float]:
    """Machine-wide CPU seconds so far (all processes, all cores) from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return {}
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return {
        "busy_s": (user + nice + system + irq + softirq) / _CLK_TCK,
        "steal_s": steal / _CLK_TCK,
        "idle_s": (idle + iowait) / _CLK_TCK,
    }


def tree_cpu_s(root: int | None = None) -> dict[int, float]:
    """CPU seconds of `root` (default: this process) and every descendant, by pid.

    Every benchmark process (servers, workers, Ray's raylet and actors, py-spy)
    descends from bench/run.py; anything else on a shared machine does not.
    """
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, float] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in cpu:
            out[pid] = cpu[pid]
        stack.extend(children.get(pid, ()))
    return out


def machine_snapshot() -> dict[str, Any]:
    return {**machine_cpu_s(), "tree": tree_cpu_s()}


def machine_window(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict:
    """Busy cores over a window: the whole machine (every process, ours or not) and ours.

    "Ours" is every process under bench/run.py; the difference is other jobs on
    a shared machine (or kernel work not charged to a process).
    """
    if not before or not after or wall_s <= 0:
        return {}
    out = {
        "busy_cores": (after["busy_s"] - before["busy_s"]) / wall_s,
        "steal_cores": (after["steal_s"] - before["steal_s"]) / wall_s,
        "window_s": wall_s,
    }
    if "tree" in before and "tree" in after:
        t0, t1 = before["tree"], after["tree"]
        ours = sum(cpu - t0.get(pid, 0.0) for pid, cpu in t1.items())
        out["ours_cpu_s"] = ours
        out["ours_busy_cores"] = ours / wall_s
    return out


class Watched:
    """A child process with a log file: its log's tail, peak memory and CPU time."""

    log_path: Path
    pid: int

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""

    def status(self) -> dict[str, int]:
        return proc_status(self.pid)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)


class Child(Watched):
    """A subprocess whose stdout lines arrive in a queue."""

    def __init__(self, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def read_line(self, timeout: float, *, prefix: str = "") -> str:
        """The next stdout line starting with `prefix` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.argv[:4]}: no {prefix!r} line within {timeout}s")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(5)
                raise RuntimeError(
                    f"{' '.join(self.argv[:4])} exited with {self.proc.returncode}: "
                    f"{self.log_tail()}"
                )
            if line.startswith(prefix):
                return line

    def read_json(self, event: str, timeout: float) -> dict[str, Any]:
        line = self.read_line(timeout, prefix="{")
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise RuntimeError(f"worker {self.pid} failed: {msg.get('error')}\n{self.log_tail()}")
        if msg.get("event") != event:
            raise RuntimeError(f"worker {self.pid}: expected event {event!r}, got {msg}")
        return msg

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        self._log.close()
        return self.proc.returncode


def extract_code(rev: str, dest: Path) -> tuple[Path, str]:
    """client/ and server/ as committed at git `rev`, under dest as importable packages:
    returns (the directory to put first on PYTHONPATH, the commit)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, "client", "server"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    pkgs = dest / "pkgs"
    pkgs.mkdir()
    (pkgs / "recorder_client").symlink_to(dest / "client", target_is_directory=True)
    (pkgs / "recorder_server").symlink_to(dest / "server", target_is_directory=True)
    return pkgs, sha


class RecorderServer(ServerProcess, Watched):
    """`rollout-recorder serve --listen 127.0.0.1:0` plus any extra flags, its stderr in a log
    (started and waited for by the project's one launcher)."""

    def __init__(
        self,
        data_dir: Path,
        extra_args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.extra_args = list(extra_args)
        args = ["--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *extra_args]
        try:
            super().__init__(args, stderr=self._log, env={**os.environ, **env} if env else None)
        except RecorderUnavailableError as exc:
            self._log.close()
            raise RuntimeError(f"{exc}: {self.log_tail()}") from None

    def stop(self, timeout: float = 20.0) -> int:
        try:
            return super().stop(timeout)
        finally:
            self._log.close()

    def kill(self) -> int:
        try:
            return super().kill()
        finally:
            self._log.close()


class DashboardServer(RecorderServer):
    """`RecorderServer` with `--http-listen 127.0.0.1:0`: `http_address` is the dashboard's,
    from the line the server prints before it listens."""

    def __init__(
        self,
        data_dir: Path,
        extra_args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(data_dir, ["--http-listen", "127.0.0.1:0", *extra_args], log_path, env)
        prefix = "rollout-recorder dashboard at "
        line = next((line for line in self.preamble if line.startswith(prefix)), None)
        if line is None:
            self.stop()
            raise RuntimeError(f"the server printed no dashboard address: {self.preamble}")
        self.http_address = line[len(prefix) :].strip().removeprefix("http://").rstrip("/")


class RawGrpcServer(Child):
    """bench/raw_server.py: a generic gRPC stream that counts bytes and acks."""

    def __init__(self, log_path: Path, *, aio: bool = False) -> None:
        argv = [sys.executable, str(BENCH_DIR / "raw_server.py"), "127.0.0.1:0"]
        argv += ["--aio"] if aio else []
        super().__init__(argv, log_path=log_path)
        line = self.read_line(60, prefix="raw-grpc listening on ")
        self.address = line.rsplit(" ", 1)[1].strip()


def start_workers(specs: list[dict[str, Any]], log_dir: Path) -> list[Child]:
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = []
    for i, spec in enumerate(specs):
        argv = [sys.executable, str(BENCH_DIR / "worker.py"), json.dumps(spec)]
        workers.append(Child(argv, log_path=log_dir / f"worker-{spec['mode']}-{i}.log"))
    return workers


def run_workers(
    specs: list[dict[str, Any]],
    log_dir: Path,
    *,
    timeout: float = 300.0,
    on_ready: Callable[[list[Child]], None] | None = None,
) -> tuple[list[dict[str, Any]], int, dict[str, float]]:
    """Start workers, wait until each is ready, release them together, collect results.

    Returns each worker's result, the perf_counter_ns at which "go" was sent
    (CLOCK_MONOTONIC: comparable with the workers' own timestamps on Linux), and
    the machine-wide CPU use from "go" until the last result arrived.
    """
    workers = start_workers(specs, log_dir)
    try:
        for w in workers:
            w.read_json("ready", timeout)
        if on_ready is not None:
            on_ready(workers)
        cpu0 = machine_snapshot()
        go_ns = time.perf_counter_ns()
        for w in workers:
            w.send("go")
        results = [w.read_json("result", timeout) for w in workers]
        window = (time.perf_counter_ns() - go_ns) / 1e9
        machine = machine_window(cpu0, machine_snapshot(), window)
        for w in workers:
            w.proc.wait(60)
        return results, go_ns, machine
    finally:
        for w in workers:
            w.stop()
