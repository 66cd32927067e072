"""Build, start and stop the server: gRPC on an asyncio loop of its own, the core beside it.

`start_server` returns once the server accepts calls (after recovery); `RunningServer.stop`
drains, writes a last checkpoint and releases everything, from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from recorder_client._proto import recorder_pb2_grpc as pb_grpc

from .dashboard import Dashboard
from .dashboard.auth import DEFAULT_SESSION_MAX_AGE_S, bearer_only
from .dashboard.episodes import EpisodeWindow
from .dataset.sink import DatasetOptions, DatasetSink
from .durability import Durability, DurabilityOptions, RecoveryReport
from .extras import require
from .httpserve import HttpListener
from .identity import start_cause
from .lifecycle import Lifecycle
from .metrics import MetricsConfig, MetricsTracker, NullMetrics
from .rpc.offload import Offload, default_threads
from .rpc.security import (
    RECORDER_SERVICE_NAME,
    Health,
    MalformedRequestInterceptor,
    TokenAuthInterceptor,
    add_standard_services,
    load_token,
    server_credentials,
)
from .rpc.servicer import RecorderServicer
from .sessions import ServiceLimits, Sessions

logger = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:50051"
# Control calls (finish, status, store verbs, checkpoints) have a small pool of their own.
_CONTROL_THREADS = 4
_CONTROL_QUEUE = 256


@dataclass(frozen=True)
class ServerOptions:
    """Everything `rollout-recorder serve` can set."""

    listen: str = DEFAULT_LISTEN
    """HOST:PORT (port 0 picks a free one) or unix:PATH. Loopback unless told otherwise."""
    data_dir: str = "./recorder-data"
    """Where sessions keep their files."""
    threads: int = 0
    """Ingest threads (decode, split, log, queue for the store); 0: sized to the machine."""
    queue: int = 0
    """Chunks waiting for an ingest thread beyond those running; 0: as many as threads."""
    max_message_bytes: int = 256 << 20
    """Largest gRPC message accepted or sent."""
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    metrics_enabled: bool = True
    """False: keep no metrics at all (the baseline the metrics cost is measured against)."""
    metrics_listen: str | None = None
    """HOST:PORT for the Prometheus endpoint, or None for no endpoint. With token_file, it
    requires the token as ``Authorization: Bearer`` unless metrics_no_auth."""
    metrics_no_auth: bool = False
    """Serve the Prometheus endpoint without the token even when token_file is set."""
    http_listen: str | None = None
    """HOST:PORT (port 0 picks a free one) for the dashboard, its JSON API and /metrics; None:
    no dashboard. With token_file, the dashboard requires the token too."""
    dashboard_session_max_age_s: float = DEFAULT_SESSION_MAX_AGE_S
    """Seconds a dashboard login cookie stays valid (logout revokes it sooner)."""
    token_file: str | None = None
    """File holding the token every call must carry; None: no token required."""
    tls_cert: str | None = None
    """PEM certificate chain: serve TLS instead of plaintext (with tls_key)."""
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """PEM CA that client certificates must chain to (mutual TLS; needs tls_cert)."""
    durability: DurabilityOptions = field(default_factory=DurabilityOptions)
    """Write-ahead log, checkpoints and recovery in data_dir."""
    dataset: DatasetOptions | None = None
    """Write every finished episode to a Parquet dataset (serve --dataset-uri); None: no."""
    embedded: bool = False
    """A private server its parent process owns (serve --exit-with-stdin): nothing probes its
    health, so missing health and reflection packages are no warning."""


class RunningServer:
    """A started server; `stop()` ends it."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        server: grpc.aio.Server,
        sessions: Sessions,
        metrics,
        address: str,
        pools: tuple[Offload, Offload],
        *,
        metrics_address: str | None = None,
        metrics_listener: HttpListener | None = None,
        http_address: str | None = None,
        dashboard: Dashboard | None = None,
        health: Health | None = None,
        durability: Durability | None = None,
        recovery: RecoveryReport | None = None,
        lifecycle: Lifecycle | None = None,
        dataset: DatasetSink | None = None,
    ) -> None:
        self._loop = loop
        self._thread = thread
        self.server = server
        self.sessions = sessions
        self.metrics = metrics
        self.address = address
        self.metrics_address = metrics_address
        self._metrics_listener = metrics_listener
        self.http_address = http_address
        """HOST:PORT the dashboard listens on (None without one)."""
        self._dashboard = dashboard
        self.health = health
        self.durability = durability
        self.recovery = recovery
        self.lifecycle = lifecycle
        self.dataset = dataset
        self._pools = pools
        self._stopped = False

    def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 answers for the server and the recorder service (a server
        that serves calls but says NOT_SERVING is drained by load balancers)."""
        if self.health is not None:
            asyncio.run_coroutine_threadsafe(self.health.set_serving(serving), self._loop).result()

    def stop(self, grace: float | None = 5.0, *, checkpoint: bool = True) -> None:
        """Refuse new calls, let running ones finish for ``grace`` seconds (then cancel them),
        write a last checkpoint and release everything."""
        if self._stopped:
            return
        self._stopped = True
        if self._dashboard is not None:
            self._dashboard.close()
        if self._metrics_listener is not None:
            self._metrics_listener.close()
        try:
            asyncio.run_coroutine_threadsafe(self._stop_serving(grace), self._loop).result()
        finally:
            for pool in self._pools:
                pool.shutdown()
            if self.lifecycle is not None:
                self.lifecycle.close()
            try:
                if self.dataset is not None:
                    self.dataset.close()  # before the last checkpoint: it holds the cursor
                if self.durability is not None:
                    if checkpoint:
                        try:
                            self.durability.checkpoint(self.sessions)
                        except OSError as exc:
                            logger.error("final checkpoint failed (the log still has it): %s", exc)
                    self.durability.close()
            finally:
                self.sessions.close()
                self.metrics.close()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
                if not self._thread.is_alive():
                    self._loop.close()

    async def _stop_serving(self, grace: float | None) -> None:
        if self.health is not None:
            await self.health.set_serving(False)  # draining: health answers NOT_SERVING
        await self.server.stop(grace)


def bound_address(listen: str, port: int) -> str:
    if listen.startswith("unix:"):
        return listen
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def start_server(options: ServerOptions) -> RunningServer:
    """Start a server as `options` say; returns once it accepts calls."""
    Path(options.data_dir).mkdir(parents=True, exist_ok=True)
    if (options.tls_cert is None) != (options.tls_key is None):
        raise ValueError("--tls-cert and --tls-key: expected both or neither")
    if options.tls_client_ca is not None and options.tls_cert is None:
        raise ValueError("--tls-client-ca: expected --tls-cert and --tls-key with it")
    token = None if options.token_file is None else load_token(options.token_file)
    credentials = None
    if options.tls_cert is not None:
        credentials = server_credentials(options.tls_cert, options.tls_key, options.tls_client_ca)
    metrics = MetricsTracker(options.metrics) if options.metrics_enabled else NullMetrics()
    if options.http_listen:  # the dashboard's recent episodes are kept as they are counted
        metrics = EpisodeWindow(metrics)
    metrics_address = None
    metrics_listener = None
    durability = None
    dashboard = None
    http_address = None
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="recorder-rpc", daemon=True)
    try:
        if options.metrics_listen:
            metrics_listener = _metrics_listener(options, metrics, token)
            host, _, port = options.metrics_listen.rpartition(":")
            bound_host, bound_port = metrics_listener.start(
                host.strip("[]") or "127.0.0.1", int(port)
            )
            metrics_address = f"{bound_host}:{bound_port}"
        if options.durability.enabled:
            durability = Durability(options.data_dir, options.durability)
        sessions = Sessions(
            options.limits, metrics, None if durability is None else durability.journal
        )
        sessions.start_cause = start_cause(
            durability is not None, options.durability.fsync, options.durability.batch_window_s
        )
        if options.dataset is not None:
            sessions.dataset = DatasetSink(options.dataset, sessions, metrics)
        if hasattr(metrics, "before_scrape"):  # a tracker (NullMetrics has no scrape)
            metrics.before_scrape.append(sessions.publish_levels)
        lifecycle = Lifecycle(sessions, durability)
        if options.http_listen:  # before gRPC: a port taken fails the start with nothing running
            host, _, port = options.http_listen.rpartition(":")
            dashboard = Dashboard(
                sessions,
                metrics,
                token,
                session_max_age_s=options.dashboard_session_max_age_s,
            )
            bound_host, bound_port = dashboard.start(host.strip("[]") or "127.0.0.1", int(port))
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            http_address = f"{shown}:{bound_port}"
        threads = options.threads or default_threads()
        pools = (
            Offload(threads, options.queue or threads, "recorder-ingest"),
            Offload(_CONTROL_THREADS, _CONTROL_QUEUE, "recorder-control"),
        )
        thread.start()
        started = asyncio.run_coroutine_threadsafe(
            _serve(options, lifecycle, metrics, pools, token, credentials), loop
        )
        server, address, health, recovery = started.result()
    except BaseException:
        if dashboard is not None:
            dashboard.close()
        if metrics_listener is not None:
            metrics_listener.close()
        if durability is not None:
            durability.close()
        metrics.close()
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
        raise
    return RunningServer(
        loop,
        thread,
        server,
        sessions,
        metrics,
        address,
        pools,
        metrics_address=metrics_address,
        metrics_listener=metrics_listener,
        http_address=http_address,
        dashboard=dashboard,
        health=health,
        durability=durability,
        recovery=recovery,
        lifecycle=lifecycle,
        dataset=sessions.dataset,
    )


def _metrics_listener(options: ServerOptions, metrics, token: str | None) -> HttpListener:
    """The Prometheus endpoint (--metrics-listen), behind the token when there is one."""
    if not options.metrics_enabled:
        raise ValueError("metrics: --metrics-listen needs metrics; the server runs --no-metrics")
    app = require("prometheus_client", "a Prometheus metrics endpoint").make_wsgi_app(
        metrics.registry
    )
    if token is not None and options.metrics_no_auth:
        logger.warning(
            "metrics: --metrics-no-auth: the Prometheus endpoint serves every session's name "
            "and counters without the token"
        )
    elif token is not None:
        app = bearer_only(app, token)
    return HttpListener(app, name="metrics-http")


async def _serve(
    options: ServerOptions,
    lifecycle: Lifecycle,
    metrics,
    pools: tuple[Offload, Offload],
    token: str | None,
    credentials: grpc.ServerCredentials | None,
) -> tuple[grpc.aio.Server, str, Health | None, RecoveryReport | None]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Clients ping every keepalive_seconds to find a server that stopped answering
            # (client/_connection.py): take their pings, however often, without a GOAWAY.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        # The token first: a call without it learns nothing else.
        interceptors=[
            *([] if token is None else [TokenAuthInterceptor(token)]),
            MalformedRequestInterceptor(),
        ],
    )
    sessions, durability = lifecycle.sessions, lifecycle.durability
    ingest, control = pools
    servicer = RecorderServicer(
        lifecycle,
        metrics,
        ingest=ingest,
        control=control,
        max_message_bytes=options.max_message_bytes,
    )
    pb_grpc.add_RecorderServicer_to_server(servicer, server)
    health = await add_standard_services(server, [RECORDER_SERVICE_NAME], quiet=options.embedded)
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
        # Bound but not serving yet: recovery runs before the first call is taken.
        recovery = await asyncio.get_running_loop().run_in_executor(
            None, durability.recover, sessions
        )
        # A fresh data directory is not news; anything recovered, skipped or dropped is.
        level = logging.WARNING if recovery.notable else logging.INFO
        for line in recovery.lines():
            logger.log(level, "recovery: %s", line)
        durability.start_timer(sessions)
    if sessions.dataset is not None:
        sessions.dataset.start()
    lifecycle.start()
    await server.start()
    if health is not None:
        await health.set_serving(True)
    address = bound_address(options.listen, port)
    logger.info("listening on %s", address)
    return server, address, health, recovery
