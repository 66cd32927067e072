"""`rollout-recorder serve`: run a recorder server until SIGTERM, SIGINT or (embedded) stdin EOF.

Prints ``rollout-recorder listening on ADDRESS`` once it accepts calls. Stopping drains for
``--grace`` seconds and writes a last checkpoint; a stop that takes longer than its hard
deadline exits anyway (the write-ahead log holds everything acknowledged).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading

from ..app import DEFAULT_LISTEN, RunningServer, ServerOptions, start_server
from ..dashboard.auth import DEFAULT_SESSION_MAX_AGE_S
from ..dataset.sink import DatasetOptions, default_node_id
from ..durability import DurabilityOptions
from ..durability.wal import WALError
from ..metrics import MetricsConfig, WriteGate
from ..sessions import ServiceLimits

logger = logging.getLogger("recorder_server")

# Seconds a stop may take beyond --grace (the last checkpoint) before the process exits anyway:
# the log holds everything acknowledged, and the kernel releases the data directory's lock.
STOP_DEADLINE_S = 4.0


def _watch_stdin(stop: threading.Event) -> None:
    # The embedded server's parent holds our stdin; EOF means the parent is gone.
    # os.read on the raw fd: a daemon thread blocked in a buffered read would
    # abort the interpreter at exit.
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    stop.set()


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        options = _options(args)
        running = start_server(options)
    except (OSError, ValueError, ImportError, WALError) as exc:
        print(f"rollout-recorder: {exc}", file=sys.stderr)
        return 2
    return _serve_until_stopped(args, options, running)


def _options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        listen=args.listen,
        data_dir=args.data_dir,
        threads=args.threads,
        max_message_bytes=args.max_message_mib << 20,
        limits=ServiceLimits(
            max_chunk_bytes=args.max_chunk_mib << 20,
            max_chunk_env_steps=args.max_chunk_env_steps,
            max_upload_bytes=args.max_upload_mib << 20,
            max_sessions=args.max_sessions,
            max_workers_per_session=args.max_workers,
            session_ttl_s=args.session_ttl,
            worker_ttl_s=args.worker_ttl,
        ),
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        metrics=MetricsConfig(
            prometheus=True,
            tensorboard_dir=args.tensorboard_dir,
            jsonl_path=args.metrics_jsonl,
            tensorboard_gate=WriteGate(args.metrics_interval, args.metrics_every_steps),
            jsonl_gate=WriteGate(args.metrics_interval, args.metrics_every_steps),
            **_buckets(args),
        ),
        metrics_listen=args.metrics_listen,
        metrics_no_auth=args.metrics_no_auth,
        dashboard_session_max_age_s=args.dashboard_session_max_age,
        http_listen=args.http_listen,
        metrics_enabled=not args.no_metrics,
        embedded=args.exit_with_stdin,
        durability=DurabilityOptions(
            enabled=not args.no_wal,
            fsync=args.wal_fsync,
            batch_window_s=args.wal_batch_ms / 1000,
            checkpoint_every_s=args.checkpoint_every,
            keep=args.keep_checkpoints,
        ),
        dataset=None
        if args.dataset_uri is None
        else DatasetOptions(
            uri=args.dataset_uri,
            node_id=args.node_id or default_node_id(),
            flush_seconds=args.dataset_flush_seconds,
            file_bytes=int(args.dataset_file_mib * (1 << 20)),
            retry_max_seconds=args.dataset_retry_max_seconds,
            io_timeout=args.dataset_timeout_seconds,
        ),
    )


def _serve_until_stopped(
    args: argparse.Namespace, options: ServerOptions, running: RunningServer
) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_with_stdin:
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    if running.metrics_address:
        logger.warning("metrics at http://%s/metrics", running.metrics_address)
    if running.http_address:
        print(f"rollout-recorder dashboard at http://{running.http_address}/", flush=True)
    print(f"rollout-recorder listening on {running.address}", flush=True)
    while not stop.wait(0.5):
        pass
    logger.info("stopping")
    stopper = threading.Thread(
        target=running.stop, kwargs={"grace": args.grace}, name="stop", daemon=True
    )
    stopper.start()
    deadline = args.grace + STOP_DEADLINE_S
    if options.dataset is not None:
        deadline += options.dataset.stop_timeout
    stopper.join(deadline)
    if stopper.is_alive():
        logger.error(
            "stop did not finish within %.0f s; exiting (the write-ahead log holds every "
            "acknowledged chunk)",
            deadline,
        )
        logging.shutdown()
        os._exit(1)
    return 0


def _bounds(text: str) -> tuple[float, ...]:
    """Histogram bucket bounds from ``1,10,100``: finite and strictly increasing."""
    try:
        bounds = tuple(float(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if any(not math.isfinite(b) for b in bounds) or any(
        b <= a for a, b in zip(bounds, bounds[1:], strict=False)
    ):
        raise argparse.ArgumentTypeError(f"expected finite, increasing bounds, got {text!r}")
    return bounds


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _buckets(args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    out = {}
    if args.metrics_return_buckets:
        out["return_buckets"] = args.metrics_return_buckets
    if args.metrics_length_buckets:
        out["length_buckets"] = args.metrics_length_buckets
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a recorder server")
    serve.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help="HOST:PORT (port 0 picks one) or unix:PATH; default %(default)s",
    )
    serve.add_argument("--data-dir", default="./recorder-data", help="default %(default)s")
    serve.add_argument(
        "--threads",
        type=int,
        default=0,
        help="ingest threads (decode, split, log); default 0: sized to the machine. An open "
        "stream holds no thread",
    )
    serve.add_argument("--max-message-mib", type=int, default=256, help="gRPC message cap")
    serve.add_argument(
        "--max-chunk-mib",
        type=int,
        default=ServiceLimits.max_chunk_bytes >> 20,
        help="raw MiB of one chunk or submitted episode, all its arrays together, checked "
        "from their headers before anything is decompressed (default %(default)s)",
    )
    serve.add_argument(
        "--max-chunk-env-steps",
        type=int,
        default=ServiceLimits.max_chunk_env_steps,
        help="env steps (T x N) of one chunk, or steps of one submitted episode: each costs "
        "about 200 bytes while the chunk is split (default %(default)s)",
    )
    serve.add_argument(
        "--max-upload-mib",
        type=int,
        default=ServiceLimits.max_upload_bytes >> 20,
        help="MiB of one runtime state or store checkpoint a client loads, as sent and as "
        "decoded (default %(default)s)",
    )
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=64,
        help="sessions held at once; dropping one frees its place (default %(default)s)",
    )
    serve.add_argument(
        "--max-workers",
        type=int,
        default=1024,
        help="active workers per session; a worker that left or expired does not count "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--session-ttl",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="drop a session unused this long: no join, chunk, finish, reset or store call "
        "(its data is deleted, durably); default 0: never",
    )
    serve.add_argument(
        "--worker-ttl",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a worker that neither joins nor sends a chunk this long expires: it no longer "
        "counts against --max-workers, its chunks stay, and it resumes by joining again "
        "(clients do so by themselves); 0: never; default %(default)s",
    )
    serve.add_argument("--grace", type=float, default=5.0, help="seconds to drain on stop")
    serve.add_argument(
        "--exit-with-stdin", action="store_true", help="stop when stdin closes (embedded mode)"
    )
    data = serve.add_argument_group("episode dataset")
    data.add_argument(
        "--dataset-uri",
        metavar="URI",
        help="write every finished episode to Parquet files here: a path, file://, "
        "s3://bucket/prefix (AWS_* environment variables, AWS_ENDPOINT_URL included) or any "
        "fsspec URL; needs rollout-recorder[dataset]",
    )
    data.add_argument(
        "--node-id",
        metavar="ID",
        help="this sidecar's prefix in episode ids and file names, unique among the sidecars "
        "writing one dataset; default: the hostname",
    )
    data.add_argument(
        "--dataset-flush-seconds",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long a finished episode waits to be written; while chunks keep arriving, "
        "writes wait for a gap in ingest, up to twice this; default %(default)s",
    )
    data.add_argument(
        "--dataset-file-mib",
        type=float,
        default=64.0,
        metavar="MIB",
        help="raw episode bytes per file (a full file is written without waiting); "
        "default %(default)s",
    )
    data.add_argument(
        "--dataset-retry-max-seconds",
        type=float,
        default=8.0,
        metavar="SECONDS",
        help="longest wait between retries of a failed write (the backoff doubles from 1 s): "
        "the dataset catches up within about this once the store answers; default %(default)s",
    )
    data.add_argument(
        "--dataset-timeout-seconds",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="S3: seconds to connect and to wait for each answer before the write is retried; "
        "default %(default)s",
    )
    durable = serve.add_argument_group("durability")
    durable.add_argument(
        "--wal-fsync",
        choices=("always", "batch", "never"),
        default="batch",
        help="always: fsync before every ack; batch (default): fsync every --wal-batch-ms, "
        "a power failure can lose that window, a process kill loses nothing; never: OS decides",
    )
    durable.add_argument("--wal-batch-ms", type=float, default=50.0, help="default %(default)s")
    durable.add_argument(
        "--checkpoint-every",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="timed checkpoints (0: only on demand and at shutdown); default %(default)s",
    )
    durable.add_argument("--keep-checkpoints", type=int, default=3, help="default %(default)s")
    durable.add_argument(
        "--no-wal",
        action="store_true",
        help="no log and no checkpoints: a crash loses everything (throwaway servers)",
    )
    metrics = serve.add_argument_group("metrics")
    metrics.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="Prometheus endpoint; with --token-file it requires the token "
        "(Authorization: Bearer, e.g. Prometheus's authorization: credentials_file)",
    )
    metrics.add_argument(
        "--metrics-no-auth",
        action="store_true",
        help="serve --metrics-listen without the token even with --token-file (logs a warning)",
    )
    metrics.add_argument(
        "--http-listen",
        metavar="HOST:PORT",
        help="the live dashboard, its JSON API (/api/sessions) and /metrics on one listener "
        "(port 0 picks one); with --token-file it requires the token",
    )
    metrics.add_argument(
        "--dashboard-session-max-age",
        type=_positive_seconds,
        default=DEFAULT_SESSION_MAX_AGE_S,
        metavar="SECONDS",
        help="how long a dashboard login cookie stays valid (default %(default)g; "
        "/logout revokes it sooner)",
    )
    metrics.add_argument(
        "--no-metrics", action="store_true", help="keep no metrics (to measure what they cost)"
    )
    metrics.add_argument("--tensorboard-dir", metavar="DIR", help="TensorBoard event files")
    metrics.add_argument("--metrics-jsonl", metavar="FILE", help="JSON lines of metric values")
    metrics.add_argument(
        "--metrics-interval",
        type=float,
        default=1.0,
        help="seconds between TensorBoard/JSONL writes (default %(default)s)",
    )
    metrics.add_argument(
        "--metrics-every-steps",
        type=int,
        default=0,
        help="env steps between TensorBoard/JSONL writes (default: no step gate)",
    )
    metrics.add_argument(
        "--metrics-return-buckets",
        metavar="B1,B2,...",
        type=_bounds,
        help="upper bounds of the episode-return histogram's buckets (default "
        + ",".join(f"{b:g}" for b in MetricsConfig.return_buckets)
        + ")",
    )
    metrics.add_argument(
        "--metrics-length-buckets",
        metavar="B1,B2,...",
        type=_bounds,
        help="upper bounds of the episode-length histogram's buckets (default "
        + ",".join(f"{b:g}" for b in MetricsConfig.length_buckets)
        + ")",
    )
    serve.add_argument(
        "--token-file",
        default=os.environ.get("ROLLOUT_RECORDER_TOKEN_FILE") or None,
        help="file holding the token clients must send (default $ROLLOUT_RECORDER_TOKEN_FILE)",
    )
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", default=None, help="PEM CA of client certificates (mutual TLS)"
    )
    serve.set_defaults(func=cmd_serve)
