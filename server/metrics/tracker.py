"""The server's one metrics object: counters, gauges and stepped scalars, fanned out to sinks.

Three kinds of series, each named by a TensorBoard-style tag (``"Recorder/chunks"``,
``"Trajectories/episodes_captured"``, ``"Episode/return_mean"``):

- **scalar** — ``log(tag, value, step)`` / ``log_many(values, step)``: a value at a global step;
- **counter** — ``inc(tag, amount)``: monotonically increasing total;
- **gauge** — ``set(tag, value)``: a level that goes up and down.

A tag has exactly one kind and one set of label names for its lifetime (``ValueError``
otherwise). Keyword labels split a tag into series, e.g. ``inc("Recorder/chunks", 1,
session="default")``. Label values are converted with ``str``. Labels are:

- Prometheus labels on the exported metric (``rollout_recorder_chunks_total{session="default"}``);
- folded into the tag everywhere else (TensorBoard, JSON lines, `snapshot`), sorted by label
  name: ``"Recorder/chunks/session=default"``, ``"X/y/session=a/worker=3"``.

The names ``tag``, ``value``, ``values``, ``amount`` and ``step`` cannot be label names.

Sinks, each optional (see `MetricsConfig`):

- **Prometheus**: always the latest value, rendered at scrape time from the tracker's own
  `CollectorRegistry` (never the global one). Names: ``<namespace>_<snake_case(tag)>``;
  counters end in ``_total`` (``Recorder/raw_bytes`` → ``rollout_recorder_raw_bytes_total``),
  gauges and scalars do not (``Episode/return_mean`` → ``rollout_episode_return_mean``). Put
  units in tags (``_bytes``, ``_seconds``). Served by `MetricsTracker.start_http`.
- **TensorBoard** event files and **JSON lines**: pushed, behind a per-sink `WriteGate`.

Write gates. Every ``log``/``log_many`` call checks each pushed sink's gate in O(1). When a gate
is closed the call only updates the in-memory values (a few dict stores). When it opens, the
sink receives every series that changed since its previous write, each with its *latest*
value (values in between are coalesced, never queued): scalars at the step they were logged
at, counters and gauges at the current step (the step of the latest ``log``/``log_many``).
``inc``/``set`` never open a gate (they have no step): their changes ride along with the next
gated write, or with `flush`. `flush` writes everything pending regardless of the gates.

Thread safety: one lock guards the values; sink I/O happens outside it (under a per-sink lock
that keeps batches in order), so handler threads calling ``inc``/``log`` never wait on disk.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Self

from ..extras import require
from .sinks import (
    JsonlSink,
    PrometheusCollector,
    PrometheusEndpoint,
    PromRow,
    PushSink,
    Row,
    TensorBoardSink,
)

__all__ = [
    "MetricsConfig",
    "MetricsTracker",
    "NullMetrics",
    "WriteGate",
    "fold_tag",
    "prometheus_name",
]

logger = logging.getLogger(__name__)

_SCALAR = "scalar"
_COUNTER = "counter"
_GAUGE = "gauge"

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]+")
_UNDERSCORES = re.compile(r"__+")

_NEVER = -(2**62)


@dataclass(frozen=True)
class WriteGate:
    """When a pushed sink (TensorBoard, JSON lines) may write.

    A write happens on a ``log``/``log_many`` call when *both* hold: at least
    ``min_interval_s`` seconds have passed since the sink's previous write, and the step has
    advanced by at least ``every_n_steps`` since then (a step that goes backwards, e.g. after
    a reset, counts as advanced). ``WriteGate(0, 0)`` writes on every call.
    """

    min_interval_s: float = 1.0
    """Minimum seconds (monotonic clock) between two writes; 0 disables the time condition."""

    every_n_steps: int = 0
    """Minimum step advance between two writes; 0 disables the step condition."""

    def __post_init__(self) -> None:
        if not self.min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, got {self.min_interval_s!r}")
        if self.every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0, got {self.every_n_steps!r}")


@dataclass(frozen=True)
class MetricsConfig:
    """Which sinks a `MetricsTracker` feeds, and their write gates."""

    prometheus: bool = True
    """Keep a Prometheus registry (serve it with `MetricsTracker.start_http`)."""

    namespace: str = "rollout"
    """Prefix of every Prometheus metric name (``rollout_recorder_chunks_total``)."""

    tensorboard_dir: str | os.PathLike[str] | None = None
    """Directory for TensorBoard event files; None disables the sink (tensorboardX needed)."""

    tensorboard_gate: WriteGate = field(default_factory=WriteGate)
    """Write gate of the TensorBoard sink."""

    tensorboard_flush_secs: float = 10.0
    """How often tensorboardX's background writer flushes event files to disk."""

    jsonl_path: str | os.PathLike[str] | None = None
    """File to append JSON lines to; None disables the sink."""

    jsonl_gate: WriteGate = field(default_factory=WriteGate)
    """Write gate of the JSON lines sink."""

    def __post_init__(self) -> None:
        if self.namespace and not _LABEL_NAME.match(self.namespace):
            raise ValueError(f"namespace must match [a-zA-Z_][a-zA-Z0-9_]*, got {self.namespace!r}")


def prometheus_name(tag: str, *, counter: bool, namespace: str = "rollout") -> str:
    """The Prometheus name of a tag: ``Recorder/rawBytes`` → ``rollout_recorder_raw_bytes_total``."""
    base = _CAMEL.sub("_", tag)
    base = _UNDERSCORES.sub("_", _NOT_NAME.sub("_", base)).strip("_").lower()
    if not base:
        raise ValueError(f"tag {tag!r} has no character usable in a Prometheus name")
    name = f"{namespace}_{base}" if namespace else base
    if name[0].isdigit():
        name = "_" + name
    if counter and not name.endswith("_total"):
        name += "_total"
    return name


def fold_tag(tag: str, labels: Mapping[str, object] | None = None) -> str:
    """The tag with its labels folded in, as used by TensorBoard, JSON lines and `snapshot`."""
    if not labels:
        return tag
    return "/".join([tag, *(f"{k}={v}" for k, v in sorted(labels.items()))])


def _label_key(labels: dict[str, object]) -> tuple[tuple[str, str], ...]:
    if len(labels) == 1:
        ((k, v),) = labels.items()
        return ((k, v if type(v) is str else str(v)),)
    return tuple(sorted((k, v if type(v) is str else str(v)) for k, v in labels.items()))


@dataclass(frozen=True)
class _Series:
    kind: str
    tag: str
    label_names: tuple[str, ...]
    label_values: tuple[str, ...]
    folded: str


@dataclass(frozen=True)
class _Family:
    kind: str
    label_names: tuple[str, ...]
    prom_name: str


class _GatedSink:
    """A pushed sink with its gate state; gate fields are read and written under the tracker lock."""

    __slots__ = (
        "closed",
        "every_n",
        "io_lock",
        "last_step",
        "last_time",
        "min_interval",
        "name",
        "sink",
        "written_seq",
    )

    def __init__(self, sink: PushSink, name: str, gate: WriteGate) -> None:
        self.sink = sink
        self.name = name
        self.min_interval = float(gate.min_interval_s)
        self.every_n = int(gate.every_n_steps)
        self.last_time = float("-inf")
        self.last_step = _NEVER
        self.written_seq = 0
        self.io_lock = threading.Lock()
        self.closed = False  # set under io_lock


class MetricsTracker:
    """Counters, gauges and stepped scalars for the whole server; see the module docstring."""

    def __init__(
        self,
        config: MetricsConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create the tracker and open its sinks.

        Args:
            config: Sinks and gates; the default keeps only the Prometheus registry.
            clock: Monotonic seconds used by the write gates (injectable for tests).
        """
        self.config = config if config is not None else MetricsConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._step = 0
        # key: the tag (no labels) or (tag, ((label, value), ...)).
        self._scalars: dict[object, tuple[float, int, int]] = {}  # value, step, seq
        self._counters: dict[object, tuple[float, int]] = {}  # value, seq
        self._gauges: dict[object, tuple[float, int]] = {}  # value, seq
        self._series: dict[object, _Series] = {}
        self._families: dict[str, _Family] = {}
        self._prom_owner: dict[str, str] = {}
        self._folded_owner: dict[str, object] = {}
        self._closed = False
        self._endpoint: PrometheusEndpoint | None = None

        # Made on first use (`registry`, `start_http`): prometheus_client is an optional
        # package that a server without a metrics endpoint never imports.
        self._registry: object | None = None

        sinks: list[_GatedSink] = []
        try:
            if self.config.tensorboard_dir is not None:
                tb = TensorBoardSink(
                    self.config.tensorboard_dir, self.config.tensorboard_flush_secs
                )
                sinks.append(_GatedSink(tb, "tensorboard", self.config.tensorboard_gate))
            if self.config.jsonl_path is not None:
                jsonl = JsonlSink(self.config.jsonl_path)
                sinks.append(_GatedSink(jsonl, "jsonl", self.config.jsonl_gate))
        except BaseException:
            for s in sinks:
                s.sink.close()
            raise
        self._push: tuple[_GatedSink, ...] = tuple(sinks)

    # ------------------------------------------------------------------ properties

    @property
    def registry(self) -> object | None:
        """The tracker's own prometheus_client `CollectorRegistry` (None without Prometheus).

        Made on first use; `MissingExtraError` when prometheus_client is not installed.
        Other server code may register its own collectors (e.g. RPC latency histograms) here.
        """
        if not self.config.prometheus:
            return None
        with self._lock:
            if self._registry is None:
                prometheus = require("prometheus_client", "a Prometheus metrics endpoint")
                registry = prometheus.CollectorRegistry(auto_describe=False)
                registry.register(PrometheusCollector(self._prometheus_rows))
                self._registry = registry
            return self._registry

    @property
    def current_step(self) -> int:
        """The step of the latest ``log``/``log_many`` call (0 before any)."""
        return self._step

    # ------------------------------------------------------------------ emitting values

    def log(self, tag: str, value: float, step: int, **labels: object) -> None:
        """Record a scalar at a global step."""
        self.log_many({tag: value}, step, **labels)

    def log_many(self, values: Mapping[str, float], step: int, **labels: object) -> None:
        """Record several scalars at one global step; the labels apply to every one of them."""
        step = operator.index(step)
        now = self._clock()
        due: list[_GatedSink] | None = None
        with self._lock:
            self._seq = seq = self._seq + 1
            self._step = step
            scalars = self._scalars
            if labels:
                lkey = _label_key(labels)
                for tag, value in values.items():
                    key = (tag, lkey)
                    entry = (float(value), step, seq)
                    if key not in scalars:
                        self._register(key, tag, lkey, _SCALAR)
                    scalars[key] = entry
            else:
                for tag, value in values.items():
                    entry = (float(value), step, seq)
                    if tag not in scalars:
                        self._register(tag, tag, (), _SCALAR)
                    scalars[tag] = entry
            for s in self._push:
                d = step - s.last_step
                if (d >= s.every_n or d < 0) and now - s.last_time >= s.min_interval:
                    s.last_time = now
                    s.last_step = step
                    if due is None:
                        due = [s]
                    else:
                        due.append(s)
        if due is not None:
            self._write(due)

    def inc(self, tag: str, amount: float = 1.0, **labels: object) -> None:
        """Add ``amount`` (>= 0) to a counter."""
        amount = float(amount)
        if not amount >= 0:
            raise ValueError(f"counter {tag!r}: amount must be >= 0, got {amount!r}")
        lkey = _label_key(labels) if labels else ()
        key: object = (tag, lkey) if labels else tag
        with self._lock:
            self._seq = seq = self._seq + 1
            old = self._counters.get(key)
            if old is None:
                self._register(key, tag, lkey, _COUNTER)
                self._counters[key] = (amount, seq)
            else:
                self._counters[key] = (old[0] + amount, seq)

    def set(self, tag: str, value: float, **labels: object) -> None:
        """Set a gauge to ``value``."""
        value = float(value)
        lkey = _label_key(labels) if labels else ()
        key: object = (tag, lkey) if labels else tag
        with self._lock:
            self._seq = seq = self._seq + 1
            if key not in self._gauges:
                self._register(key, tag, lkey, _GAUGE)
            self._gauges[key] = (value, seq)

    def forget(self, **labels: object) -> int:
        """Drop every series that carries these label values (a dropped session's, a
        forgotten worker's); returns how many went."""
        want = set(_label_key(labels))
        with self._lock:
            doomed = [
                key
                for key, series in self._series.items()
                if want <= set(zip(series.label_names, series.label_values, strict=True))
            ]
            for key in doomed:
                series = self._series.pop(key)
                self._counters.pop(key, None)
                self._gauges.pop(key, None)
                self._scalars.pop(key, None)
                self._folded_owner.pop(series.folded, None)
        return len(doomed)

    # ------------------------------------------------------------------ reading values

    def snapshot(self) -> dict[str, float]:
        """Current value of every counter, gauge and last scalar, keyed by folded tag."""
        with self._lock:
            series = self._series
            out = {series[k].folded: v[0] for k, v in self._counters.items()}
            out.update((series[k].folded, v[0]) for k, v in self._gauges.items())
            out.update((series[k].folded, v[0]) for k, v in self._scalars.items())
        return out

    # ------------------------------------------------------------------ lifecycle

    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serve the Prometheus registry over HTTP; returns the bound ``(host, port)``.

        Port 0 picks a free port. One endpoint per tracker; `close` stops it.
        """
        if not self.config.prometheus:
            raise RuntimeError("Prometheus is disabled in this MetricsConfig")
        if self._closed:
            raise RuntimeError("MetricsTracker is closed")
        if self._endpoint is not None:
            raise RuntimeError(
                f"metrics endpoint already serving on {self._endpoint.host}:{self._endpoint.port}"
            )
        self._endpoint = PrometheusEndpoint(self.registry, host, port)
        return self._endpoint.host, self._endpoint.port

    def flush(self) -> None:
        """Write every pending change to the pushed sinks, ignoring the gates, and flush them."""
        now = self._clock()
        with self._lock:
            for s in self._push:
                s.last_time = now
                s.last_step = self._step
        self._write(list(self._push))
        for s in self._push:
            with s.io_lock:
                if not s.closed:
                    s.sink.flush()

    def close(self) -> None:
        """Flush and close the sinks and stop the HTTP endpoint. Idempotent.

        Values can still be emitted afterwards; they only reach `snapshot` and the registry.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            push, self._push = self._push, ()
            for s in push:
                with s.io_lock:
                    s.closed = True
                    try:
                        s.sink.close()
                    except Exception:
                        logger.exception("closing the %s metrics sink failed", s.name)
            if self._endpoint is not None:
                self._endpoint.close()
                self._endpoint = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _register(
        self, key: object, tag: str, lkey: tuple[tuple[str, str], ...], kind: str
    ) -> None:
        """First sight of a series: check kind, label names and name collisions (lock held)."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"metric tag must be a non-empty str, got {tag!r}")
        label_names = tuple(k for k, _ in lkey)
        family = self._families.get(tag)
        if family is None:
            for name in label_names:
                if not _LABEL_NAME.match(name) or name.startswith("__"):
                    raise ValueError(f"metric {tag!r}: invalid label name {name!r}")
            prom = prometheus_name(tag, counter=kind == _COUNTER, namespace=self.config.namespace)
            other = self._prom_owner.get(prom)
            if other is not None:
                raise ValueError(
                    f"metric tags {tag!r} and {other!r} map to the same Prometheus name {prom!r}"
                )
            family = _Family(kind, label_names, prom)
            self._families[tag] = family
            self._prom_owner[prom] = tag
            if kind == _COUNTER:  # the family is exposed under the name without _total too
                self._prom_owner[prom[: -len("_total")]] = tag
        elif family.kind != kind:
            raise ValueError(f"metric {tag!r} is a {family.kind}, not a {kind}")
        elif family.label_names != label_names:
            raise ValueError(
                f"metric {tag!r} has labels {list(family.label_names)}, got {list(label_names)}"
            )
        folded = fold_tag(tag, dict(lkey))
        other_key = self._folded_owner.get(folded)
        if other_key is not None and other_key != key:
            raise ValueError(f"metric series {key!r} and {other_key!r} both fold to {folded!r}")
        self._folded_owner[folded] = key
        self._series[key] = _Series(kind, tag, label_names, tuple(v for _, v in lkey), folded)

    def _collect(self, since: int) -> list[Row]:
        """Rows changed after sequence number ``since`` (lock held)."""
        series = self._series
        rows: list[Row] = [
            (series[k].folded, v, step)
            for k, (v, step, seq) in self._scalars.items()
            if seq > since
        ]
        step = self._step
        rows.extend(
            (series[k].folded, v, step) for k, (v, seq) in self._counters.items() if seq > since
        )
        rows.extend(
            (series[k].folded, v, step) for k, (v, seq) in self._gauges.items() if seq > since
        )
        return rows

    def _write(self, sinks: list[_GatedSink]) -> None:
        for s in sinks:
            with s.io_lock:  # batches are collected and written in order, per sink
                if s.closed:
                    continue
                with self._lock:
                    rows = self._collect(s.written_seq)
                    s.written_seq = self._seq
                if not rows:
                    continue
                try:
                    s.sink.write(rows, time.time())
                except Exception:
                    logger.exception(
                        "writing %d values to the %s metrics sink failed", len(rows), s.name
                    )

    def _prometheus_rows(self) -> list[PromRow]:
        with self._lock:
            series = self._series
            items = [(series[k], v[0]) for k, v in self._counters.items()]
            items.extend((series[k], v[0]) for k, v in self._gauges.items())
            items.extend((series[k], v[0]) for k, v in self._scalars.items())
            names = {tag: fam.prom_name for tag, fam in self._families.items()}
        return [
            (
                _COUNTER if s.kind == _COUNTER else _GAUGE,
                names[s.tag],
                f"Rollout Recorder {s.kind} {s.tag}",
                s.label_names,
                s.label_values,
                value,
            )
            for s, value in items
        ]


class NullMetrics:
    """A tracker that keeps nothing: `serve --no-metrics`, the baseline for metrics cost."""

    registry = None
    current_step = 0

    def log(self, tag: str, value: float, step: int, **labels: object) -> None:
        pass

    def log_many(self, values: Mapping[str, float], step: int, **labels: object) -> None:
        pass

    def inc(self, tag: str, amount: float = 1.0, **labels: object) -> None:
        pass

    def set(self, tag: str, value: float, **labels: object) -> None:
        pass

    def snapshot(self) -> dict[str, float]:
        return {}

    def forget(self, **labels: object) -> int:
        return 0

    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        raise ValueError("metrics: --metrics-listen needs metrics; the server runs --no-metrics")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
