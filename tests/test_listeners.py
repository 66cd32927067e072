"""The HTTP listeners beside gRPC: the Prometheus endpoint (`--metrics-listen`) behind the
token, the dashboard's login cookie (expiry, logout), and the HTTP server under them
(`recorder_server.httpserve`): read timeouts, the connection cap, and slow peers that cost no
thread, checked against a real `rollout-recorder serve` subprocess.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

import pytest
from conftest import NoRedirect, http

from recorder_server import ServerOptions, start_server
from recorder_server.durability import DurabilityOptions
from recorder_server.httpserve import HttpListener

TOKEN = "listeners-test-token-0123456789"


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def _server(tmp_path: Path, **options):
    return start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            durability=DurabilityOptions(enabled=False),
            **options,
        )
    )


class _Serve:
    """A `rollout-recorder serve` subprocess; its stderr lines are collected as they come."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        exe = Path(sys.executable).with_name("rollout-recorder")
        command = [str(exe)] if exe.exists() else [sys.executable, "-m", "recorder_server"]
        self.proc = subprocess.Popen(
            [*command, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
            + ["--no-wal", "--token-file", _token_file(tmp_path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.stdout: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            if line.startswith("rollout-recorder listening on "):
                break
        else:
            raise AssertionError(f"serve did not start: {self.stdout} {self.log}")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def address(self, pattern: str, text: str) -> str:
        found = re.search(pattern, text)
        assert found, (pattern, text)
        return found.group(1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            assert self.proc.wait(timeout=30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


# ---------------------------------------------------------------------------------------------
# --metrics-listen


def test_metrics_listener_requires_the_token(tmp_path: Path):
    running = _server(tmp_path, token_file=_token_file(tmp_path), metrics_listen="127.0.0.1:0")
    try:
        url = f"http://{running.metrics_address}/metrics"
        status, headers, body = http(url)
        assert status == 401 and b"rollout_recorder" not in body
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert http(url, token="wrong-token")[0] == 401
        status, headers, _ = http(url, token=TOKEN)  # no sessions yet: an empty exposition
        assert status == 200 and "version=0.0.4" in headers["Content-Type"]
    finally:
        running.stop(grace=0)


def test_metrics_no_auth_serves_without_the_token_and_warns(tmp_path: Path):
    serve = _Serve(tmp_path, "--metrics-listen", "127.0.0.1:0", "--metrics-no-auth")
    try:
        deadline = time.monotonic() + 10
        while not any("metrics at http://" in line for line in serve.log):
            assert time.monotonic() < deadline, serve.log
            time.sleep(0.05)
        log = "".join(serve.log)
        address = serve.address(r"metrics at http://(\S+)/metrics", log)
        status, headers, _ = http(f"http://{address}/metrics")
        assert status == 200 and "version=0.0.4" in headers["Content-Type"]
        assert re.search(r"WARNING.*--metrics-no-auth", log), log
    finally:
        serve.close()


# ---------------------------------------------------------------------------------------------
# The dashboard's login cookie


def _login(base: str) -> tuple[urllib.request.OpenerDirector, CookieJar]:
    """A browser logged in through the form: its opener and its cookie jar."""
    jar = CookieJar()
    opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPCookieProcessor(jar))
    status, headers, _ = http(base + "/login", data=f"token={TOKEN}".encode(), opener=opener)
    assert status == 303 and len(jar) == 1, headers
    return opener, jar


def test_a_cookie_after_logout_is_refused(tmp_path: Path):
    running = _server(tmp_path, token_file=_token_file(tmp_path), http_listen="127.0.0.1:0")
    try:
        base = f"http://{running.http_address}"
        opener, jar = _login(base)
        (cookie,) = list(jar)
        stolen = f"{cookie.name}={cookie.value}"
        assert http(base + "/api/sessions", opener=opener)[0] == 200
        other, _ = _login(base)  # a second browser stays logged in
        status, headers, _ = http(base + "/logout", opener=opener)
        assert status == 303 and "Max-Age=0" in headers["Set-Cookie"]
        # The old cookie, replayed (a copy kept by whoever had it), is revoked.
        replay = urllib.request.Request(base + "/api/sessions", headers={"Cookie": stolen})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(replay, timeout=10)
        assert refused.value.code == 401
        assert http(base + "/api/sessions", opener=other)[0] == 200
        assert http(base + "/api/sessions", token=TOKEN)[0] == 200
    finally:
        running.stop(grace=0)


def test_a_cookie_expires(tmp_path: Path):
    running = _server(
        tmp_path,
        token_file=_token_file(tmp_path),
        http_listen="127.0.0.1:0",
        dashboard_session_max_age_s=1.0,
    )
    try:
        base = f"http://{running.http_address}"
        _, jar = _login(base)
        (cookie,) = list(jar)
        sent = {"Cookie": f"{cookie.name}={cookie.value}"}
        request = urllib.request.Request(base + "/api/sessions", headers=sent)
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        time.sleep(1.2)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
    finally:
        running.stop(grace=0)


# ---------------------------------------------------------------------------------------------
# The HTTP server under both


def test_slow_peers_hold_no_threads_and_do_not_block_a_request(tmp_path: Path):
    serve = _Serve(tmp_path, "--http-listen", "127.0.0.1:0")
    peers: list[socket.socket] = []
    try:
        address = serve.address(r"dashboard at http://(\S+)/", "".join(serve.stdout))
        host, port = address.rsplit(":", 1)
        for _ in range(300):
            peer = socket.create_connection((host, int(port)), timeout=5)
            peer.sendall(b"GET /api/sessions HT")  # half a request line, then nothing
            peers.append(peer)
        time.sleep(0.5)  # let the server take them all in
        started = time.monotonic()
        status, _, body = http(f"http://{address}/api/sessions", token=TOKEN)
        took = time.monotonic() - started
        assert status == 200 and b'"sessions":[]' in body
        threads = len(os.listdir(f"/proc/{serve.proc.pid}/task"))
        print(f"300 half-sent requests open: answered in {took:.3f} s; {threads} threads")
        assert took < 1.0, took
        assert threads < 100, threads
        assert http(f"http://{address}/api/sessions")[0] == 401
    finally:
        for peer in peers:
            peer.close()
        serve.close()


def _hello(environ, start_response):
    body = f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']} {environ['wsgi.input'].read()!r}"
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [body.encode()]


def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as peer:
        peer.sendall(data)
        chunks = []
        while chunk := peer.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.fixture
def listener():
    made: list[HttpListener] = []

    def make(app=_hello, **kwargs) -> tuple[HttpListener, int]:
        made.append(HttpListener(app, name="test-http", **kwargs))
        return made[-1], made[-1].start("127.0.0.1", 0)[1]

    yield make
    for one in made:
        one.close()


def test_requests_are_parsed_and_bad_ones_refused(listener):
    _, port = listener()
    answer = _raw(port, b"POST /a%20b?q=1 HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"POST /a b b'hello'")
    assert b"Connection: close" in answer and b"Content-Length: 18" in answer
    assert _raw(port, b"NOT A REQUEST\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(port, b"GET / HTTP/1.1\r\nbad header\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    big = b"GET / HTTP/1.1\r\nX: " + b"a" * (20 << 10) + b"\r\n\r\n"
    assert _raw(port, big).startswith(b"HTTP/1.1 431 ")
    huge_body = b"POST / HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n"
    assert _raw(port, huge_body).startswith(b"HTTP/1.1 413 ")
    chunked = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert _raw(port, chunked).startswith(b"HTTP/1.1 501 ")


def test_a_request_not_sent_in_time_gets_408(listener):
    _, port = listener(read_timeout_s=0.3)
    started = time.monotonic()
    assert _raw(port, b"GET / HTTP/1.1\r\n").startswith(b"HTTP/1.1 408 ")
    assert 0.3 <= time.monotonic() - started < 3
    with pytest.raises(ValueError, match="read_timeout_s"):
        HttpListener(_hello, name="x", read_timeout_s=60)


def test_over_the_cap_slow_peers_make_room_and_busy_ones_refuse(listener):
    release = threading.Event()

    def slow(environ, start_response):
        release.wait(10)
        return _hello(environ, start_response)

    server, port = listener(slow, max_connections=2)
    # Two half-sent requests fill the cap; a third connection closes the older one.
    first = socket.create_connection(("127.0.0.1", port), timeout=5)
    first.sendall(b"GET /")
    second = socket.create_connection(("127.0.0.1", port), timeout=5)
    second.sendall(b"GET /")
    time.sleep(0.2)
    answers: list[bytes] = []
    busy = [
        threading.Thread(target=lambda: answers.append(_raw(port, b"GET /x HTTP/1.1\r\n\r\n")))
        for _ in range(2)
    ]
    for thread in busy:
        thread.start()
        time.sleep(0.2)
    assert first.recv(100) == b"" and second.recv(100) == b""  # evicted: closed, no answer
    assert server.evicted == 2
    # Both slots are now answering: a new connection is refused at once.
    started = time.monotonic()
    assert _raw(port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503 ")
    assert time.monotonic() - started < 1 and server.refused == 1
    release.set()
    for thread in busy:
        thread.join(10)
    assert len(answers) == 2 and all(a.endswith(b"GET /x b''") for a in answers)
    first.close()
    second.close()


def test_serve_flags_are_checked(tmp_path: Path):
    exe = [sys.executable, "-m", "recorder_server", "serve"]
    bad = subprocess.run(
        [*exe, "--dashboard-session-max-age", "0", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--dashboard-session-max-age: expected seconds > 0, got '0'" in bad.stderr
