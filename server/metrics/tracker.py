"""The server's one metrics object: counters, gauges, stepped scalars and episode
distributions, fanned out to sinks. Every metric the server emits is in `catalog` (kind, help
text, labels), and `docs/metrics.md` is generated from it.

Four kinds of series, each named by a TensorBoard-style tag (``"Recorder/chunks"``,
``"Trajectories/episodes_captured"``, ``"Episode/return"``):

- **scalar** — ``log(tag, value, step)`` / ``log_many(values, step)``: a value at a global step
  (a scalar the catalog calls a counter, a monotone total, is exported to Prometheus as one);
- **counter** — ``inc(tag, amount)``: monotonically increasing total;
- **gauge** — ``set(tag, value)``: a level that goes up and down;
- **episodes** — ``observe_episodes(returns, lengths, step)``: finished episodes. Prometheus
  gets the histograms ``<ns>_episode_return`` and ``<ns>_episode_length`` (buckets from
  `MetricsConfig`); each pushed sink gets, at every write, a summary of *every* episode since
  its previous write: ``Episode/count``, ``Episode/return_{mean,min,max}`` and
  ``Episode/length_{mean,min,max}``, at the step of the latest observation.

A tag has exactly one kind and one set of label names for its lifetime (``ValueError``
otherwise). Keyword labels split a tag into series, e.g. ``inc("Recorder/chunks", 1,
session="default")``. Label values are converted with ``str``. Labels are:

- Prometheus labels on the exported metric (``rollout_recorder_chunks_total{session="default"}``);
- TensorBoard: the ``session`` label picks the run directory (``<dir>/<session>/``), so every
  session has the same tags; other labels are folded into the tag;
- folded into the tag in JSON lines and `snapshot`, sorted by label name:
  ``"Recorder/chunks/session=default"``, ``"X/y/session=a/worker=3"``.

The names ``tag``, ``value``, ``values``, ``amount`` and ``step`` cannot be label names.

Sinks, each optional (see `MetricsConfig`):

- **Prometheus**: always the latest value, rendered at scrape time from the tracker's own
  `CollectorRegistry` (never the global one). Names: ``<namespace>_<snake_case(tag)>`` with a
  leading ``Recorder/`` dropped; counters end in ``_total`` (``Recorder/raw_bytes`` →
  ``rollout_recorder_raw_bytes_total``), gauges and scalars do not
  (``Trajectories/archive_cells`` → ``rollout_recorder_trajectories_archive_cells``). Put
  units in tags (``_bytes``, ``_seconds``). Help text comes from the catalog. Served by
  `MetricsTracker.start_http`.
- **TensorBoard** event files and **JSON lines**: pushed, behind a per-sink `WriteGate`.

Write gates. Every ``log``/``log_many`` call checks each pushed sink's gate in O(1). When a gate
is closed the call only updates the in-memory values (a few dict stores). When it opens, the
sink receives every series that changed since its previous write, each with its *latest*
value (values in between are coalesced, never queued): scalars at the step they were logged
at, counters and gauges at the current step (the step of the latest ``log``/``log_many``; for
a series with a ``session`` label, that session's latest step).
``inc``/``set`` never open a gate (they have no step): their changes ride along with the next
gated write, or with `flush`. `flush` writes everything pending regardless of the gates.
A timer thread writes what a closed gate held back once the gate's interval has passed, so an
idle session's final numbers reach every sink within one interval (``min_interval_s``, or
`MetricsConfig.idle_flush_s` when a gate has none).

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

import numpy as np

from ..extras import require
from ..periodic import Periodic
from . import catalog
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
    "EPISODE_TAGS",
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
_EPISODES = "episodes"
_HISTOGRAM = "histogram"

# The rows of an episode summary, in the order they are written.
EPISODE_TAGS = (
    "Episode/count",
    "Episode/return_mean",
    "Episode/return_min",
    "Episode/return_max",
    "Episode/length_mean",
    "Episode/length_min",
    "Episode/length_max",
)
_RETURN_TAG = "Episode/return"
_LENGTH_TAG = "Episode/length"
_HISTOGRAMS = (_RETURN_TAG, _LENGTH_TAG)

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]+")
_UNDERSCORES = re.compile(r"__+")

_NEVER = -(2**62)
# Pending episodes of one series folded at once, at the latest (bounds the queue when
# nothing reads the tracker).
_FOLD_AT = 1 << 16


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

    namespace: str = "rollout_recorder"
    """Prefix of every Prometheus metric name (``rollout_recorder_chunks_total``)."""

    return_buckets: tuple[float, ...] = (-100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0, 1000.0)
    """Upper bounds (``le``) of the episode-return histogram's buckets, increasing; +Inf is
    added."""

    length_buckets: tuple[float, ...] = (1.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)
    """Upper bounds (``le``) of the episode-length histogram's buckets, increasing; +Inf is
    added."""

    idle_flush_s: float = 1.0
    """Interval of the idle flush for a gate without a time condition (``min_interval_s``
    0): what such a gate held back is written this long after its previous write."""

    tensorboard_dir: str | os.PathLike[str] | None = None
    """Directory for TensorBoard event files; None disables the sink (tensorboardX needed)."""

    tensorboard_gate: WriteGate = field(default_factory=WriteGate)
    """Write gate of the TensorBoard sink."""

    jsonl_path: str | os.PathLike[str] | None = None
    """File to append JSON lines to; None disables the sink."""

    jsonl_gate: WriteGate = field(default_factory=WriteGate)
    """Write gate of the JSON lines sink."""

    def __post_init__(self) -> None:
        if self.namespace and not _LABEL_NAME.match(self.namespace):
            raise ValueError(f"namespace must match [a-zA-Z_][a-zA-Z0-9_]*, got {self.namespace!r}")
        for name in ("return_buckets", "length_buckets"):
            bounds = tuple(float(b) for b in getattr(self, name))
            if not bounds or any(
                not np.isfinite(b) or (i and b <= bounds[i - 1]) for i, b in enumerate(bounds)
            ):
                raise ValueError(
                    f"{name}: expected finite, strictly increasing bounds, got {bounds!r}"
                )
            object.__setattr__(self, name, bounds)
        if not self.idle_flush_s > 0:
            raise ValueError(f"idle_flush_s must be > 0, got {self.idle_flush_s!r}")


def prometheus_name(tag: str, *, counter: bool, namespace: str = "rollout_recorder") -> str:
    """The Prometheus name of a tag: ``Recorder/rawBytes`` → ``rollout_recorder_raw_bytes_total``
    (a leading ``Recorder/`` is dropped: the namespace says it)."""
    if tag.startswith("Recorder/"):
        tag = tag[len("Recorder/") :]
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

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        return tuple(zip(self.label_names, self.label_values, strict=True))


@dataclass(frozen=True)
class _Family:
    kind: str
    label_names: tuple[str, ...]
    prom_name: str
    exported: str
    """The Prometheus type: counter (counters, and scalars the catalog calls counters) or
    gauge."""
    help: str


class _Episodes:
    """One episode series: histogram counts and totals (Prometheus, `snapshot`), and the
    episodes observed since they were last folded in (`pending`)."""

    __slots__ = (
        "count",
        "folded",
        "len_counts",
        "len_max",
        "len_min",
        "len_sum",
        "pending",
        "pending_n",
        "ret_counts",
        "ret_max",
        "ret_min",
        "ret_sum",
    )

    def __init__(self, returns: int, lengths: int, folded: tuple[str, ...]) -> None:
        self.ret_counts = np.zeros(returns, dtype=np.int64)
        self.len_counts = np.zeros(lengths, dtype=np.int64)
        self.count = 0
        self.ret_sum = self.len_sum = 0.0
        self.ret_min = self.len_min = float("inf")
        self.ret_max = self.len_max = float("-inf")
        self.folded = folded  # fold_tag of each of EPISODE_TAGS
        self.pending: list[tuple[np.ndarray, np.ndarray, int]] = []  # returns, lengths, step
        self.pending_n = 0


def _summary_values(acc: list[float]) -> tuple[float, ...]:
    """A window [count, return sum, min, max, length sum, min, max, step] as EPISODE_TAGS."""
    n = acc[0]
    return (n, acc[1] / n, acc[2], acc[3], acc[4] / n, acc[5], acc[6])


class _GatedSink:
    """A pushed sink with its gate state; gate fields are read and written under the tracker lock."""

    __slots__ = (
        "closed",
        "episodes",
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
        # Episode series key -> [count, return sum, min, max, length sum, min, max, step] of
        # the episodes observed since this sink's previous write.
        self.episodes: dict[object, list[float]] = {}
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
            clock: Monotonic seconds used by the write gates (injectable for tests). The idle
                flush runs on a timer thread only with the default clock; with another one,
                call `flush_idle` instead.
        """
        self.config = config if config is not None else MetricsConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._step = 0
        self._last_value = float("-inf")  # clock of the latest log/observe_episodes
        # Session label -> the step of its latest log/observe_episodes: a session's counters
        # and gauges are written at its own step (sessions' steps are unrelated).
        self._session_step: dict[str, int] = {}
        # key: the tag (no labels) or (tag, ((label, value), ...)).
        self._scalars: dict[object, tuple[float, int, int]] = {}  # value, step, seq
        self._counters: dict[object, tuple[float, int]] = {}  # value, seq
        self._gauges: dict[object, tuple[float, int]] = {}  # value, seq
        self._series: dict[object, _Series] = {}
        self._episodes: dict[object, _Episodes] = {}
        self._unfolded: set[object] = set()  # keys of series with pending episodes
        self._return_bounds = np.asarray(self.config.return_buckets, dtype=np.float64)
        self._length_bounds = np.asarray(self.config.length_buckets, dtype=np.float64)
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
                tb = TensorBoardSink(self.config.tensorboard_dir)
                sinks.append(_GatedSink(tb, "tensorboard", self.config.tensorboard_gate))
            if self.config.jsonl_path is not None:
                jsonl = JsonlSink(self.config.jsonl_path)
                sinks.append(_GatedSink(jsonl, "jsonl", self.config.jsonl_gate))
        except BaseException:
            for s in sinks:
                s.sink.close()
            raise
        self._push: tuple[_GatedSink, ...] = tuple(sinks)
        self._timer: Periodic | None = None
        if self._push and clock is time.monotonic:
            intervals = [s.min_interval or self.config.idle_flush_s for s in self._push]
            tick = max(0.01, min(0.05, min(intervals) / 10))
            self._timer = Periodic(tick, self.flush_idle, "metrics idle flush")

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
            self._last_value = now
            if "session" in labels:
                self._session_step[str(labels["session"])] = step
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
            if self._push:
                due = self._due(step, now)
        if due:
            self._write(due)

    def observe_episodes(
        self, returns: np.ndarray, lengths: np.ndarray, step: int, **labels: object
    ) -> None:
        """Record finished episodes (their returns and lengths) at a global step: the
        histograms, and the summary each pushed sink writes at its next write.

        The episodes are queued and folded into the histograms and summaries in batches,
        before anything reads them: numpy's per-call overhead is paid per batch, not per
        chunk."""
        step = operator.index(step)
        # Copies: the caller's arrays may be reused once this returns.
        returns = np.array(returns, dtype=np.float64).reshape(-1)
        lengths = np.array(lengths, dtype=np.float64).reshape(-1)
        n = returns.size
        if n != lengths.size:
            raise ValueError(f"lengths: expected {n} values (one per return), got {lengths.size}")
        if n == 0:
            return
        lkey = _label_key(labels) if labels else ()
        key: object = (_EPISODES, lkey)
        now = self._clock()
        due = None
        with self._lock:
            self._seq += 1
            self._step = step
            self._last_value = now
            if "session" in labels:
                self._session_step[str(labels["session"])] = step
            ep = self._episodes.get(key)
            if ep is None:
                self._register(key, _RETURN_TAG, lkey, _EPISODES)
                folded = tuple(fold_tag(t, dict(lkey)) for t in EPISODE_TAGS)
                bins = (self._return_bounds.size + 1, self._length_bounds.size + 1)
                ep = self._episodes[key] = _Episodes(*bins, folded)
            ep.pending.append((returns, lengths, step))
            ep.pending_n += n
            self._unfolded.add(key)
            if ep.pending_n >= _FOLD_AT:
                self._fold(key, ep)
            if self._push:
                due = self._due(step, now)
        if due:
            self._write(due)

    def _fold(self, key: object, ep: _Episodes) -> None:
        """Add a series' pending episodes to its totals and histograms and to every pushed
        sink's summary window (lock held)."""
        pending, ep.pending, ep.pending_n = ep.pending, [], 0
        self._unfolded.discard(key)
        if not pending:
            return
        if len(pending) == 1:
            returns, lengths, step = pending[0]
        else:
            returns = np.concatenate([p[0] for p in pending])
            lengths = np.concatenate([p[1] for p in pending])
            step = pending[-1][2]
        n = returns.size
        with np.errstate(all="ignore"):  # NaN and inf returns are data; they propagate
            r_sum, l_sum = float(returns.sum()), float(lengths.sum())
            r_min, r_max = float(returns.min()), float(returns.max())
            l_min, l_max = float(lengths.min()), float(lengths.max())
        ep.ret_counts += np.bincount(
            np.searchsorted(self._return_bounds, returns), minlength=ep.ret_counts.size
        )
        ep.len_counts += np.bincount(
            np.searchsorted(self._length_bounds, lengths), minlength=ep.len_counts.size
        )
        ep.count += n
        ep.ret_sum += r_sum
        ep.len_sum += l_sum
        ep.ret_min = min(ep.ret_min, r_min)
        ep.ret_max = max(ep.ret_max, r_max)
        ep.len_min = min(ep.len_min, l_min)
        ep.len_max = max(ep.len_max, l_max)
        for s in self._push:
            acc = s.episodes.get(key)
            if acc is None:
                s.episodes[key] = [n, r_sum, r_min, r_max, l_sum, l_min, l_max, step]
            else:
                acc[0] += n
                acc[1] += r_sum
                acc[2] = min(acc[2], r_min)
                acc[3] = max(acc[3], r_max)
                acc[4] += l_sum
                acc[5] = min(acc[5], l_min)
                acc[6] = max(acc[6], l_max)
                acc[7] = step

    def _fold_all(self) -> None:
        """Fold every series' pending episodes (lock held): before anything reads them."""
        for key in list(self._unfolded):
            ep = self._episodes.get(key)
            if ep is None:
                self._unfolded.discard(key)
            else:
                self._fold(key, ep)

    def _due(self, step: int, now: float) -> list[_GatedSink]:
        """The pushed sinks whose gates open for a log at ``step`` (lock held)."""
        due = []
        for s in self._push:
            d = step - s.last_step
            if (d >= s.every_n or d < 0) and now - s.last_time >= s.min_interval:
                s.last_time = now
                s.last_step = step
                due.append(s)
        return due

    def inc(self, tag: str, amount: float = 1.0, **labels: object) -> None:
        """Add ``amount`` (>= 0) to a counter."""
        self.inc_many({tag: amount}, **labels)

    def inc_many(self, amounts: Mapping[str, float], **labels: object) -> None:
        """``inc`` for several counters with the same labels, under one lock."""
        values = [(tag, float(a)) for tag, a in amounts.items()]
        for tag, amount in values:
            if not amount >= 0:
                raise ValueError(f"counter {tag!r}: amount must be >= 0, got {amount!r}")
        lkey = _label_key(labels) if labels else ()
        counters = self._counters
        with self._lock:
            for tag, amount in values:
                key: object = (tag, lkey) if labels else tag
                self._seq = seq = self._seq + 1
                old = counters.get(key)
                if old is None:
                    self._register(key, tag, lkey, _COUNTER)
                    counters[key] = (amount, seq)
                else:
                    counters[key] = (old[0] + amount, seq)

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
                self._episodes.pop(key, None)
                self._unfolded.discard(key)
                if "session" in labels:
                    self._session_step.pop(str(labels["session"]), None)
                for s in self._push:
                    s.episodes.pop(key, None)
                self._folded_owner.pop(series.folded, None)
        return len(doomed)

    # ------------------------------------------------------------------ reading values

    def snapshot(self) -> dict[str, float]:
        """Current value of every counter, gauge and last scalar, keyed by folded tag."""
        with self._lock:
            self._fold_all()
            series = self._series
            out = {series[k].folded: v[0] for k, v in self._counters.items()}
            out.update((series[k].folded, v[0]) for k, v in self._gauges.items())
            out.update((series[k].folded, v[0]) for k, v in self._scalars.items())
            for ep in self._episodes.values():
                if ep.count:
                    totals = [ep.count, ep.ret_sum, ep.ret_min, ep.ret_max]
                    totals += [ep.len_sum, ep.len_min, ep.len_max]
                    out.update(zip(ep.folded, _summary_values(totals), strict=True))
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
        if self._timer is not None:
            self._timer.stop(5.0)
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

    def flush_idle(self) -> None:
        """Write what a closed gate held back, whatever the step, once the sink's interval
        (``min_interval_s``, or `MetricsConfig.idle_flush_s` without one) has passed since its
        previous write, or a quarter of it since the latest value arrived (the run went
        quiet). The timer thread calls this: an idle session's last numbers reach every sink
        within a quarter interval of its last chunk, and a busy one is written at the gate's
        pace."""
        now = self._clock()
        due = []
        with self._lock:
            quiet = now - self._last_value
            for s in self._push:
                interval = s.min_interval or self.config.idle_flush_s
                if (self._seq > s.written_seq or s.episodes or self._unfolded) and (
                    now - s.last_time >= interval or quiet >= interval / 4
                ):
                    s.last_time = now
                    s.last_step = self._step
                    due.append(s)
        if due:
            self._write(due)

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
            spec = catalog.spec_of(tag)
            monotone = kind == _COUNTER or (
                kind == _SCALAR and spec is not None and spec.kind == catalog.COUNTER
            )
            ns = self.config.namespace
            prom = prometheus_name(tag, counter=monotone, namespace=ns)
            names = [prom]
            if monotone:  # the family is exposed under the name without _total too
                names.append(prom[: -len("_total")])
            if kind == _EPISODES:
                names = [prometheus_name(t, counter=False, namespace=ns) for t in _HISTOGRAMS]
            for name in names:
                other = self._prom_owner.get(name)
                if other is not None:
                    raise ValueError(
                        f"metric tags {tag!r} and {other!r} map to the same Prometheus name "
                        f"{name!r}"
                    )
            help_text = spec.help if spec is not None else f"{tag} ({kind})."
            exported = _HISTOGRAM if kind == _EPISODES else _COUNTER if monotone else _GAUGE
            family = _Family(kind, label_names, prom, exported, help_text)
            self._families[tag] = family
            for name in names:
                self._prom_owner[name] = tag
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

    def _collect(self, sink: _GatedSink) -> list[Row]:
        """Rows changed since the sink's previous write, and the summary of the episodes
        observed since then (lock held; the sink's episode windows start afresh)."""
        self._fold_all()
        since = sink.written_seq
        series = self._series
        rows: list[Row] = []
        for k, (v, step, seq) in self._scalars.items():
            if seq > since:
                s = series[k]
                rows.append((s.folded, v, step, s.tag, s.labels))
        step = self._step
        session_step = self._session_step
        for values in (self._counters, self._gauges):
            for k, (v, seq) in values.items():
                if seq > since:
                    s = series[k]
                    at = step
                    if session_step and "session" in s.label_names:
                        at = session_step.get(s.label_values[s.label_names.index("session")], step)
                    rows.append((s.folded, v, at, s.tag, s.labels))
        if sink.episodes:
            for k, acc in sink.episodes.items():
                ep = self._episodes.get(k)
                if ep is None:
                    continue
                labels = series[k].labels
                at = int(acc[7])
                for tag, folded, v in zip(EPISODE_TAGS, ep.folded, _summary_values(acc)):
                    rows.append((folded, v, at, tag, labels))
            sink.episodes = {}
        return rows

    def _write(self, sinks: list[_GatedSink]) -> None:
        for s in sinks:
            with s.io_lock:  # batches are collected and written in order, per sink
                if s.closed:
                    continue
                with self._lock:
                    rows = self._collect(s)
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
            self._fold_all()
            series = self._series
            items: list[tuple[_Series, object]] = [
                (series[k], v[0]) for k, v in self._counters.items()
            ]
            items.extend((series[k], v[0]) for k, v in self._gauges.items())
            items.extend((series[k], v[0]) for k, v in self._scalars.items())
            episodes = [
                (series[k], ep.ret_counts.copy(), ep.ret_sum, ep.len_counts.copy(), ep.len_sum)
                for k, ep in self._episodes.items()
            ]
            families = dict(self._families)
        rows: list[PromRow] = []
        for s, value in items:
            fam = families[s.tag]
            rows.append(
                (fam.exported, fam.prom_name, fam.help, s.label_names, s.label_values, value)
            )
        ns = self.config.namespace
        for s, r_counts, r_sum, l_counts, l_sum in episodes:
            for tag, bounds, counts, total in (
                (_RETURN_TAG, self._return_bounds, r_counts, r_sum),
                (_LENGTH_TAG, self._length_bounds, l_counts, l_sum),
            ):
                spec = catalog.spec_of(tag)
                cumulative = np.cumsum(counts).tolist()
                buckets = [*zip(bounds.tolist(), cumulative[:-1]), (float("inf"), cumulative[-1])]
                rows.append(
                    (
                        _HISTOGRAM,
                        prometheus_name(tag, counter=False, namespace=ns),
                        spec.help if spec else tag,
                        s.label_names,
                        s.label_values,
                        (buckets, total),
                    )
                )
        return rows


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

    def inc_many(self, amounts: Mapping[str, float], **labels: object) -> None:
        pass

    def set(self, tag: str, value: float, **labels: object) -> None:
        pass

    def observe_episodes(
        self, returns: np.ndarray, lengths: np.ndarray, step: int, **labels: object
    ) -> None:
        pass

    def flush_idle(self) -> None:
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
