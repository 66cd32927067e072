"""Why the core refuses a request: a typed kind and a message for people.

The core raises `RequestError`; the gRPC edge turns its kind into a status code in one
function (`rpc.convert.status_of`). Messages name the field, what was expected and what
arrived.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong, as the caller should act on it. The value is the stable tag clients
    receive with the status (`recorder_client._wire.ERROR_KIND_KEY`)."""

    INVALID = "invalid"
    """A malformed or inconsistent request: fix the request."""
    INVALID_QUERY = "invalid_query"
    """A store query named an unknown utility or cell-key field (or one twice)."""
    INVALID_NAME = "invalid_name"
    """A session name or worker id outside the naming rule."""
    SESSION_MISMATCH = "session_mismatch"
    """The session exists with another configuration."""
    UNKNOWN_SESSION = "unknown_session"
    """No session of that name (never joined, or dropped)."""
    NOT_JOINED = "not_joined"
    """The worker did not join the session."""
    SEQUENCE_GAP = "sequence_gap"
    """A chunk arrived out of order: the client resends from the last one taken."""
    LIMIT = "limit"
    """A configured limit (sessions, workers) is reached."""
    STORAGE = "storage"
    """The data directory cannot take the write (a full disk, an I/O error): nothing
    acknowledged is affected; retry once it can."""
    NO_DATA = "no_data"
    """finish() found nothing to return."""
    NO_STORE = "no_store"
    """A trajectory-store verb on a session without a store configuration."""
    NO_LOG = "no_log"
    """A durability verb on a server started without its write-ahead log."""
    SHUTTING_DOWN = "shutting_down"
    """The server is stopping."""
    UNAUTHENTICATED = "unauthenticated"
    """The call did not carry the server's token."""
    WORKER_IN_USE = "worker_in_use"
    """Another live stream holds this (session, worker_id)."""
    SESSION_DROPPED = "session_dropped"
    """The session was dropped; only a new recorder's explicit join creates it again."""


class RequestError(Exception):
    """A refused request. The session it was made on is left as it was."""

    def __init__(self, kind: ErrorKind, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        # Seconds after which the refusal may not hold (sent to the client), or None.
        self.retry_after = retry_after

    @property
    def message(self) -> str:
        return str(self)


def invalid(message: str) -> RequestError:
    return RequestError(ErrorKind.INVALID, message)
