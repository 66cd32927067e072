"""Fixtures: real recorder servers on real ports (in-process or as a subprocess)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from recorder_client import _launch, _wire
from recorder_server.chunks import Chunk, encoded_array

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
# The moto S3 launcher is shared with the bench (bench/moto_s3.py imports only the standard
# library). Appended, so that nothing under bench/ shadows a test module or a package.
if str(TESTS.parent / "bench") not in sys.path:
    sys.path.append(str(TESTS.parent / "bench"))

from moto_s3 import S3Server  # noqa: E402

# Stable-Baselines3 makes a log directory under the system's temp directory for every
# learn() (its examples here run as subprocesses too): one for the run, removed at its end.
if "SB3_LOGDIR" not in os.environ:
    os.environ["SB3_LOGDIR"] = tempfile.mkdtemp(prefix="rr-tests-sb3-")
    atexit.register(shutil.rmtree, os.environ["SB3_LOGDIR"], ignore_errors=True)


@pytest.fixture
def server(tmp_path: Path) -> Iterator:
    """An in-process server on 127.0.0.1, port 0."""
    from recorder_server import ServerOptions, start_server

    running = start_server(ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "data")))
    try:
        yield running
    finally:
        running.stop(grace=0)


@pytest.fixture
def target(server) -> str:
    return server.address


class ServerProcess(_launch.ServerProcess):
    """`rollout-recorder serve` as a child process on 127.0.0.1, port 0; `address` is where
    it listens."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        super().__init__(["--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *extra])


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path / "data")
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real size-limited tmpfs (needs root); the test is skipped where mounting fails."""
    if not sys.platform.startswith("linux"):
        pytest.skip("tmpfs mounts need Linux")
    mount_point.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")
    try:
        yield mount_point
    finally:
        done = subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=10)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem to fill up."""
    with mounted_tmpfs(tmp_path / "small", "1m") as mount_point:
        yield mount_point


def core_chunk(sequence: int, arrays: dict) -> Chunk:
    """A chunk as the gRPC edge hands it to a session (headers checked, bytes encoded)."""
    encoded = {}
    for key, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        codec, data = _wire.encode(arr)
        encoded[key] = encoded_array(
            arr.dtype.str, arr.shape, arr.nbytes, codec, data, key, 1 << 40
        )
    return Chunk(sequence, encoded)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def child_pids(pid: int | None = None) -> list[int]:
    """The direct children of a process (this one by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out.extend(
                int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            )
        except OSError:
            continue
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def export(target: str, session: str, to, *flags: str) -> subprocess.CompletedProcess:
    """`rollout-recorder export` of a session to ``to``, as a command."""
    return subprocess.run(
        [sys.executable, "-m", "recorder_server", "export", "--target", target]
        + ["--session", session, "--to", str(to), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, for a server a test
    starts (and may restart on it). Picked below the kernel's ephemeral range: a port from
    bind(0) can be handed to another socket's bind(0), a proxy's or a client's outgoing
    connection, before the server binds it ("Address already in use" at a node's start).
    Never the same port twice in one process."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = 10000
    tries = 500 if ephemeral_low - low >= 1000 else 0  # none: no room below the range
    for port in (random.randrange(low, ephemeral_low) for _ in range(tries)):
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RestartableServer:
    """`rollout-recorder serve` on a fixed 127.0.0.1 port with its stderr appended to a log
    file. `kill()` (SIGKILL) or `stop()` (SIGTERM), then `start()` again on the same port and
    data directory: a crash and a restart, as clients see them."""

    def __init__(self, data_dir: Path, *extra: str, log_path: Path | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra = extra
        self.log_path = log_path or data_dir.parent / f"server-{self.port}.log"
        self.process: _launch.ServerProcess | None = None
        self._log = None

    def start(self, startup_timeout: float = 60.0) -> RestartableServer:
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed by kill() and stop()
        args = ["--listen", self.address, "--data-dir", str(self.data_dir), *self.extra]
        try:
            self.process = _launch.ServerProcess(
                args, stderr=self._log, startup_timeout=startup_timeout
            )
        except BaseException:
            self._log.close()
            raise
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
        if self._log is not None:
            self._log.close()

    def stop(self, timeout: float = 20.0) -> int | None:
        code = self.process.stop(timeout) if self.process is not None else None
        if self._log is not None:
            self._log.close()
        return code

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """A real S3-compatible server for the test run, the AWS variables set in this process
    (and so in the servers it starts); one per run, as filesystem clients are cached."""
    server = S3Server()  # nothing written: its output is discarded
    saved = {k: os.environ.get(k) for k in server.environment}
    os.environ.update(server.environment)
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def http(url: str, *, token: str | None = None, data: bytes | None = None, opener=None):
    """(status, headers, body) of one request; errors are answers too."""
    request = urllib.request.Request(url, data=data)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with (opener or urllib.request.build_opener(NoRedirect)).open(request, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are answers to look at, not to follow."""

    def redirect_request(self, *args, **kwargs):
        return None
