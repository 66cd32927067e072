"""The `rollout-recorder` command line: `serve` prints its bound address and stops cleanly on
signals; --version and --log-level; the token and TLS flags of the client commands."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import test_security
from conftest import ServerProcess
from test_security import TOKEN, start_secured

import recorder_client
from recorder_client import RecorderUnavailableError, RolloutRecorder, _launch
from recorder_client._credentials import TOKEN_ENV, TOKEN_FILE_ENV
from recorder_server.cli.main import LOG_ENV, build_parser, main
from recorder_server.cli.sessions import render as render_sessions

# The certificates (a CA, server and client leaves) test_security makes, as a fixture here too.
pki = test_security.pki


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


# -- the command line's own flags -------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rollout-recorder {recorder_client.__version__}"


def test_log_level_takes_any_case_and_refuses_the_rest(monkeypatch, capsys):
    monkeypatch.delenv(LOG_ENV, raising=False)
    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "health"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as info:
        main(["--log-level", "loud", "health"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: rollout-recorder" in err and "got 'loud'" in err and "WARNING" in err
    monkeypatch.setenv(LOG_ENV, "chatty")
    with pytest.raises(SystemExit) as info:
        main(["health", "--target", "127.0.0.1:1"])
    assert info.value.code == 2
    assert f"${LOG_ENV}: expected one of DEBUG" in capsys.readouterr().err


def test_bad_log_level_from_the_environment_is_a_usage_error_not_a_traceback():
    env = {**os.environ, LOG_ENV: "verbose"}
    out = subprocess.run(
        [sys.executable, "-m", "recorder_server", "status", "--target", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"${LOG_ENV}: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in out.stderr


def test_a_server_that_exits_at_start_is_reported_with_its_status_and_stderr():
    with pytest.raises(RecorderUnavailableError) as info:
        _launch.ServerProcess(["--no-such-flag"])
    message = str(info.value)
    assert "exited with status 2" in message
    assert "unrecognized arguments: --no-such-flag" in message


def test_a_metrics_endpoint_without_prometheus_client_names_the_extra(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    args = ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path), "--no-wal"]
    assert main([*args, "--metrics-listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "needs prometheus-client" in err and "pip install 'rollout-recorder[server]'" in err


# -- token and TLS flags of the client commands ------------------------------------------------
@pytest.fixture
def no_token_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def status_once(address: str, *flags: str) -> int:
    return main(["status", "--target", address, "--once", "--timeout", "5", *flags])


def test_status_takes_the_token_from_its_flag_or_the_environment(
    no_token_env, token_file, monkeypatch, capsys
):
    running = start_secured()
    try:
        assert status_once(running.address) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert status_once(running.address, "--token-file", token_file) == 0
        assert capsys.readouterr().out.startswith("rollout-recorder: 0 sessions")
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        assert status_once(running.address) == 0
        monkeypatch.delenv(TOKEN_ENV)
        monkeypatch.setenv(TOKEN_FILE_ENV, token_file)
        assert status_once(running.address) == 0
        capsys.readouterr()
        # The flag wins over the environment.
        wrong = Path(token_file).with_name("wrong")
        wrong.write_text("wrong-token")
        assert status_once(running.address, "--token-file", str(wrong)) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert status_once(running.address, "--token-file", str(wrong) + ".missing") == 1
        assert "--token-file" in capsys.readouterr().err
    finally:
        running.stop()


def test_status_health_and_demo_worker_over_tls(no_token_env, token_file, pki, capsys):
    running = start_secured(tls=(pki.server_cert, pki.server_key))
    try:
        assert status_once(running.address, "--token-file", token_file) == 1
        assert "--tls-ca" in capsys.readouterr().err  # the handshake hint
        tls = ["--token-file", token_file, "--tls-ca", str(pki.ca)]
        assert status_once(running.address, *tls) == 0
        assert main(["health", "--target", running.address, "--tls-ca", str(pki.ca)]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith("SERVING")
        worker = ["demo-worker", "--target", running.address, "--session", "tls"]
        small = ["--worker-id", "w0", "--chunks", "2", "--length", "8", "--envs", "3"]
        assert main([*worker, *small, *tls]) == 0
        assert capsys.readouterr().out.startswith("worker w0: 2 chunks")
        assert main(["status", "--target", running.address, "--json", *tls]) == 0
        reply = json.loads(capsys.readouterr().out)
        assert [s["session"] for s in reply["sessions"]] == ["tls"]
        assert main([*worker, *small, "--token-file", token_file]) == 1  # no --tls-ca
        assert "rollout-recorder demo-worker:" in capsys.readouterr().err
    finally:
        running.stop()


def test_mutual_tls_flags(no_token_env, token_file, pki, capsys):
    running = start_secured(tls=(pki.server_cert, pki.server_key), client_ca=pki.ca)
    try:
        tls = ["--token-file", token_file, "--tls-ca", str(pki.ca)]
        mine = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
        assert status_once(running.address, *tls, *mine) == 0
        assert status_once(running.address, *tls) == 1
        assert status_once(running.address, *tls, "--tls-cert", str(pki.client_cert)) == 1
        assert "--tls-cert and --tls-key: expected both or neither" in capsys.readouterr().err
        assert main(["health", "--target", running.address, "--tls-ca", str(pki.ca), *mine]) == 0
    finally:
        running.stop()


# -- sessions list | drop ----------------------------------------------------------------------
def record_one(address: str, session: str, **kw) -> None:
    done = np.zeros((4, 2), bool)
    done[1, 0] = done[3, 1] = True
    with RolloutRecorder(target=address, session=session, **kw) as rec:
        rec.record({"action": np.zeros((4, 2)), "reward": np.ones((4, 2)), "done": done})
        rec.flush()


def test_sessions_list_and_drop(no_token_env, token_file, capsys):
    running = start_secured()
    try:
        creds = ["--target", running.address, "--token-file", token_file]
        assert main(["sessions", "list", *creds]) == 0
        assert capsys.readouterr().out.strip() == "no sessions"
        for name in ("beta", "alpha"):
            record_one(running.address, name, token=TOKEN)
        assert main(["sessions", "list", *creds]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:3] == ["session", "workers", "episodes"]
        assert [line.split()[0] for line in lines[1:]] == ["alpha", "beta"]
        assert len({len(line) for line in lines}) == 1  # aligned: every line as wide
        assert lines[1].split()[2] == "2"  # two episodes finished

        assert main(["sessions", "list", "--json", *creds]) == 0
        listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
        assert set(listed) == {"alpha", "beta"}
        assert listed["alpha"]["episodes"] == 2 and listed["alpha"]["raw_bytes"] > 0
        for key in ("workers", "wire_bytes", "idle_seconds"):
            assert key in listed["alpha"]

        assert main(["sessions", "drop", "alpha", *creds]) == 0
        assert "dropped session 'alpha'" in capsys.readouterr().out
        assert main(["sessions", "list", "--json", *creds]) == 0
        assert [s["name"] for s in json.loads(capsys.readouterr().out)] == ["beta"]

        # An unknown name, a missing token, a dead port: exit 1, one line.
        assert main(["sessions", "drop", "alpha", *creds]) == 1
        err = capsys.readouterr().err
        assert err.startswith("rollout-recorder sessions drop: ") and err.count("\n") == 1
        assert main(["sessions", "list", "--target", running.address]) == 1
        assert "rollout-recorder sessions list: " in capsys.readouterr().err
    finally:
        running.stop()
    assert main(["sessions", "list", "--target", running.address, "--timeout", "1"]) == 1
    assert capsys.readouterr().err.startswith("rollout-recorder sessions list: ")


def test_sessions_over_mutual_tls(no_token_env, token_file, pki, capsys):
    running = start_secured(tls=(pki.server_cert, pki.server_key), client_ca=pki.ca)
    try:
        tls = {"root_certificates": pki.ca, "client_certificate": pki.client_cert}
        record_one(running.address, "m", token=TOKEN, client_key=pki.client_key, **tls)
        creds = ["--target", running.address, "--token-file", token_file, "--tls-ca", str(pki.ca)]
        mine = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
        assert main(["sessions", "list", *creds, *mine]) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[0] == "m"
        assert main(["sessions", "list", *creds]) == 1  # no client certificate
        capsys.readouterr()
        assert main(["sessions", "drop", "m", *creds, *mine]) == 0
    finally:
        running.stop()


def test_sessions_table_is_aligned():
    rows = [
        {
            "name": "a",
            "workers": 1,
            "episodes": 12345,
            "raw_bytes": 5e6,
            "wire_bytes": 1e6,
            "idle_seconds": 3.2,
        },
        {
            "name": "longer-name",
            "workers": 100,
            "episodes": 0,
            "raw_bytes": 0,
            "wire_bytes": 0,
            "idle_seconds": 1000.0,
        },
    ]
    lines = render_sessions(rows).splitlines()
    assert lines[0].split() == [
        "session",
        "workers",
        "episodes",
        "raw",
        "MB",
        "wire",
        "MB",
        "idle",
        "s",
    ]
    assert lines[1].split() == ["a", "1", "12345", "5.0", "1.0", "3"]
    assert lines[2].split() == ["longer-name", "100", "0", "0.0", "0.0", "1000"]
    assert len({len(line) for line in lines}) == 1
