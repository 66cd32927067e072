"""Server-side security and standard services: token auth, TLS, health, reflection.

- `load_token` reads the shared secret of `serve --token-file`.
- `TokenAuthInterceptor` refuses every call without the right token with
  UNAUTHENTICATED, except the open methods (the health service by default).
  The comparison is constant-time (`hmac.compare_digest`).
- `MalformedRequestInterceptor` answers a request that does not parse with
  INVALID_ARGUMENT and one WARNING line (not INTERNAL and a traceback).
- `server_credentials` builds TLS (or mutual TLS) credentials from PEM files.
- `add_standard_services` adds grpc.health.v1 and server reflection; health
  says NOT_SERVING until `Health.set_serving(True)` and again while draining.

grpcio-health-checking and grpcio-reflection are server-only dependencies
(the `[server]` extra); without them the recorder still serves, without the
two standard services, and says so in the log.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc

from recorder_client._proto import recorder_pb2 as pb

from ..errors import ErrorKind, RequestError
from .convert import status_of, trailing

logger = logging.getLogger(__name__)

RECORDER_SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Recorder"].full_name
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_WATCH_METHOD = "/grpc.health.v1.Health/Watch"
OPEN_METHODS: tuple[str, ...] = (HEALTH_CHECK_METHOD, HEALTH_WATCH_METHOD)

# Call metadata that may carry the token (keys are lower case on the wire).
AUTHORIZATION_KEY = "authorization"
TOKEN_KEY = "x-recorder-token"
BEARER = "bearer"

MISSING_TOKEN = "authentication failed: missing token"
WRONG_TOKEN = "authentication failed: wrong token"


# -- token -------------------------------------------------------------------
def check_token(token: str, origin: str = "token") -> str:
    """The token if it can travel as gRPC metadata, else ValueError naming the origin."""
    if not token:
        raise ValueError(f"{origin}: expected a non-empty token, got an empty one")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(
            f"{origin}: expected printable ASCII without spaces (a gRPC metadata value), "
            f"got {len(token)} characters including others"
        )
    return token


def load_token(path: str | os.PathLike[str]) -> str:
    """The token stored in `path`, surrounding whitespace stripped.

    Raises OSError when the file cannot be read and ValueError when it is empty
    or holds characters a gRPC metadata value cannot carry.
    """
    with open(path, encoding="utf-8") as fh:
        token = fh.read().strip()
    if not token:
        raise ValueError(f"token file {os.fspath(path)!r}: expected a token, got an empty file")
    return check_token(token, f"token file {os.fspath(path)!r}")


def token_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token a call presented (`authorization: Bearer T` or `x-recorder-token: T`)."""
    for key, value in metadata or ():
        if isinstance(value, bytes):  # only -bin keys carry bytes; tolerate them anyway
            value = value.decode("utf-8", "replace")
        if key == AUTHORIZATION_KEY:
            scheme, _, rest = value.strip().partition(" ")
            if scheme.lower() == BEARER and rest.strip():
                return rest.strip()
        elif key == TOKEN_KEY and value.strip():
            return value.strip()
    return None


async def _end(context: grpc.aio.ServicerContext, error: RequestError) -> None:
    """End the call with the status `status_of` gives ``error`` (raises)."""
    code, details, kind = status_of(error)
    context.set_trailing_metadata(trailing(kind))
    await context.abort(code, details)


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    refusal = RequestError(ErrorKind.UNAUTHENTICATED, message)

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _end(context, refusal)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared token; `open_methods` need none.

    The refusal is UNAUTHENTICATED with a message that says authentication
    failed and whether the token was missing or wrong (never the token). It
    works for unary and streaming methods alike: the refusing handler has the
    same kind as the method's real one. Unknown methods stay UNIMPLEMENTED.
    """

    def __init__(self, token: str, open_methods: Sequence[str] = OPEN_METHODS) -> None:
        self._token = check_token(token).encode("ascii")
        self._open = frozenset(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method in self._open:
            return handler
        presented = token_from_metadata(handler_call_details.invocation_metadata)
        if presented is None:
            logger.info("refused %s: no token", method)
            return _denying_handler(handler, MISSING_TOKEN)
        if not hmac.compare_digest(presented.encode("utf-8"), self._token):
            logger.info("refused %s: wrong token", method)
            return _denying_handler(handler, WRONG_TOKEN)
        return handler


# -- malformed requests ------------------------------------------------------
class _Malformed:
    """What the lenient deserializer hands on for bytes that do not parse."""

    __slots__ = ("error", "message", "size")

    def __init__(self, message: str, size: int, error: Exception) -> None:
        self.message = message
        self.size = size
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserialize``, with a _Malformed marker instead of an exception (which gRPC would
    log with a traceback and answer INTERNAL)."""
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    message = getattr(descriptor, "full_name", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or whatever else a parser raises
            return _Malformed(message, len(data), exc)

    return parse


def _refusal(method: str, bad: _Malformed) -> RequestError:
    logger.warning(
        "refused %s: %d bytes that do not parse as %s (%s)",
        method,
        bad.size,
        bad.message,
        bad.error,
    )
    return RequestError(
        ErrorKind.INVALID,
        f"request: expected a {bad.message} message, got {bad.size} bytes that do not parse as one",
    )


def _checked_one(method: str) -> Callable[..., Awaitable[Any]]:
    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await _end(context, _refusal(method, request))
        return request

    return check


def _checked_stream(method: str) -> Callable[..., Awaitable[Any]]:
    async def check(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        # Raised, not aborted here: the task reading the stream may not be the one that
        # writes to it, and only that one may end the call.
        async def each() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Malformed):
                    raise _refusal(method, request)
                yield request

        return each()

    return check


_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _guarded_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with a lenient deserializer and a behavior that refuses what it marks
    (async behaviors only: the recorder's, health's and reflection's)."""
    attribute, factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    inner = getattr(handler, attribute)
    check = (_checked_stream if handler.request_streaming else _checked_one)(method)
    if inspect.isasyncgenfunction(inner):

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for reply in inner(await check(request, context), context):
                    yield reply
            except RequestError as exc:  # a malformed message in the request stream
                await _end(context, exc)

    elif inspect.iscoroutinefunction(inner):

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(await check(request, context), context)
            except RequestError as exc:
                await _end(context, exc)

    else:
        return handler
    return factory(
        behavior,
        request_deserializer=_lenient(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request message that does not parse ends its call with INVALID_ARGUMENT and one
    WARNING line, for every method, unary or streaming (gRPC's own answer is INTERNAL, with
    a traceback in the log per call). A stream refuses at the first bad message.

    Put it after TokenAuthInterceptor: a call without the token is refused for that first.
    """

    def __init__(self) -> None:
        # method -> (the handler it was given, the guarded one): built once per method.
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._guarded[method] = (handler, _guarded_handler(handler, method))
        return cached[1]


# -- TLS ---------------------------------------------------------------------
def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise OSError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ValueError(f"{what}: expected PEM data in {os.fspath(path)!r}, got an empty file")
    return data


def server_credentials(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    client_ca_file: str | os.PathLike[str] | None = None,
) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with `client_ca_file`, mutual TLS.

    With a client CA every client must present a certificate signed by it
    (require_client_auth); without one, clients are not asked for certificates.
    """
    cert = _read(cert_file, "--tls-cert")
    key = _read(key_file, "--tls-key")
    ca = _read(client_ca_file, "--tls-client-ca") if client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


# -- health and reflection -------------------------------------------------------
class Health:
    """grpc.health.v1 for the whole server ("") and the recorder service; starts NOT_SERVING."""

    def __init__(self, servicer: Any, names: Sequence[str]) -> None:
        self.servicer = servicer
        self.names = tuple(names)

    async def set_serving(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.names:
            await self.servicer.set(name, status)


async def add_standard_services(
    server: grpc.aio.Server, service_names: Sequence[str], *, quiet: bool = False
) -> Health | None:
    """Add grpc.health.v1 Health (NOT_SERVING until told) and server reflection for
    `service_names`; None when the health and reflection packages are not installed (a
    warning, or with `quiet` an info line: a private server nothing probes)."""
    try:
        from grpc_health.v1 import health, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
    except ImportError as exc:
        logger.log(
            logging.INFO if quiet else logging.WARNING,
            "%s: gRPC health and reflection are off (install rollout-recorder[server])",
            exc,
        )
        return None
    servicer = health.aio.HealthServicer()
    checked = Health(servicer, (health.OVERALL_HEALTH, *service_names))
    await checked.set_serving(False)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return checked


__all__ = [
    "MISSING_TOKEN",
    "OPEN_METHODS",
    "RECORDER_SERVICE_NAME",
    "WRONG_TOKEN",
    "Health",
    "MalformedRequestInterceptor",
    "TokenAuthInterceptor",
    "add_standard_services",
    "check_token",
    "load_token",
    "server_credentials",
    "token_from_metadata",
]
