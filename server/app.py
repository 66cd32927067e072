"""Build and start the gRPC server."""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from recorder_client._proto import recorder_pb2_grpc as pb_grpc

from .durability import Durability, DurabilityOptions, RecoveryReport
from .metrics import MetricsConfig, MetricsTracker, NullMetrics
from .security import (
    RECORDER_SERVICE_NAME,
    TokenAuthInterceptor,
    add_standard_services,
    load_token,
    server_credentials,
    set_serving,
)
from .service import RecorderService, ServiceLimits

logger = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:50051"


@dataclass(frozen=True)
class ServerOptions:
    """Everything `rollout-recorder serve` can set."""

    # HOST:PORT (port 0 picks a free one) or unix:PATH. Loopback unless told otherwise.
    listen: str = DEFAULT_LISTEN
    # Where sessions keep their files.
    data_dir: str = "./recorder-data"
    # Handler threads; each open Record stream holds one.
    threads: int = 64
    # Largest gRPC message accepted or sent.
    max_message_bytes: int = 256 << 20
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # False: keep no metrics at all (the baseline the metrics cost is measured against).
    metrics_enabled: bool = True
    # HOST:PORT for the Prometheus endpoint, or None for no endpoint.
    metrics_listen: str | None = None
    # File holding the token every call must carry; None: no token required.
    token_file: str | None = None
    # PEM certificate chain and private key: serve TLS instead of plaintext.
    tls_cert: str | None = None
    tls_key: str | None = None
    # PEM CA that client certificates must chain to (mutual TLS; needs tls_cert).
    tls_client_ca: str | None = None
    # Write-ahead log, checkpoints and recovery in data_dir.
    durability: DurabilityOptions = field(default_factory=DurabilityOptions)


@dataclass
class RunningServer:
    server: grpc.Server
    service: RecorderService
    address: str
    metrics_address: str | None = None
    # The grpc.health.v1 servicer (None without grpcio-health-checking).
    health: Any = None
    durability: Durability | None = None
    recovery: RecoveryReport | None = None

    def stop(self, grace: float | None = 5.0, *, checkpoint: bool = True) -> None:
        """Drain, write a last checkpoint, and release everything."""
        set_serving(self.health, False)  # draining: health answers NOT_SERVING
        self.server.stop(grace).wait()
        try:
            if self.durability is not None:
                if checkpoint:
                    try:
                        self.durability.checkpoint(self.service)
                    except OSError as exc:
                        logger.error("final checkpoint failed (the log still has it): %s", exc)
                self.durability.close()
        finally:
            self.service.close()
            self.service.metrics.close()


def bound_address(listen: str, port: int) -> str:
    if listen.startswith("unix:"):
        return listen
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def start_server(options: ServerOptions) -> RunningServer:
    Path(options.data_dir).mkdir(parents=True, exist_ok=True)
    if (options.tls_cert is None) != (options.tls_key is None):
        raise ValueError("--tls-cert and --tls-key: expected both or neither")
    if options.tls_client_ca is not None and options.tls_cert is None:
        raise ValueError("--tls-client-ca: expected --tls-cert and --tls-key with it")
    interceptors = []
    if options.token_file is not None:
        interceptors.append(TokenAuthInterceptor(load_token(options.token_file)))
    credentials = None
    if options.tls_cert is not None:
        credentials = server_credentials(options.tls_cert, options.tls_key, options.tls_client_ca)
    metrics = MetricsTracker(options.metrics) if options.metrics_enabled else NullMetrics()
    metrics_address = None
    if options.metrics_listen:
        host, _, port = options.metrics_listen.rpartition(":")
        bound_host, bound_port = metrics.start_http(host or "127.0.0.1", int(port))
        metrics_address = f"{bound_host}:{bound_port}"
    durability = None
    if options.durability.enabled:
        durability = Durability(options.data_dir, options.durability)
    service = RecorderService(options.limits, metrics, durability)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="recorder"),
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=options.threads * 4,
        interceptors=interceptors,
    )
    pb_grpc.add_RecorderServicer_to_server(service, server)
    health = add_standard_services(server, [RECORDER_SERVICE_NAME])
    try:
        if credentials is not None:
            port = server.add_secure_port(options.listen, credentials)
        else:
            port = server.add_insecure_port(options.listen)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {options.listen!r}: {exc}") from None
    if port == 0 and not options.listen.startswith("unix:"):
        raise OSError(f"cannot listen on {options.listen!r}")
    recovery = None
    if durability is not None:
        # Bound but not serving yet: calls wait until the recovered state is in place.
        recovery = durability.recover(service)
        # A fresh data directory is not news; anything recovered, skipped or dropped is.
        level = logging.WARNING if recovery.notable else logging.INFO
        for line in recovery.lines():
            logger.log(level, "recovery: %s", line)
        durability.start_timer(service)
    server.start()
    set_serving(health, True)
    address = bound_address(options.listen, port)
    logger.info("listening on %s", address)
    return RunningServer(server, service, address, metrics_address, health, durability, recovery)
