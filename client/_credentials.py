"""Channels to a recorder server: plaintext or TLS, with the token on every call.

Reads the token from the environment when none is given: ROLLOUT_RECORDER_TOKEN
(the token itself), else ROLLOUT_RECORDER_TOKEN_FILE (a file holding it, as a
mounted secret does). Imports only the standard library and grpcio.

The token travels as `authorization: Bearer <token>` call metadata, added by a
client interceptor. gRPC refuses call credentials on insecure channels, so the
interceptor is used for TLS and plaintext alike; over plaintext the token is
visible on the network, which is fine on loopback or a private container
network and worth a warning anywhere else.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Sequence
from typing import Any

import grpc

logger = logging.getLogger(__name__)

TOKEN_ENV = "ROLLOUT_RECORDER_TOKEN"
TOKEN_FILE_ENV = "ROLLOUT_RECORDER_TOKEN_FILE"
AUTHORIZATION_KEY = "authorization"

PemSource = str | bytes | os.PathLike[str] | None


def resolve_token(token: str | None = None) -> str | None:
    """`token`, else $ROLLOUT_RECORDER_TOKEN, else the contents of $ROLLOUT_RECORDER_TOKEN_FILE."""
    if token is not None:
        origin = "token"
    elif os.environ.get(TOKEN_ENV):
        token, origin = os.environ[TOKEN_ENV], TOKEN_ENV
    elif os.environ.get(TOKEN_FILE_ENV):
        path = os.environ[TOKEN_FILE_ENV]
        origin = f"{TOKEN_FILE_ENV}={path!r}"
        try:
            with open(path, encoding="utf-8") as fh:
                token = fh.read()
        except OSError as exc:
            raise ValueError(f"{origin}: cannot read the token file: {exc.strerror}") from None
    else:
        return None
    token = token.strip()
    if not token or not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(
            f"{origin}: expected a non-empty token of printable ASCII without spaces, "
            f"got {len(token)} characters"
        )
    return token


def read_pem(source: PemSource, what: str) -> bytes | None:
    """PEM bytes from bytes, PEM text, or a file path (None stays None)."""
    if source is None:
        return None
    if isinstance(source, bytes):
        data = source
    elif isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        data = source.encode("ascii")
    else:
        try:
            with open(source, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ValueError(
                f"{what}: expected PEM bytes or a readable file, got {os.fspath(source)!r} "
                f"({exc.strerror})"
            ) from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what}: expected PEM data (-----BEGIN ...), got {len(data)} bytes")
    return data


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to the metadata of every call."""

    def __init__(self, token: str) -> None:
        self._entry = (AUTHORIZATION_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTHORIZATION_KEY]
        metadata.append(self._entry)
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def _is_local(target: str) -> bool:
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def make_channel(
    target: str,
    *,
    token: str | None = None,
    root_certificates: PemSource = None,
    client_certificate: PemSource = None,
    client_key: PemSource = None,
    tls: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to `target`, TLS when any certificate material (or `tls=True`) is given.

    Certificates are PEM bytes, PEM text or file paths. `root_certificates`
    verifies the server (None: the system's roots); `client_certificate` with
    `client_key` answers a mutual-TLS server. The token (argument, else
    $ROLLOUT_RECORDER_TOKEN, else $ROLLOUT_RECORDER_TOKEN_FILE) is sent with
    every call. `options` are gRPC channel options
    (e.g. ("grpc.ssl_target_name_override", "recorder") for a certificate
    issued to another name).
    """
    if (client_certificate is None) != (client_key is None):
        raise ValueError(
            "client_certificate and client_key: expected both or neither, got "
            f"{'client_certificate' if client_key is None else 'client_key'} alone"
        )
    token = resolve_token(token)
    use_tls = tls or any(x is not None for x in (root_certificates, client_certificate))
    if use_tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read_pem(root_certificates, "root_certificates"),
            private_key=read_pem(client_key, "client_key"),
            certificate_chain=read_pem(client_certificate, "client_certificate"),
        )
        channel = grpc.secure_channel(target, credentials, options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    if token is None:
        return channel
    if not use_tls and not _is_local(target):
        logger.warning(
            "sending the recorder token to %s without TLS: anyone on that network can read it",
            target,
        )
    return grpc.intercept_channel(channel, TokenInterceptor(token))


__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "TokenInterceptor", "make_channel", "resolve_token"]
