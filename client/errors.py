"""The client's exception hierarchy, converted from gRPC status in one place."""

from __future__ import annotations

from typing import Any

import grpc

from ._wire import ERROR_KIND_KEY, RETRY_AFTER_KEY


class RecorderError(Exception):
    """Base class of every error the recorder client raises."""


class RecorderUnavailableError(RecorderError, ConnectionError):
    """The recorder server could not be reached (names the target)."""


class InvalidChunkError(RecorderError, ValueError):
    """A chunk was refused: the message names the field, expected and received value."""


class SessionMismatchError(RecorderError, ValueError):
    """The session exists with a different configuration."""


class InvalidNameError(RecorderError, ValueError):
    """A session name or worker id outside the naming rule (1-128 characters from
    [A-Za-z0-9._-] not starting with '.' for sessions; 1-128 printable ones for workers)."""


class InvalidQueryError(RecorderError, ValueError):
    """A store query was asked wrongly (an unknown utility or cell-key field name, a field
    given twice): the message names the argument, the expected and the received value."""


class StoreNotConfiguredError(RecorderError):
    """A trajectory-store verb on a session without a store (created without ``capture=``),
    or ``capture=`` on a server that cannot run a store (the message names the pip line).
    ``recorder.capture.enabled`` tells beforehand."""


class UnknownSessionError(RecorderError, LookupError):
    """No session of that name on the server (never joined, or dropped)."""


class WorkerIdInUseError(RecorderError):
    """Another live recorder holds this worker id in the session (two trainers given one
    ``worker_id``). Give each recorder its own ``worker_id``, or close the other first."""

    retry_after: float | None = None
    """Seconds after which the id is free unless its holder comes back (it has no stream
    open and is kept for its own reconnect); None while the holder's stream is open."""


class SessionDroppedError(RecorderError, LookupError):
    """The session was dropped while this recorder used it. A dropped session is not
    re-created by a reconnect: make a new recorder to record it again."""


class DataLossError(RecorderError):
    """Chunks the server had acknowledged were lost (for example the last window of a
    batched-fsync log in a power cut). ``first`` to ``last`` are the worker's lost sequence
    numbers; the worker goes on from ``last + 1``, and status() counts them. From finish():
    chunks of the result hold zeros for frames found not to decode after their ack, and
    ``trajectory`` is the result all the same."""

    def __init__(
        self,
        message: str,
        *,
        worker_id: str = "",
        first: int = 0,
        last: int = 0,
        trajectory: Any = None,
    ):
        super().__init__(message)
        self.worker_id = worker_id
        self.first = first
        self.last = last
        self.trajectory = trajectory


class NoDataError(RecorderError, ValueError):
    """finish() found nothing to return (the in-process recorder's ValueError cases)."""


class ResourceExhaustedError(RecorderError):
    """The server refused work for lack of a resource (space, limits)."""


class AuthenticationError(RecorderError, PermissionError):
    """The server refused the call's credentials."""


# The server tags every refusal with its kind in trailing metadata; a few pick the class.
_BY_KIND: dict[str, type[RecorderError]] = {
    "session_mismatch": SessionMismatchError,
    "no_data": NoDataError,
    "invalid_name": InvalidNameError,
    "unknown_session": UnknownSessionError,
    "invalid_query": InvalidQueryError,
    "no_store": StoreNotConfiguredError,
    "worker_in_use": WorkerIdInUseError,
    "session_dropped": SessionDroppedError,
}


# What gRPC reports when one side speaks TLS and the other plaintext.
_HANDSHAKE_SIGNS = ("Socket closed", "WRONG_VERSION_NUMBER")


def handshake_hint(message: str) -> str:
    """A hint for a connection closed during set-up (TLS on one side only), else ""."""
    if any(sign in message for sign in _HANDSHAKE_SIGNS):
        return (
            " (the connection closed during set-up: if the server uses TLS, pass "
            "root_certificates= / --tls-ca; if it does not, drop them)"
        )
    return ""


def from_status(
    code: grpc.StatusCode | str, message: str, target: str = "", kind: str = ""
) -> RecorderError:
    """Map a gRPC status (or its name) to the exception the user sees."""
    name = code if isinstance(code, str) else code.name
    if kind in _BY_KIND:
        return _BY_KIND[kind](message)
    if name == "INVALID_ARGUMENT":
        return InvalidChunkError(message)
    if name == "FAILED_PRECONDITION":
        return InvalidChunkError(message)
    if name == "RESOURCE_EXHAUSTED":
        return ResourceExhaustedError(message)
    if name == "UNAUTHENTICATED":
        return AuthenticationError(message)
    if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        where = f" at {target}" if target else ""
        return RecorderUnavailableError(
            f"recorder server{where} unavailable: {message}{handshake_hint(message)}"
        )
    return RecorderError(f"{name}: {message}")


def from_rpc_error(err: grpc.RpcError, target: str = "") -> RecorderError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    kind, retry_after = "", None
    if hasattr(err, "trailing_metadata"):
        for key, value in err.trailing_metadata() or ():
            text = value if isinstance(value, str) else value.decode()
            if key == ERROR_KIND_KEY:
                kind = text
            elif key == RETRY_AFTER_KEY:
                try:
                    retry_after = float(text)
                except ValueError:
                    pass
    error = from_status(code, details or "", target, kind)
    if isinstance(error, WorkerIdInUseError):
        error.retry_after = retry_after
    return error
