"""The dashboard's HTTP listener: the page, its JSON API and (optionally) ``/metrics``.

The app is WSGI, served by `HttpListener` (one asyncio loop for every connection, read
timeouts, a connection cap; standard library only). Routes:

- ``GET /``: the page (``static/index.html``; its script polls the API once a second);
- ``GET /api/sessions``: every session's counters and current rates;
- ``GET /api/sessions/NAME``: one session: workers, series over time, episode histograms,
  the dataset sink's progress (``dataset``: null without one),
  the store's levels;
- ``GET /api/sessions/NAME/archive``: the cell archive as columns (404 without a store);
- ``GET /metrics``: the Prometheus exposition of the server's metrics;
- ``GET|POST /login``, ``GET /logout``: the token form and its cookie (logout revokes it);
- ``GET /static/FILE``: the page's script and style (no data: served without the token).

With a token, every other route answers 401 unless the request carries the token as a bearer
header or the login cookie (see `auth`). The API reads the server's objects (`Sessions`,
each `Session.status()`, the metrics snapshot, the store's archive table) and the sampler's
ring; nothing in here runs on the ingest path.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from ..errors import RequestError
from ..httpserve import HttpListener
from . import views
from .auth import DEFAULT_SESSION_MAX_AGE_S, TokenGate
from .sampler import Sampler

logger = logging.getLogger(__name__)

# Seconds an archive answer is reused (several open pages cost one copy of the archive).
ARCHIVE_CACHE_S = 1.0
_MAX_LOGIN_BODY = 4096
_STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
_HEADERS = [
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    (
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'",
    ),
]


def _static_files() -> dict[str, bytes]:
    """Every file of ``static/`` (package data), read once."""
    folder = resources.files(__package__).joinpath("static")
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


class _Response(Exception):
    """Ends a request with this status, body and headers."""

    def __init__(
        self, status: str, body: bytes, content_type: str, headers: list | None = None
    ) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers or []


def _json(status: str, obj: Any, headers: list | None = None) -> _Response:
    try:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite float the views missed: null, as everywhere else
        body = json.dumps(_finite(obj), separators=(",", ":"))
    return _Response(status, body.encode(), "application/json", headers)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _back_to(environ: dict[str, Any]) -> str:
    """Where a login goes: the page, with the session and x axis the login page's URL named
    (a deep link followed before logging in), re-encoded from those two keys only."""
    query = parse_qs(urlsplit(environ.get("HTTP_REFERER", "")).query)
    kept = {k: query[k][0] for k in ("session", "x") if k in query}
    return "./?" + urlencode(kept) if kept else "./"


class Dashboard:
    """The dashboard of one server: `start` listens, `close` stops (idempotent)."""

    def __init__(
        self,
        sessions,
        metrics,
        token: str | None = None,
        *,
        session_max_age_s: float = DEFAULT_SESSION_MAX_AGE_S,
        max_connections: int = 64,
    ) -> None:
        self._sessions = sessions
        self._metrics = metrics
        self._gate = TokenGate(token, session_max_age_s)
        self._max_connections = max_connections
        self._static = _static_files()
        self.sampler = Sampler(sessions, metrics)
        # session name -> (monotonic time, the session, its archive table or None)
        self._archives: dict[str, tuple[float, Any, dict | None]] = {}
        self._archive_lock = threading.Lock()
        self._listener: HttpListener | None = None
        self.host = ""
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen on host:port (0: a free one); returns the bound (host, port)."""
        listener = HttpListener(
            self.app, name="dashboard-http", max_connections=self._max_connections
        )
        self.host, self.port = listener.start(host, port)
        self._listener = listener
        self.sampler.start()
        logger.info("dashboard serving on http://%s:%d/", self.host, self.port)
        return self.host, self.port

    def close(self) -> None:
        """Stop serving and sampling; new connections are refused after."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self.sampler.close()

    # ------------------------------------------------------------------ WSGI

    def app(self, environ: dict[str, Any], start_response) -> list[bytes]:
        try:
            response = self._route(environ)
        except _Response as r:  # an early answer (an unknown session)
            response = r
        except Exception:
            logger.exception(
                "dashboard: %s %s failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO")
            )
            response = _json("500 Internal Server Error", {"error": "internal error"})
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            *_HEADERS,
            *response.headers,
        ]
        start_response(response.status, headers)
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else response.body]

    def _route(self, environ: dict[str, Any]) -> _Response:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/") or "/"
        if path.startswith("/static/"):
            return self._file(path[len("/static/") :], method)
        if path == "/login":
            return self._login(environ, method)
        if path == "/logout":
            return _Response(
                "303 See Other",
                b"",
                "text/plain",
                [("Location", "login"), ("Set-Cookie", self._gate.logout(environ))],
            )
        if method not in ("GET", "HEAD"):
            return _json("405 Method Not Allowed", {"error": f"method {method} not allowed"})
        if not self._gate.allows(environ):
            if path.startswith("/api/") or path == "/metrics":
                return _json(
                    "401 Unauthorized",
                    {"error": "this dashboard needs the server's token: Authorization: Bearer"},
                    [("WWW-Authenticate", 'Bearer realm="rollout-recorder"')],
                )
            return self._login_page("401 Unauthorized", "")
        if path in ("/", "/index.html"):
            return self._file("index.html", method)
        if path == "/metrics":
            return self._prometheus()
        if path == "/api/sessions":
            return _json("200 OK", self._sessions_json())
        if path.startswith("/api/sessions/"):
            rest = path[len("/api/sessions/") :]
            name, _, tail = rest.partition("/")  # PATH_INFO comes percent-decoded
            if tail == "":
                return self._session_json(name)
            if tail == "archive":
                return self._archive_json(name, parse_qs(environ.get("QUERY_STRING", "")))
        return _json("404 Not Found", {"error": f"no such page: {path}"})

    # ------------------------------------------------------------------ pages

    def _file(self, name: str, method: str) -> _Response:
        if method not in ("GET", "HEAD"):
            return _json("405 Method Not Allowed", {"error": f"method {method} not allowed"})
        body = self._static.get(name)
        kind = _STATIC_TYPES.get(name[name.rfind(".") :]) if "." in name else None
        if body is None or kind is None:
            return _json("404 Not Found", {"error": f"no such file: {name}"})
        return _Response("200 OK", body, kind)

    def _login_page(self, status: str, message: str) -> _Response:
        page = self._static["login.html"].replace(b"<!--MESSAGE-->", message.encode())
        return _Response(status, page, _STATIC_TYPES[".html"])

    def _login(self, environ: dict[str, Any], method: str) -> _Response:
        if method in ("GET", "HEAD"):
            return self._login_page("200 OK", "")
        if method != "POST":
            return _json("405 Method Not Allowed", {"error": f"method {method} not allowed"})
        try:
            size = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            size = -1
        if not 0 <= size <= _MAX_LOGIN_BODY:
            return _json("400 Bad Request", {"error": f"login: expected a small form, got {size}"})
        body = environ["wsgi.input"].read(size).decode("utf-8", "replace")
        submitted = parse_qs(body).get("token", [""])[0].strip()
        if not self._gate.matches(submitted):
            logger.warning("dashboard: a login with a wrong token was refused")
            return self._login_page("401 Unauthorized", "Wrong token.")
        return _Response(
            "303 See Other",
            b"",
            "text/plain",
            [("Location", _back_to(environ)), ("Set-Cookie", self._gate.login_cookie())],
        )

    def _prometheus(self) -> _Response:
        registry = self._registry()
        if registry is None:
            return _json("404 Not Found", {"error": "this server keeps no Prometheus metrics"})
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return _Response("200 OK", generate_latest(registry), CONTENT_TYPE_LATEST)

    def _registry(self) -> Any:
        try:
            return getattr(self._metrics, "registry", None)
        except Exception:  # prometheus_client missing (MissingExtraError): no histograms
            return None

    # ------------------------------------------------------------------ API

    def _session(self, name: str):
        try:
            return self._sessions.get(name)
        except RequestError as err:
            raise _json("404 Not Found", {"error": str(err)}) from None

    def _sessions_json(self) -> dict[str, Any]:
        rows = []
        for session in self._sessions.all():
            status = session.status()
            samples = self.sampler.samples(status.session)
            rows.append(views.summary(status, samples, session.config.capture is not None))
        return {
            "time": time.time(),
            "started": self.sampler.started,
            "token_required": self._gate.required,
            "sessions": rows,
        }

    def _session_json(self, name: str) -> _Response:
        session = self._session(name)
        status = session.status()
        snapshot = self._metrics.snapshot()
        recent = getattr(self._metrics, "recent", None)  # an EpisodeWindow's
        body = views.detail(
            status,
            self.sampler.samples(status.session),
            snapshot,
            None if recent is None else recent(status.session),
            views.store_info(session.config.capture),
        )
        body["dataset"] = self._dataset(session, snapshot)
        body["time"] = time.time()
        return _json("200 OK", body)

    def _dataset(self, session, snapshot: Mapping[str, float]) -> dict[str, Any] | None:
        """Where the session's episodes are written, how far and how late (None without a
        sink)."""
        sink = self._sessions.dataset
        if sink is None:
            return None
        with session.lock:
            cursor = session.dataset
            written = sum(cursor.written.values())
            finished = sum(tl.episodes_finished for tl in session.workers.values())
            state = {"generation": cursor.generation, "files": cursor.seq}
        prefix = "Recorder/dataset_"
        suffix = f"/session={session.name}"
        totals = {
            k[len(prefix) : -len(suffix)]: v
            for k, v in snapshot.items()
            if k.startswith(prefix) and k.endswith(suffix)
        }
        return {
            "uri": sink.options.uri,
            "node": sink.node,
            **state,
            "episodes_written": written,
            "episodes_waiting": max(0, finished - written),
            "write_failures": int(totals.get("write_failures", 0)),
            "bytes_written": int(totals.get("bytes_written", 0)),
            # Age of the oldest finished episode not yet written (None without metrics).
            "lag_seconds": totals.get("lag_seconds"),
        }

    def _archive_json(self, name: str, query: dict[str, list[str]]) -> _Response:
        """All cells as columns; with ``?x=FIELD&y=FIELD``, binned over those two fields (what
        the page asks for: its size is the number of bins, not of cells)."""
        table = self._archive_table(name)
        if table is None:
            return _json(
                "404 Not Found",
                {"error": f"session {name!r} has no trajectory store (created without capture=)"},
            )
        if "x" not in query and "y" not in query:
            return _json("200 OK", views.archive(table))
        fields = [k[len("cell:") :] for k in table if k.startswith("cell:")]
        x = query.get("x", fields[:1])[0]
        y = query.get("y", fields[1:2] or fields[:1])[0]
        try:
            return _json("200 OK", views.archive_bins(table, x, y))
        except ValueError as exc:
            return _json("400 Bad Request", {"error": str(exc)})

    def _archive_table(self, name: str) -> dict | None:
        """The session's archive table, copied at most once per ARCHIVE_CACHE_S whatever the
        number of pages asking."""
        session = self._session(name)
        now = time.monotonic()
        with self._archive_lock:
            cached = self._archives.get(name)
            if cached is not None and cached[1] is session and now - cached[0] < ARCHIVE_CACHE_S:
                return cached[2]
        # The processor's table, not Session.archive(): a look at the page must neither wait
        # for the ingest queue to drain nor count as a use of the session (--session-ttl).
        table = session.processor.archive_table()
        with self._archive_lock:
            live = {s.name for s in self._sessions.all()}
            self._archives = {k: v for k, v in self._archives.items() if k in live}
            self._archives[name] = (now, session, table)
        return table
