"""The embedded default: a private `rollout-recorder serve` on a unix socket.

Started when no target is given. The server is a child process that watches
its stdin: when this process exits, even by kill -9, the pipe closes and the
server stops by itself.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

from .errors import RecorderUnavailableError

logger = logging.getLogger(__name__)

_READY_PREFIX = "rollout-recorder listening on "


class EmbeddedServer:
    def __init__(self, startup_timeout: float = 30.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="rollout-recorder-")
        socket_path = os.path.join(self._dir, "recorder.sock")
        cmd = [
            sys.executable,
            "-m",
            "recorder_server",
            "serve",
            "--listen",
            f"unix:{socket_path}",
            "--data-dir",
            os.path.join(self._dir, "data"),
            "--exit-with-stdin",
            # Its data directory is deleted on close: a log would only cost time.
            "--no-wal",
            "--grace",
            "1",
        ]
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            start_new_session=True,
        )
        self.target = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if ready:
                line = self.process.stdout.readline()
                if line.startswith(_READY_PREFIX):
                    return line[len(_READY_PREFIX) :].strip()
        code = self.process.poll()
        self.stop()
        raise RecorderUnavailableError(
            f"the embedded recorder server did not start within {timeout}s"
            + (f" (exit status {code})" if code is not None else "")
        )

    def stop(self, timeout: float = 5.0) -> None:
        proc = self.process
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        shutil.rmtree(self._dir, ignore_errors=True)
