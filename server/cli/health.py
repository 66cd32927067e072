"""`rollout-recorder health`: ask a server's grpc.health.v1 service whether it serves.

Exit status 0 when both the whole server ("") and the recorder service are
SERVING, 1 otherwise (NOT_SERVING, unknown, unreachable); one line on stdout
says which. Used by the image's HEALTHCHECK and compose's healthcheck. The
health service needs no token.
"""

from __future__ import annotations

import argparse
import os

import grpc

from recorder_client.errors import handshake_hint

from ..extras import MissingExtraError, require
from ..rpc.security import RECORDER_SERVICE_NAME
from .common import Credentials, add_flags


def health_main(
    target: str,
    timeout: float = 5.0,
    *,
    tls_ca: str | os.PathLike[str] | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls: bool = False,
    server_name: str | None = None,
    service: str = RECORDER_SERVICE_NAME,
) -> int:
    """Check `service` and "" on `target`; print one line; 0 when both are SERVING."""
    credentials = Credentials(
        root_certificates=tls_ca,
        client_certificate=tls_cert,
        client_key=tls_key,
        tls=tls,
        server_name=server_name,
    )
    return check(target, timeout, credentials, service)


def check(
    target: str, timeout: float, credentials: Credentials, service: str = RECORDER_SERVICE_NAME
) -> int:
    """`health_main` with the credentials of the command's flags."""
    try:
        health_pb2 = require("grpc_health.v1.health_pb2", "rollout-recorder health")
        health_pb2_grpc = require("grpc_health.v1.health_pb2_grpc", "rollout-recorder health")
        channel = credentials.channel(target)
    except (ValueError, MissingExtraError) as exc:
        print(f"UNKNOWN {target}: {exc}", flush=True)
        return 1
    statuses: dict[str, str] = {}
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=timeout)
            except grpc.RpcError as err:
                code, details = err.code(), err.details() or ""
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    print(f"UNREACHABLE {target}: no answer within {timeout}s", flush=True)
                elif code == grpc.StatusCode.UNAVAILABLE:
                    print(f"UNREACHABLE {target}: {details}{handshake_hint(details)}", flush=True)
                else:
                    print(f"UNKNOWN {target}: {code.name}: {details}", flush=True)
                return 1
            statuses[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    overall, own = statuses[""], statuses[service]
    ok = overall == own == "SERVING"
    word = "SERVING" if ok else "NOT_SERVING"
    print(f"{word} {target}: server {overall}, {service} {own}", flush=True)
    return 0 if ok else 1


def cmd_health(args: argparse.Namespace) -> int:
    try:
        credentials = Credentials.from_args(args)
    except ValueError as exc:
        print(f"UNKNOWN {args.target}: {exc}", flush=True)
        return 1
    return check(args.target, args.timeout, credentials)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `health` subcommand to the CLI's subparsers."""
    parser = sub.add_parser(
        "health",
        help="check a server's gRPC health (exit 0 when SERVING)",
        description="Call grpc.health.v1 Check for the recorder service and the whole "
        "server; exit 0 when both are SERVING, 1 otherwise. Needs no token (one given is "
        "sent all the same).",
    )
    parser.add_argument(
        "--target", default="127.0.0.1:50051", help="HOST:PORT or unix:PATH; default %(default)s"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds; default %(default)s")
    add_flags(parser, channel=True)
    parser.set_defaults(func=cmd_health)
    return parser


__all__ = ["add_parser", "check", "health_main"]
