"""A small, strict HTTP/1.1 server for the listeners beside gRPC (the dashboard and the
Prometheus endpoint): one asyncio loop on one thread holds every connection, and a few worker
threads run the WSGI app, so slow or idle peers cost a socket each, never a thread.

- Each connection has ``read_timeout_s`` (at most 10 s) to send its request line, headers and
  body; past it, 408 and close. Headers over 16 KiB get 431, bodies over 64 KiB 413, and
  ``Transfer-Encoding`` (no length up front) 501.
- At most ``max_connections`` are open. A new one over the cap closes the oldest connection
  that has not yet sent a whole request (a slow or idle peer); when every open connection is
  being answered, the new one gets 503 at once.
- One request per connection (``Connection: close``), as the threaded wsgiref server did.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

logger = logging.getLogger(__name__)

MAX_READ_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 << 10
MAX_BODY_BYTES = 64 << 10
_WRITE_TIMEOUT_S = 30.0
_REQUEST_LINE = re.compile(r"([A-Z]{1,16}) (\S{1,8000}) HTTP/(1\.[01])")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Refusal(Exception):
    """Ends a request before the app sees it, with this status."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _plain(status: str, text: str) -> bytes:
    body = (text + "\n").encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class HttpListener:
    """Serves one WSGI app on host:port; `start` listens, `close` stops (idempotent)."""

    def __init__(
        self,
        app: WsgiApp,
        *,
        name: str,
        max_connections: int = 64,
        read_timeout_s: float = MAX_READ_TIMEOUT_S,
        app_threads: int = 4,
    ) -> None:
        if not 0 < read_timeout_s <= MAX_READ_TIMEOUT_S:
            raise ValueError(
                f"read_timeout_s: expected seconds in (0, {MAX_READ_TIMEOUT_S:g}], "
                f"got {read_timeout_s!r}"
            )
        if max_connections < 1:
            raise ValueError(f"max_connections: expected at least 1, got {max_connections!r}")
        self._app = app
        self._name = name
        self._max = max_connections
        self._timeout = read_timeout_s
        self._pool = ThreadPoolExecutor(app_threads, thread_name_prefix=f"{name}-app")
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        # Open connections in accept order; `_waiting` holds those still sending a request.
        self._open: dict[asyncio.StreamWriter, None] = {}
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0
        """Connections answered 503 because every slot was busy answering."""
        self.evicted = 0
        """Connections closed to make room, before they had sent a whole request."""
        self.host = ""
        self.port = 0

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (0: a free one); returns the bound (host, port)."""
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.host, self.port = sock.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{self._name}-{self.port}", daemon=True
        )
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._listen(sock), self._loop)
        try:
            started.result(timeout=10)
        except BaseException:
            self.close()
            raise
        return self.host, self.port

    async def _listen(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_server(self._serve, sock=sock, limit=MAX_HEADER_BYTES)

    def close(self) -> None:
        """Stop listening and drop every open connection."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                done.result(timeout=5)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()
        self._waiting.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ connections

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        if len(self._open) >= self._max:
            if not self._waiting:
                return False
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            del self._open[oldest]
            oldest.transport.abort()
            self.evicted += 1
        self._open[writer] = None
        self._waiting[writer] = None
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            if not self._admit(writer):
                self.refused += 1
                await self._refuse(reader, writer)
                return
            try:
                async with asyncio.timeout(self._timeout):
                    environ = await self._read(reader, writer)
            except TimeoutError:
                answer = _plain("408 Request Timeout", f"no whole request in {self._timeout:g} s")
            except _Refusal as refusal:
                answer = _plain(refusal.status, str(refusal))
            else:
                self._waiting.pop(writer, None)
                answer = await self._loop.run_in_executor(self._pool, self._call, environ)
            writer.write(answer)
            async with asyncio.timeout(_WRITE_TIMEOUT_S):
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the peer went away or stopped reading (or was evicted): nothing to answer
        finally:
            self._tasks.discard(task)
            self._waiting.pop(writer, None)
            self._open.pop(writer, None)
            writer.close()

    @staticmethod
    async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """503, then what the peer sent is read and dropped for up to a second: closing with
        unread bytes would reset the connection and lose the answer."""
        try:
            writer.write(_plain("503 Service Unavailable", "too many connections; try again"))
            writer.write_eof()
            async with asyncio.timeout(1.0):
                while await reader.read(MAX_HEADER_BYTES):
                    pass
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict:
        """The request as a WSGI environ; `_Refusal` for anything malformed or too large."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refusal(
                "431 Request Header Fields Too Large",
                f"request headers: expected at most {MAX_HEADER_BYTES} bytes",
            ) from None
        lines = head[:-4].decode("latin-1").split("\r\n")
        match = _REQUEST_LINE.fullmatch(lines[0])
        if match is None:
            raise _Refusal(
                "400 Bad Request",
                f"request line: expected 'METHOD /path HTTP/1.x', got {lines[0][:80]!r}",
            )
        method, target, version = match.groups()
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not _HEADER_NAME.fullmatch(name):
                raise _Refusal(
                    "400 Bad Request", f"header: expected 'Name: value', got {line[:80]!r}"
                )
            key = "HTTP_" + name.upper().replace("-", "_")
            value = value.strip(" \t")
            headers[key] = f"{headers[key]},{value}" if key in headers else value
        if "HTTP_TRANSFER_ENCODING" in headers:
            raise _Refusal("501 Not Implemented", "Transfer-Encoding: send Content-Length instead")
        length_text = headers.pop("HTTP_CONTENT_LENGTH", "0")
        if not length_text.isdigit():
            raise _Refusal(
                "400 Bad Request", f"Content-Length: expected a number, got {length_text[:40]!r}"
            )
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            raise _Refusal(
                "413 Content Too Large",
                f"body: expected at most {MAX_BODY_BYTES} bytes, got Content-Length {length}",
            )
        body = await reader.readexactly(length) if length else b""
        path, _, query = target.partition("?")
        peer = writer.get_extra_info("peername") or ("", 0)
        environ = {
            "REQUEST_METHOD": method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, "latin-1"),
            "QUERY_STRING": query,
            "CONTENT_TYPE": headers.pop("HTTP_CONTENT_TYPE", ""),
            "CONTENT_LENGTH": str(length),
            "SERVER_NAME": self.host,
            "SERVER_PORT": str(self.port),
            "SERVER_PROTOCOL": f"HTTP/{version}",
            "REMOTE_ADDR": str(peer[0]),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        environ.update(headers)
        return environ

    def _call(self, environ: dict[str, Any]) -> bytes:
        """Runs the app on a worker thread; the whole response as bytes."""
        started: list = []

        def start_response(status: str, headers: list, exc_info: Any = None) -> Callable:
            started[:] = [status, headers]
            return lambda data: None

        try:
            result = self._app(environ, start_response)
            try:
                body = b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
        except Exception:
            logger.exception(
                "%s: %s %s failed", self._name, environ["REQUEST_METHOD"], environ["PATH_INFO"]
            )
            return _plain("500 Internal Server Error", "internal error")
        status, headers = started
        head = environ["REQUEST_METHOD"] == "HEAD"  # keeps the app's Content-Length
        skip = ("connection",) if head else ("connection", "content-length")
        lines = [f"HTTP/1.1 {status}"]
        lines += [f"{k}: {v}" for k, v in headers if k.lower() not in skip]
        lines += [] if head else [f"Content-Length: {len(body)}"]
        lines += ["Connection: close", "", ""]
        return "\r\n".join(lines).encode("latin-1") + body
