"""The cluster tests' fault proxy (tests/cluster/proxy.py) against a real echo server: it
passes, cuts, blackholes (and lets through again), delays, throttles, and answers HTTP 503."""

from __future__ import annotations

import http.client
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
from cluster.proxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(1 << 16):
                self.request.sendall(data)
        except ConnectionResetError:  # the proxy cut the connection: what a test asked for
            return


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = FaultProxy(f"127.0.0.1:{server.server_address[1]}", name="echo")
    try:
        yield proxy
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()


def connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        part = sock.recv(1 << 16)
        if not part:
            break
        got += part
    return got


def test_pass_cut_and_pass_again(proxy):
    with connect(proxy) as sock:
        assert echo(sock, b"hello") == b"hello"
        proxy.set_mode("cut")
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(3):  # the reset may show on the first send or the next recv
                if not echo(sock, b"x"):
                    raise ConnectionResetError("closed")
    # A cut proxy may reset the new connection before create_connection returns.
    with pytest.raises((ConnectionResetError, BrokenPipeError)), connect(proxy) as sock:
        if not echo(sock, b"x"):
            raise ConnectionResetError("closed")
    proxy.set_mode("pass")
    with connect(proxy) as sock:
        assert echo(sock, b"again") == b"again"
    assert proxy.stats.resets >= 2 and proxy.stats.bytes_up >= len(b"helloagain")


def test_a_blackhole_keeps_the_socket_and_forwards_nothing_until_it_heals(proxy):
    with connect(proxy) as sock, connect(proxy) as other:
        assert echo(sock, b"before") == b"before"
        proxy.set_mode("blackhole")
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):  # no answer, and no end either
            sock.recv(10)
        fresh = connect(proxy)  # accepted, then held
        fresh.sendall(b"new")
        proxy.set_mode("pass")
        sock.settimeout(5)
        assert echo(sock, b"") == b"" and sock.recv(10) == b"held"
        assert fresh.recv(10) == b"new"
        assert echo(other, b"other") == b"other"
        fresh.close()


def test_latency_and_bandwidth(proxy):
    with connect(proxy) as sock:
        proxy.set_latency(0.1)
        start = time.monotonic()
        assert echo(sock, b"ping") == b"ping"
        assert 0.2 <= time.monotonic() - start < 2.0  # once each way
        proxy.set_latency(0.0)
        proxy.set_bandwidth(200_000)
        payload = bytes(range(256)) * 400  # 100 kB up, then down: about 0.5 s each way
        start = time.monotonic()
        assert echo(sock, payload) == payload
        assert 0.8 <= time.monotonic() - start < 5.0


def test_http_503_answers_every_request(proxy):
    proxy.set_mode("http503")
    for method, body in (("GET", None), ("PUT", b"x" * 5000)):
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request(method, "/bucket/key", body=body)
        reply = conn.getresponse()
        assert reply.status == 503 and b"<Code>ServiceUnavailable</Code>" in reply.read()
        conn.close()
    assert proxy.stats.answered_503 == 2
