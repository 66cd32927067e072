"""A TCP fault proxy the cluster tests control: one listening port in front of one upstream,
on a background asyncio loop, needing no root and no kernel features.

Modes (`set_mode`), applied to open connections at once and to every new one:

- ``pass``: bytes flow both ways (after `latency` seconds, at most `bandwidth` bytes/s each
  way when set);
- ``cut``: every connection is reset (both sides) and new ones are reset on accept, as a link
  that drops;
- ``blackhole``: sockets stay open and nothing is forwarded either way (new connections are
  accepted and held), as a peer that stops answering; only timeouts and keepalives notice.
  Back to ``pass``, what was held flows again, as TCP delivers after a partition heals;
- ``http503``: for an HTTP upstream (S3): open connections are reset, and every request on a
  new one is answered ``503 Service Unavailable`` (an S3 error body) by the proxy itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

MODES = ("pass", "cut", "blackhole", "http503")
_READ = 1 << 16
_503_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class _Loop:
    """One asyncio loop on a daemon thread, shared by every proxy of the process."""

    _shared: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="fault-proxy", daemon=True).start()

    @classmethod
    def get(cls) -> _Loop:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def run(self, coro: Coroutine, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@dataclass
class ProxyStats:
    """What a proxy saw (counters only grow)."""

    connections: int = 0
    resets: int = 0
    bytes_up: int = 0  # client to upstream
    bytes_down: int = 0
    answered_503: int = 0


class _Pace:
    """A token bucket per direction: `bandwidth` bytes/s shared by the proxy's connections."""

    def __init__(self) -> None:
        self.free_at = 0.0

    async def take(self, nbytes: int, rate: float | None) -> None:
        if not rate:
            return
        now = time.monotonic()
        self.free_at = max(self.free_at, now) + nbytes / rate
        if self.free_at > now:
            await asyncio.sleep(self.free_at - now)


class _Conn:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task] = []

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _reset(writer)
        for task in self.tasks:
            task.cancel()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees the connection reset, not a clean end."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Listens on 127.0.0.1 (port 0 by default) and forwards to ``upstream`` ("host:port")."""

    def __init__(self, upstream: str, *, name: str = "", port: int = 0) -> None:
        host, _, up_port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(up_port))
        self.name = name or upstream
        self.mode = "pass"
        self.latency = 0.0
        self.bandwidth: float | None = None
        self.stats = ProxyStats()
        self._conns: set[_Conn] = set()
        self._pace = {"up": _Pace(), "down": _Pace()}
        self._loop = _Loop.get()
        self._changed: asyncio.Event | None = None
        self._server = self._loop.run(self._start(port))
        self.port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    # -- control, from any thread ----------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self._loop.run(self._set_mode(mode))

    def set_latency(self, seconds: float) -> None:
        """Delay every forwarded read by ``seconds``, each way."""
        self.latency = float(seconds)

    def set_bandwidth(self, bytes_per_second: float | None) -> None:
        """At most this many bytes per second each way (None: unlimited)."""
        self.bandwidth = bytes_per_second

    def active(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        self._loop.run(self._close())

    def __repr__(self) -> str:
        return f"FaultProxy({self.name}: {self.address} -> {self.upstream}, {self.mode})"

    # -- the loop side ----------------------------------------------------------------------
    async def _start(self, port: int) -> asyncio.base_events.Server:
        self._changed = asyncio.Event()
        return await asyncio.start_server(self._accept, "127.0.0.1", port)

    async def _set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode in ("cut", "http503"):
            for conn in list(self._conns):
                conn.reset()
                self.stats.resets += 1
            self._conns.clear()
        self._changed.set()  # wake the pumps held by a blackhole
        self._changed = asyncio.Event()

    async def _close(self) -> None:
        self._server.close()
        for conn in list(self._conns):
            conn.reset()
        self._conns.clear()
        self._changed.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self.mode == "cut":
            self.stats.resets += 1
            _reset(writer)
            return
        if self.mode == "http503":
            await self._answer_503(reader, writer)
            return
        conn = _Conn(writer)
        self._conns.add(conn)
        try:
            while self.mode == "blackhole":  # the connection is held, the upstream not dialled
                await self._changed.wait()
            if conn not in self._conns:  # reset meanwhile
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                _reset(writer)
                return
            conn.upstream = up_writer
            conn.tasks = [
                asyncio.ensure_future(self._pump(reader, up_writer, "up")),
                asyncio.ensure_future(self._pump(up_reader, writer, "down")),
            ]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.upstream):
                if w is not None:
                    w.close()

    async def _hold(self) -> None:
        while self.mode == "blackhole":
            await self._changed.wait()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: str) -> None:
        try:
            while True:
                await self._hold()
                data = await src.read(_READ)
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        dst.write_eof()
                    return
                if self.latency:
                    await asyncio.sleep(self.latency)
                await self._pace[way].take(len(data), self.bandwidth)
                await self._hold()  # read before a blackhole began: held, not forwarded
                if self.mode == "cut":
                    return
                dst.write(data)
                await dst.drain()
                if way == "up":
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
        except (OSError, asyncio.IncompleteReadError):
            return

    async def _answer_503(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """Answer each HTTP request with 503 (the body read first unless the client waits for
        100-continue), then close."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            headers = {}
            for line in head.decode("latin-1").split("\r\n")[1:]:
                key, sep, value = line.partition(":")
                if sep:
                    headers[key.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if length and headers.get("expect", "").lower() != "100-continue":
                await asyncio.wait_for(reader.readexactly(length), 30)
            self.stats.answered_503 += 1
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(_503_BODY)}\r\nConnection: close\r\n\r\n".encode()
                + _503_BODY
            )
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()
