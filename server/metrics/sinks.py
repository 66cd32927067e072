"""Where `MetricsTracker` values go: Prometheus (pulled), TensorBoard and JSON lines (pushed).

The tracker owns the values; the sinks here only render them.

- Prometheus is a custom collector on the tracker's own `CollectorRegistry`: it reads the
  tracker's current values at scrape time, so the hot path never touches prometheus_client
  and a scrape always shows the latest value. `PrometheusEndpoint` serves that registry over
  HTTP (prometheus_client's WSGI app in a threaded wsgiref server) and can be stopped.
- `TensorBoardSink` and `JsonlSink` receive gated batches of rows
  `(folded_tag, value, step, tag, labels)` from the tracker. TensorBoard writes one run
  directory per session; JSON lines carry the folded tag.
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

Row = tuple[str, float, int, str, tuple[tuple[str, str], ...]]
"""One pushed value: (folded tag, value, step, tag, labels as sorted (name, value) pairs)."""

PromRow = tuple[str, str, str, tuple[str, ...], tuple[str, ...], object]
"""One Prometheus sample: (kind, exported family name, help, label names, label values, value);
for a histogram the value is ``([(upper bound, cumulative count), ...], sum)``, +Inf last."""


class PushSink(Protocol):
    """A sink the tracker writes gated batches to."""

    def write(self, rows: Sequence[Row], walltime: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Prometheus


class PrometheusCollector:
    """A prometheus_client collector that renders the tracker's values at scrape time, after
    calling each of ``before`` (levels measured on demand, such as each worker's lag)."""

    def __init__(
        self, rows: Callable[[], list[PromRow]], before: Sequence[Callable[[], object]] = ()
    ) -> None:
        self._rows = rows
        self._before = before

    def collect(self) -> Iterable[object]:
        for measure in self._before:
            measure()
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.samples import Sample

        classes = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
        families: dict[str, object] = {}
        for kind, name, help_text, label_names, label_values, value in self._rows():
            family = families.get(name)
            if family is None:
                cls = classes.get(kind, GaugeMetricFamily)
                family = families[name] = cls(name, help_text, labels=label_names)
            if kind == "histogram":
                buckets, total = value  # type: ignore[misc]
                family.add_metric(  # type: ignore[attr-defined]
                    label_values, [(_le(b), c) for b, c in buckets], total
                )
                if buckets[0][0] < 0:
                    # prometheus_client leaves _count and _sum out when a bucket bound is
                    # negative (OpenMetrics); returns are negative often enough, and
                    # rate(_sum) / rate(_count) is how a mean return is read: kept.
                    labels = dict(zip(label_names, label_values, strict=True))
                    family.samples.append(Sample(f"{name}_count", labels, buckets[-1][1]))  # type: ignore[attr-defined]
                    family.samples.append(Sample(f"{name}_sum", labels, total))  # type: ignore[attr-defined]
            else:
                family.add_metric(label_values, value)  # type: ignore[attr-defined]
        return list(families.values())


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (``+Inf``, ``10.0``)."""
    return "+Inf" if bound == math.inf else repr(float(bound))


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
    """TensorBoard event files written with tensorboardX's synchronous `EventsWriter`: each
    gated batch is on disk when `write` returns, as JSON lines are (tensorboardX's
    `FileWriter` queues events for a thread, so its flush may leave the last ones unwritten).

    One run directory per session: a row labelled ``session=NAME`` goes to ``<logdir>/NAME/``
    under its tag with the other labels folded in (``Recorder/chunks``,
    ``Recorder/ack_latency_seconds/worker=w0``), so runs overlay tag by tag; rows without a
    session go to ``<logdir>`` itself. Session names are path-safe by the naming rule. Tags are
    written as given (no tensorboardX tag cleaning).
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        require("tensorboardX", "--tensorboard-dir (TensorBoard event files)")
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._root = Path(logdir)
        self._root.mkdir(parents=True, exist_ok=True)
        self._summary = Summary
        self._event = Event
        self._events_writer = EventsWriter
        self._writers: dict[str, object] = {}

    def _writer(self, session: str) -> object:
        writer = self._writers.get(session)
        if writer is None:
            logdir = self._root / session if session else self._root
            logdir.mkdir(parents=True, exist_ok=True)
            writer = self._writers[session] = self._events_writer(str(logdir / "events"))
        return writer

    def write(self, rows: Sequence[Row], walltime: float) -> None:
        summary_cls = self._summary
        value_cls = summary_cls.Value
        by_run: dict[str, dict[int, list[object]]] = {}
        for _, value, step, tag, labels in rows:
            session = ""
            rest = labels
            for i, (name, label) in enumerate(labels):
                if name == "session":
                    session, rest = label, labels[:i] + labels[i + 1 :]
                    break
            if rest:
                tag = "/".join([tag, *(f"{k}={v}" for k, v in rest)])
            by_step = by_run.setdefault(session, {})
            by_step.setdefault(step, []).append(value_cls(tag=tag, simple_value=value))
        for session, by_step in by_run.items():
            writer = self._writer(session)
            for step in sorted(by_step):  # in step order: readers drop steps that go back
                event = self._event(
                    wall_time=walltime, step=step, summary=summary_cls(value=by_step[step])
                )
                writer.write_event(event)  # type: ignore[attr-defined]
            writer.flush()  # type: ignore[attr-defined]

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()  # type: ignore[attr-defined]


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
            for tag, value, step, _, _ in rows
        )
        self._file.flush()

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
