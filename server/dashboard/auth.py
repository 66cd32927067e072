"""Who may see the dashboard: with the server's token set, a request shows it either as
``Authorization: Bearer <token>`` (scripts, Prometheus) or by an HttpOnly cookie that the
login form sets (browsers).

The cookie holds an HMAC of the token, not the token itself: it grants the dashboard and
nothing else (a gRPC call still needs the token). Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
from http.cookies import CookieError, SimpleCookie
from typing import Any

COOKIE = "rollout_recorder_dashboard"
_COOKIE_CONTEXT = b"rollout-recorder dashboard cookie v1"


class TokenGate:
    """Checks requests against the token; ``TokenGate(None)`` lets everyone in."""

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._cookie = (
            None
            if token is None
            else hmac.new(token.encode(), _COOKIE_CONTEXT, hashlib.sha256).hexdigest()
        )

    @property
    def required(self) -> bool:
        return self._token is not None

    def allows(self, environ: dict[str, Any]) -> bool:
        """Whether the request carries the token (bearer header) or the login cookie."""
        if self._token is None:
            return True
        scheme, _, value = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
        if scheme.lower() == "bearer" and self.matches(value.strip()):
            return True
        cookies = SimpleCookie()
        try:
            cookies.load(environ.get("HTTP_COOKIE", ""))
        except CookieError:
            return False
        morsel = cookies.get(COOKIE)
        expected = (self._cookie or "").encode()
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), expected)

    def matches(self, submitted: str) -> bool:
        """Whether ``submitted`` is the token."""
        if self._token is None:
            return True
        return hmac.compare_digest(submitted.encode(), self._token.encode())

    def login_cookie(self) -> str:
        """The Set-Cookie value after a correct login."""
        return f"{COOKIE}={self._cookie or ''}; Path=/; HttpOnly; SameSite=Strict"

    @staticmethod
    def logout_cookie() -> str:
        return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
