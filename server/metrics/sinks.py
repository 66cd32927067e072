"""Where `MetricsTracker` values go: Prometheus (pulled), TensorBoard and JSON lines (pushed).

The tracker owns the values; the sinks here only render them.

- Prometheus is a custom collector on the tracker's own `CollectorRegistry`: it reads the
  tracker's current values at scrape time, so the hot path never touches prometheus_client
  and a scrape always shows the latest value. `PrometheusEndpoint` serves that registry over
  HTTP (prometheus_client's WSGI app in a threaded wsgiref server) and can be stopped.
- `TensorBoardSink` and `JsonlSink` receive gated batches of rows
  `(folded_tag, value, step)` from the tracker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..extras import require

logger = logging.getLogger(__name__)

Row = tuple[str, float, int]
"""One pushed value: (folded tag, value, step)."""

PromRow = tuple[str, str, str, tuple[str, ...], tuple[str, ...], float]
"""One Prometheus sample: (kind, exported family name, help, label names, label values, value)."""


class PushSink(Protocol):
    """A sink the tracker writes gated batches to."""

    def write(self, rows: Sequence[Row], walltime: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Prometheus


class PrometheusCollector:
    """A prometheus_client collector that renders the tracker's values at scrape time."""

    def __init__(self, rows: Callable[[], list[PromRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterable[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for kind, name, help_text, label_names, label_values, value in self._rows():
            family = families.get(name)
            if family is None:
                if kind == "counter":
                    family = CounterMetricFamily(name, help_text, labels=label_names)
                else:
                    family = GaugeMetricFamily(name, help_text, labels=label_names)
                families[name] = family
            family.add_metric(label_values, value)
        return list(families.values())


class _SilentHandler(WSGIRequestHandler):
    """Request handler that does not write an access log line per scrape to stderr."""

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("metrics http: " + format, *args)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class PrometheusEndpoint:
    """A running HTTP server exposing one registry at any path (``/metrics`` by convention)."""

    def __init__(self, registry: object, host: str, port: int) -> None:
        make_wsgi_app = require("prometheus_client", "a Prometheus metrics endpoint").make_wsgi_app
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = _ThreadingWSGIServer6 if family == socket.AF_INET6 else _ThreadingWSGIServer
        self._httpd = make_server(
            host,
            port,
            make_wsgi_app(registry),  # type: ignore[arg-type]
            server_class=server_class,
            handler_class=_SilentHandler,
        )
        self.host: str = self._httpd.server_address[0]
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"metrics-http-{self.port}",
            daemon=True,
        )
        self._thread.start()
        logger.info("metrics endpoint serving on http://%s:%d/metrics", self.host, self.port)

    def close(self) -> None:
        """Stop serving and close the listening socket; new connections are refused after."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# Pushed sinks


class TensorBoardSink:
    """TensorBoard event files written with tensorboardX's `FileWriter` (asynchronous writer).

    Tags are written as given (no tensorboardX tag cleaning), so folded label tags such as
    ``Recorder/chunks/session=default`` keep their ``=``.
    """

    def __init__(self, logdir: str | os.PathLike[str], flush_secs: float) -> None:
        require("tensorboardX", "--tensorboard-dir (TensorBoard event files)")
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._summary = Summary
        self._writer = FileWriter(str(logdir), max_queue=1024, flush_secs=flush_secs)

    def write(self, rows: Sequence[Row], walltime: float) -> None:
        summary_cls = self._summary
        value_cls = summary_cls.Value
        by_step: dict[int, list[object]] = {}
        for tag, value, step in rows:
            by_step.setdefault(step, []).append(value_cls(tag=tag, simple_value=value))
        for step, values in by_step.items():
            self._writer.add_summary(summary_cls(value=values), global_step=step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class JsonlSink:
    """JSON lines, appended: one object per value per write,
    ``{"step": int, "time": unix seconds, "tag": folded tag, "value": float | null}``.

    Non-finite values (NaN, inf) are written as ``null`` so every line is strict JSON.
    The file is flushed after every (gated) batch.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, rows: Sequence[Row], walltime: float) -> None:
        dumps = json.dumps
        isfinite = math.isfinite
        self._file.writelines(
            dumps(
                {
                    "step": step,
                    "time": walltime,
                    "tag": tag,
                    "value": value if isfinite(value) else None,
                },
                separators=(",", ":"),
            )
            + "\n"
            for tag, value, step in rows
        )
        self._file.flush()

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
