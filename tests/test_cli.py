"""`rollout-recorder serve`: prints its bound address, stops cleanly on signals."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from conftest import ServerProcess

from recorder_client import RolloutRecorder, _launch


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_address_and_stops_on_signal(tmp_path, sig):
    proc = ServerProcess(tmp_path / "data")
    try:
        host, port = proc.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with RolloutRecorder(target=proc.address, session="cli") as rec:
            rec.record(
                {"action": np.zeros((2, 1)), "reward": np.zeros((2, 1)), "done": np.ones((2, 1))}
            )
            assert rec.finish().num_episodes == 2
        proc.process.send_signal(sig)
        assert proc.process.wait(20) == 0
    finally:
        proc.stop()  # never leaves a server behind, even when an assertion failed


def test_serve_on_unix_socket(tmp_path):
    sock = tmp_path / "r.sock"
    server = _launch.ServerProcess(["--listen", f"unix:{sock}", "--data-dir", str(tmp_path / "d")])
    try:
        assert server.address == f"unix:{sock}"
        with RolloutRecorder(target=f"unix:{sock}") as rec:
            assert rec.status().session == "default"
    finally:
        assert server.stop() == 0


def test_serve_reports_a_busy_port(tmp_path, server_process):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recorder_server",
            "serve",
            "--listen",
            server_process.address,
            "--data-dir",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "cannot listen" in out.stderr


def test_serve_refuses_a_log_of_another_format_and_says_so(tmp_path):
    """A data directory whose log another version wrote is not replayed record by record
    (which would drop what it cannot read): the server refuses to start, naming why."""
    wal_dir = tmp_path / "data" / "wal"
    wal_dir.mkdir(parents=True)
    # The documented segment header, with format version 1.
    head = b"RRWALSEG" + struct.pack("<HHQ", 1, 0, 0)
    (wal_dir / "wal-0000000000000000.log").write_bytes(head + struct.pack("<I", zlib.crc32(head)))
    out = subprocess.run(
        [sys.executable, "-m", "recorder_server", "serve", "--listen", "127.0.0.1:0"]
        + ["--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "segment format version 1 is not supported" in out.stderr
    assert "another version of rollout-recorder" in out.stderr
