"""Sessions and workers as resources: dropping a session durably, and the sweep that drops
idle sessions and expires idle workers (--session-ttl, --worker-ttl)."""

from __future__ import annotations

import logging
import time

from .durability import Durability
from .errors import ErrorKind, RequestError
from .periodic import Periodic
from .sessions import Sessions

logger = logging.getLogger(__name__)


class Lifecycle:
    def __init__(self, sessions: Sessions, durability: Durability | None) -> None:
        self.sessions = sessions
        self.durability = durability
        self._sweeper: Periodic | None = None

    def drop(self, name: str) -> None:
        """Drop a session: its memory now, its log records and checkpoint entries once the
        checkpoint written here (without it) is on disk."""
        self.sessions.drop(name)
        if self.durability is not None:
            try:
                self.durability.checkpoint(self.sessions, purge=True)
            except OSError as exc:
                # The drop is in the log: a restart does not bring the session back.
                raise RequestError(
                    ErrorKind.STORAGE,
                    f"data directory: session {name!r} is dropped, but its old records stay "
                    f"on disk until the next checkpoint ({exc.strerror or exc})",
                ) from None

    def sweep(self, now: float | None = None) -> tuple[list[str], list[tuple[str, str]]]:
        """Drop idle sessions and expire idle workers; returns what it dropped and expired."""
        limits = self.sessions.limits
        now = time.monotonic() if now is None else now
        stale, workers = self.sessions.idle(now, limits.session_ttl_s, limits.worker_ttl_s)
        dropped = []
        for name in stale:
            try:
                self.sessions.drop(name)
            except RequestError:  # dropped meanwhile
                continue
            dropped.append(name)
            logger.warning("session %r dropped: unused for %.0f s", name, limits.session_ttl_s)
        for name, worker_id in workers:
            try:
                self.sessions.leave(name, worker_id, expired=True)
            except RequestError:
                continue
        if dropped and self.durability is not None:
            self.durability.checkpoint(self.sessions, purge=True)
        return dropped, workers

    def start(self) -> None:
        limits = self.sessions.limits
        ttls = [t for t in (limits.session_ttl_s, limits.worker_ttl_s) if t > 0]
        if not ttls:
            return
        self._sweeper = Periodic(min(30.0, max(0.2, min(ttls) / 4)), self.sweep, "session sweep")

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.stop(10)
