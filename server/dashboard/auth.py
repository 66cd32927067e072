"""Who may see the dashboard and the metrics endpoint: with the server's token set, a request
shows it either as ``Authorization: Bearer <token>`` (scripts, Prometheus) or, on the
dashboard, by an HttpOnly cookie that the login form sets (browsers).

The cookie holds neither the token nor anything derived from it alone: it is a random id, its
issue time and an HMAC of both under a secret drawn when the server starts. It grants the
dashboard and nothing else (a gRPC call still needs the token), expires after ``max_age_s``,
and `/logout` revokes it (a server-side list of revoked ids, kept until they expire anyway).
A restart forgets the secret, which logs every browser out. Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from http.cookies import CookieError, SimpleCookie
from typing import Any

COOKIE = "rollout_recorder_dashboard"
DEFAULT_SESSION_MAX_AGE_S = 12 * 3600.0


def bearer(environ: dict[str, Any]) -> str | None:
    """The bearer token a request carries (None without one)."""
    scheme, _, value = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _same(submitted: str, token: str) -> bool:
    return hmac.compare_digest(submitted.encode(), token.encode())


def bearer_only(app: Callable[..., Iterable[bytes]], token: str) -> Callable[..., Iterable[bytes]]:
    """``app`` behind the token: any request without ``Authorization: Bearer <token>`` gets 401
    (the Prometheus endpoint: its scrape config sends the token from a credentials file)."""

    def gated(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        submitted = bearer(environ)
        if submitted is not None and _same(submitted, token):
            return app(environ, start_response)
        body = json.dumps(
            {"error": "this endpoint needs the server's token: Authorization: Bearer"}
        ).encode()
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("WWW-Authenticate", 'Bearer realm="rollout-recorder"'),
            ],
        )
        return [body]

    return gated


class TokenGate:
    """Checks requests against the token; ``TokenGate(None)`` lets everyone in."""

    def __init__(
        self,
        token: str | None,
        max_age_s: float = DEFAULT_SESSION_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not max_age_s > 0:
            raise ValueError(f"dashboard session max age: expected seconds > 0, got {max_age_s!r}")
        self._token = token
        self._max_age = max_age_s
        self._clock = clock
        self._secret = secrets.token_bytes(32)
        self._revoked: dict[str, float] = {}  # cookie id -> when it expires anyway
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return self._token is not None

    def allows(self, environ: dict[str, Any]) -> bool:
        """Whether the request carries the token (bearer header) or a live login cookie."""
        if self._token is None:
            return True
        submitted = bearer(environ)
        if submitted is not None and _same(submitted, self._token):
            return True
        return self._cookie_id(environ) is not None

    def matches(self, submitted: str) -> bool:
        """Whether ``submitted`` is the token."""
        return self._token is None or _same(submitted, self._token)

    def login_cookie(self) -> str:
        """The Set-Cookie value after a correct login: a fresh id, issued now."""
        payload = f"{secrets.token_urlsafe(18)}.{int(self._clock() * 1000)}"  # ms
        value = f"{payload}.{self._sign(payload)}"
        return f"{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={int(self._max_age)}"

    def logout(self, environ: dict[str, Any]) -> str:
        """Revokes the request's cookie (if live); returns the Set-Cookie value that clears it."""
        cookie_id = self._cookie_id(environ)
        if cookie_id is not None:
            now = self._clock()
            with self._lock:
                self._revoked = {k: t for k, t in self._revoked.items() if t > now}
                self._revoked[cookie_id] = now + self._max_age
        return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"

    def _sign(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()

    def _cookie_id(self, environ: dict[str, Any]) -> str | None:
        """The id of the request's cookie when it is signed here, unexpired and not revoked."""
        cookies = SimpleCookie()
        try:
            cookies.load(environ.get("HTTP_COOKIE", ""))
        except CookieError:
            return None
        morsel = cookies.get(COOKIE)
        if morsel is None:
            return None
        payload, _, mac = morsel.value.rpartition(".")
        cookie_id, _, issued = payload.partition(".")
        if not hmac.compare_digest(mac.encode(), self._sign(payload).encode()):
            return None
        if not issued.isdigit() or self._clock() - int(issued) / 1000 >= self._max_age:
            return None
        with self._lock:
            return None if cookie_id in self._revoked else cookie_id
