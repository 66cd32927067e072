"""What every client command of the CLI shares: the token and TLS flags, and the credentials
they make (`status`, `health`, `sessions`, `export`, `demo-worker`).

The token is, first to last: ``--token-file``, $ROLLOUT_RECORDER_TOKEN (the token itself),
$ROLLOUT_RECORDER_TOKEN_FILE (a file holding it); none of them: no token. The TLS flags are
PEM files: ``--tls-ca`` verifies the server and turns TLS on; ``--tls-cert`` with
``--tls-key`` answer a mutual-TLS server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from recorder_client._credentials import TOKEN_ENV, TOKEN_FILE_ENV, make_channel, resolve_token


@dataclass(frozen=True)
class Credentials:
    """How a command reaches a server, from its flags (`from_args`)."""

    token: str | None = None
    """The token from --token-file; None: make_channel reads the environment."""
    root_certificates: str | None = None
    """--tls-ca: PEM file of the CA that signed the server's certificate (turns TLS on)."""
    client_certificate: str | None = None
    """--tls-cert: PEM file of this client's certificate (mutual TLS)."""
    client_key: str | None = None
    """--tls-key: PEM file of --tls-cert's private key."""
    tls: bool = False
    """--tls: TLS with the system's root certificates (channel commands only)."""
    server_name: str | None = None
    """--tls-server-name: the name expected in the server's certificate (channel commands)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Credentials:
        """The flags of `add_flags`; ValueError naming the flag for an unusable one."""
        if (args.tls_cert is None) != (args.tls_key is None):
            given = "--tls-cert" if args.tls_key is None else "--tls-key"
            raise ValueError(f"--tls-cert and --tls-key: expected both or neither, got {given}")
        return cls(
            token=_read_token_file(args.token_file),
            root_certificates=args.tls_ca,
            client_certificate=args.tls_cert,
            client_key=args.tls_key,
            tls=getattr(args, "tls", False),
            server_name=getattr(args, "tls_server_name", None),
        )

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the recorder_client functions and `RolloutRecorder`."""
        return {
            "token": self.token,
            "root_certificates": self.root_certificates,
            "client_certificate": self.client_certificate,
            "client_key": self.client_key,
        }

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to `target` that sends the token and speaks TLS as the flags say."""
        options = list(options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return make_channel(target, tls=self.tls, options=options, **self.client_kwargs())


def _read_token_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"--token-file {path!r}: cannot read it ({exc.strerror})") from None
    try:
        return resolve_token(text)
    except ValueError:
        raise ValueError(
            f"--token-file {path!r}: expected a non-empty token of printable ASCII without spaces"
        ) from None


def add_flags(parser: argparse.ArgumentParser, *, channel: bool = False) -> None:
    """Add --token-file and the TLS flags; ``channel``: also --tls and --tls-server-name
    (for commands that open their own gRPC channel)."""
    group = parser.add_argument_group(
        "credentials",
        f"the token is --token-file, else ${TOKEN_ENV}, else the file ${TOKEN_FILE_ENV} names",
    )
    group.add_argument("--token-file", metavar="FILE", help="file holding the server's token")
    group.add_argument(
        "--tls-ca", metavar="PEM", help="CA certificate that signed the server's (turns TLS on)"
    )
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    group.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    if channel:
        group.add_argument(
            "--tls", action="store_true", help="use TLS with the system's root certificates"
        )
        group.add_argument(
            "--tls-server-name", metavar="NAME", help="name expected in the server's certificate"
        )


def fail(command: str, message: str) -> int:
    """Print ``rollout-recorder COMMAND: MESSAGE`` on stderr; returns exit status 1."""
    print(f"rollout-recorder {command}: {message}", file=sys.stderr)
    return 1


__all__ = ["Credentials", "add_flags", "fail"]
