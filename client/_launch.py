"""Start `rollout-recorder serve` as a child process and wait until it listens.

One helper for every place that needs a server process: the embedded default (no target
given), the demo, the tests and the benchmarks. The server prints
``rollout-recorder listening on ADDRESS`` on stdout once it accepts calls.

The embedded server watches its stdin (``--exit-with-stdin``): when this process exits, even
by kill -9, the pipe closes and the server stops by itself.

Unless the caller redirects it, the child's stderr is copied to ours as it comes and its last
lines are kept, so that a server that exits before it listens (a bad flag, a missing package)
is reported with its exit status and the end of what it printed.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from .errors import RecorderUnavailableError

READY_PREFIX = "rollout-recorder listening on "

# How much of the child's stderr an error message quotes.
_TAIL_BYTES = 4096
_TAIL_LINES = 20


class _StderrTee:
    """Copies a child's stderr pipe to our fd 2 as it arrives and keeps its last bytes.

    Raw fd reads and writes in a daemon thread: no buffered stream lock is held, so the
    thread cannot block this interpreter's exit. The thread closes the pipe at EOF.
    """

    def __init__(self, pipe: IO) -> None:
        self._pipe = pipe
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._pump, name="recorder-server-stderr", daemon=True
        )
        self._thread.start()

    def _pump(self) -> None:
        fd = self._pipe.fileno()
        try:
            while data := os.read(fd, 65536):
                with self._lock:
                    self._tail += data
                    del self._tail[:-_TAIL_BYTES]
                view = memoryview(data)
                while view:
                    view = view[os.write(2, view) :]
        except OSError:
            pass
        finally:
            try:
                self._pipe.close()
            except OSError:
                pass

    def tail(self, wait: float = 2.0) -> str:
        """The last lines the child wrote (after waiting up to `wait` s for its EOF)."""
        self._thread.join(wait)
        with self._lock:
            text = self._tail.decode("utf-8", errors="replace")
        return "\n".join(text.rstrip().splitlines()[-_TAIL_LINES:])

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class ServerProcess:
    """``python -m recorder_server serve ARGS`` as a child (or ``command``, a whole command
    line that serves, such as an image's); ``address`` is where it listens.

    Raises RecorderUnavailableError when the child exits before it listens (with its exit
    status) or does not listen within ``startup_timeout`` seconds; with ``stderr`` left None
    the message ends with the last lines the child wrote on its stderr.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        command: Sequence[str] | None = None,
        startup_timeout: float = 60.0,
        exit_with_stdin: bool = False,
        stderr: int | IO | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        new_session: bool = False,
    ) -> None:
        cmd = list(command) if command is not None else [python, "-m", "recorder_server"]
        if command is None:
            cmd += ["serve", *args]
        if exit_with_stdin:
            cmd.append("--exit-with-stdin")
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if exit_with_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr is None else stderr,
            text=True,
            env=None if env is None else dict(env),
            start_new_session=new_session,
        )
        self._stderr = None if stderr is not None else _StderrTee(self.process.stderr)
        self.address = self._wait_ready(startup_timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, timeout: float) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        # Raw reads and a buffer of our own: lines before the ready one (the dashboard's
        # address) may arrive in the same read, where a buffered readline would hide the
        # ready line from select().
        fd = stdout.fileno()
        pending = b""
        self.preamble: list[str] = []  # lines before the ready one
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                data = os.read(fd, 65536)
                if not data:  # stdout closed: the child is exiting
                    try:
                        self.process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    break
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode("utf-8", errors="replace")
                    if text.startswith(READY_PREFIX):
                        return text[len(READY_PREFIX) :].strip()
                    self.preamble.append(text)
            elif self.process.poll() is not None:
                break
        code = self.process.poll()
        waited = time.monotonic() - started
        self.stop()
        if code is not None:
            what = (
                f"the recorder server exited with status {code} after {waited:.1f}s, "
                "before it listened"
            )
        else:
            what = f"the recorder server did not listen within {timeout}s"
        raise RecorderUnavailableError(what + self._stderr_tail())

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return " (its error is on its stderr)"
        tail = self._stderr.tail()
        return f"; its stderr ends:\n{tail}" if tail else "; it wrote nothing on stderr"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
        proc = self.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close_pipes()
        return proc.returncode

    def kill(self) -> int:
        """SIGKILL at once (a crash, as far as the server can tell)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._close_pipes()
        return self.process.returncode

    def _close_pipes(self) -> None:
        if self._stderr is not None:
            self._stderr.join(1.0)  # copy what the child wrote last; the tee closes its pipe
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


class EmbeddedServer(ServerProcess):
    """A private server on a unix socket in a temporary directory, removed on stop()."""

    def __init__(self, startup_timeout: float = 60.0) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="rollout-recorder-"))
        socket_path = self.directory / "recorder.sock"
        try:
            super().__init__(
                [
                    "--listen",
                    f"unix:{socket_path}",
                    "--data-dir",
                    str(self.directory / "data"),
                    # Its data directory is deleted on close: a log would only cost time.
                    "--no-wal",
                    "--grace",
                    "1",
                ],
                startup_timeout=startup_timeout,
                exit_with_stdin=True,
                new_session=True,
            )
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def stop(self, timeout: float = 5.0) -> int:
        try:
            return super().stop(timeout)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["READY_PREFIX", "EmbeddedServer", "ServerProcess"]
