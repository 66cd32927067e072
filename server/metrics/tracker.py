"""The server's one metrics object: counters, gauges, stepped scalars and episode
distributions, fanned out to sinks. Every metric the server emits is in `catalog` (kind, help
text, labels), and `docs/metrics.md` is generated from it. The tracker holds the values and
the lock; the series table is in `model`, the write gates in `gating`, the configuration in
`config`, the sink I/O in `sinks` and the naming in `names`.

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
import threading
import time
from collections.abc import Callable, Mapping
from typing import Self

import numpy as np

from ..extras import require
from ..periodic import Periodic
from .config import MetricsConfig, WriteGate
from .gating import GatedSink, open_push_sinks
from .model import (
    COUNTER,
    EPISODE_TAGS,
    EPISODES,
    GAUGE,
    LENGTH_TAG,
    RETURN_TAG,
    SCALAR,
    Episodes,
    Series,
    SeriesTable,
    histogram_rows,
    summary_values,
)
from .names import fold_tag, label_key, prometheus_name
from .null import NullMetrics
from .sinks import PrometheusCollector, PrometheusEndpoint, PromRow, Row

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

# Pending episodes of one series folded at once, at the latest (bounds the queue when
# nothing reads the tracker).
_FOLD_AT = 1 << 16


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
        self._table = SeriesTable(self.config.namespace)
        self._series = self._table.series  # the same dict, read on every write
        self._episodes: dict[object, Episodes] = {}
        self._unfolded: set[object] = set()  # keys of series with pending episodes
        self._return_bounds = np.asarray(self.config.return_buckets, dtype=np.float64)
        self._length_bounds = np.asarray(self.config.length_buckets, dtype=np.float64)
        self._closed = False
        self._endpoint: PrometheusEndpoint | None = None

        # Made on first use (`registry`, `start_http`): prometheus_client is an optional
        # package that a server without a metrics endpoint never imports.
        self._registry: object | None = None
        # Called before each Prometheus scrape: levels that are measured, not counted.
        self.before_scrape: list[Callable[[], object]] = []

        self._push: tuple[GatedSink, ...] = open_push_sinks(self.config)
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
                registry.register(PrometheusCollector(self._prometheus_rows, self.before_scrape))
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
        due: list[GatedSink] | None = None
        with self._lock:
            self._seq = seq = self._seq + 1
            self._step = step
            self._last_value = now
            if "session" in labels:
                self._session_step[str(labels["session"])] = step
            scalars = self._scalars
            if labels:
                lkey = label_key(labels)
                for tag, value in values.items():
                    key = (tag, lkey)
                    entry = (float(value), step, seq)
                    if key not in scalars:
                        self._table.register(key, tag, lkey, SCALAR)
                    scalars[key] = entry
            else:
                for tag, value in values.items():
                    entry = (float(value), step, seq)
                    if tag not in scalars:
                        self._table.register(tag, tag, (), SCALAR)
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
        lkey = label_key(labels) if labels else ()
        key: object = (EPISODES, lkey)
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
                self._table.register(key, RETURN_TAG, lkey, EPISODES)
                folded = tuple(fold_tag(t, dict(lkey)) for t in EPISODE_TAGS)
                bins = (self._return_bounds.size + 1, self._length_bounds.size + 1)
                ep = self._episodes[key] = Episodes(*bins, folded)
            ep.pending.append((returns, lengths, step))
            ep.pending_n += n
            self._unfolded.add(key)
            if ep.pending_n >= _FOLD_AT:
                self._fold(key, ep)
            if self._push:
                due = self._due(step, now)
        if due:
            self._write(due)

    def observe_feed(
        self,
        counters: Mapping[str, float],
        episodes: list[tuple[np.ndarray, np.ndarray, int]],
        scalars: Mapping[str, float],
        step: int,
        **labels: object,
    ) -> None:
        """What the episode feeder reports per batch of chunks, under one lock: ``inc`` of
        each counter, ``observe_episodes`` of each (returns, lengths, step), ``log_many`` of
        the scalars at ``step`` (the batch's last); the gates are checked once, at ``step``.
        A chunk's calls cost the feeder one lock, clock read and label key, not three."""
        step = operator.index(step)
        amounts = [(tag, float(a)) for tag, a in counters.items()]
        for tag, amount in amounts:
            if not amount >= 0:
                raise ValueError(f"counter {tag!r}: amount must be >= 0, got {amount!r}")
        batches = []
        for returns, lengths, at in episodes:
            returns = np.array(returns, dtype=np.float64).reshape(-1)
            lengths = np.array(lengths, dtype=np.float64).reshape(-1)
            if returns.size != lengths.size:
                raise ValueError(
                    f"lengths: expected {returns.size} values (one per return), got {lengths.size}"
                )
            if returns.size:
                batches.append((returns, lengths, operator.index(at)))
        lkey = label_key(labels) if labels else ()
        now = self._clock()
        due = None
        with self._lock:
            for tag, amount in amounts:
                key: object = (tag, lkey) if labels else tag
                self._seq = seq = self._seq + 1
                old = self._counters.get(key)
                if old is None:
                    self._table.register(key, tag, lkey, COUNTER)
                    self._counters[key] = (amount, seq)
                else:
                    self._counters[key] = (old[0] + amount, seq)
            if batches:
                ekey: object = (EPISODES, lkey)
                ep = self._episodes.get(ekey)
                if ep is None:
                    self._table.register(ekey, RETURN_TAG, lkey, EPISODES)
                    folded = tuple(fold_tag(t, dict(lkey)) for t in EPISODE_TAGS)
                    bins = (self._return_bounds.size + 1, self._length_bounds.size + 1)
                    ep = self._episodes[ekey] = Episodes(*bins, folded)
                ep.pending.extend(batches)
                ep.pending_n += sum(b[0].size for b in batches)
                self._unfolded.add(ekey)
                if ep.pending_n >= _FOLD_AT:
                    self._fold(ekey, ep)
            self._seq = seq = self._seq + 1
            for tag, value in scalars.items():
                key = (tag, lkey) if labels else tag
                if key not in self._scalars:
                    self._table.register(key, tag, lkey, SCALAR)
                self._scalars[key] = (float(value), step, seq)
            self._step = step
            self._last_value = now
            if "session" in labels:
                self._session_step[str(labels["session"])] = step
            if self._push:
                due = self._due(step, now)
        if due:
            self._write(due)

    def _fold(self, key: object, ep: Episodes) -> None:
        """Add a series' pending episodes to its totals and histograms and to every pushed
        sink's summary window (lock held)."""
        self._unfolded.discard(key)
        stats = ep.fold(self._return_bounds, self._length_bounds)
        if stats is not None:
            for s in self._push:
                s.add_episodes(key, stats)

    def _fold_all(self) -> None:
        """Fold every series' pending episodes (lock held): before anything reads them."""
        for key in list(self._unfolded):
            ep = self._episodes.get(key)
            if ep is None:
                self._unfolded.discard(key)
            else:
                self._fold(key, ep)

    def _due(self, step: int, now: float) -> list[GatedSink]:
        """The pushed sinks whose gates open for a log at ``step`` (lock held)."""
        return [s for s in self._push if s.opens(step, now)]

    def inc(self, tag: str, amount: float = 1.0, **labels: object) -> None:
        """Add ``amount`` (>= 0) to a counter."""
        # `inc_many` for one tag, without its dict and lists: called for every chunk.
        amount = float(amount)
        if not amount >= 0:
            raise ValueError(f"counter {tag!r}: amount must be >= 0, got {amount!r}")
        lkey = label_key(labels) if labels else ()
        key: object = (tag, lkey) if labels else tag
        counters = self._counters
        with self._lock:
            self._seq = seq = self._seq + 1
            old = counters.get(key)
            if old is None:
                self._table.register(key, tag, lkey, COUNTER)
                counters[key] = (amount, seq)
            else:
                counters[key] = (old[0] + amount, seq)

    def inc_many(self, amounts: Mapping[str, float], **labels: object) -> None:
        """``inc`` for several counters with the same labels, under one lock."""
        values = [(tag, float(a)) for tag, a in amounts.items()]
        for tag, amount in values:
            if not amount >= 0:
                raise ValueError(f"counter {tag!r}: amount must be >= 0, got {amount!r}")
        lkey = label_key(labels) if labels else ()
        counters = self._counters
        with self._lock:
            for tag, amount in values:
                key: object = (tag, lkey) if labels else tag
                self._seq = seq = self._seq + 1
                old = counters.get(key)
                if old is None:
                    self._table.register(key, tag, lkey, COUNTER)
                    counters[key] = (amount, seq)
                else:
                    counters[key] = (old[0] + amount, seq)

    def set(self, tag: str, value: float, **labels: object) -> None:
        """Set a gauge to ``value``."""
        value = float(value)
        lkey = label_key(labels) if labels else ()
        key: object = (tag, lkey) if labels else tag
        with self._lock:
            self._seq = seq = self._seq + 1
            if key not in self._gauges:
                self._table.register(key, tag, lkey, GAUGE)
            self._gauges[key] = (value, seq)

    def forget(self, **labels: object) -> int:
        """Drop every series that carries these label values (a dropped session's, a
        forgotten worker's); returns how many went."""
        want = set(label_key(labels))
        with self._lock:
            doomed = [
                key
                for key, series in self._series.items()
                if want <= set(zip(series.label_names, series.label_values, strict=True))
            ]
            for key in doomed:
                self._table.drop(key)
                self._counters.pop(key, None)
                self._gauges.pop(key, None)
                self._scalars.pop(key, None)
                self._episodes.pop(key, None)
                self._unfolded.discard(key)
                if "session" in labels:
                    self._session_step.pop(str(labels["session"]), None)
                for s in self._push:
                    s.episodes.pop(key, None)
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
                    out.update(zip(ep.folded, summary_values(ep.totals()), strict=True))
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
                s.mark(self._step, now)
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
                pending = self._seq > s.written_seq or bool(self._unfolded)
                if s.opens_idle(now, quiet, self.config.idle_flush_s, pending):
                    s.mark(self._step, now)
                    due.append(s)
        if due:
            self._write(due)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _collect(self, sink: GatedSink) -> list[Row]:
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
                for tag, folded, v in zip(EPISODE_TAGS, ep.folded, summary_values(acc)):
                    rows.append((folded, v, at, tag, labels))
            sink.episodes = {}
        return rows

    def _write(self, sinks: list[GatedSink]) -> None:
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
            items: list[tuple[Series, object]] = [
                (series[k], v[0]) for k, v in self._counters.items()
            ]
            items.extend((series[k], v[0]) for k, v in self._gauges.items())
            items.extend((series[k], v[0]) for k, v in self._scalars.items())
            episodes = [
                (series[k], ep.ret_counts.copy(), ep.ret_sum, ep.len_counts.copy(), ep.len_sum)
                for k, ep in self._episodes.items()
            ]
            families = dict(self._table.families)
        rows: list[PromRow] = []
        for s, value in items:
            fam = families[s.tag]
            rows.append(
                (fam.exported, fam.prom_name, fam.help, s.label_names, s.label_values, value)
            )
        for s, r_counts, r_sum, l_counts, l_sum in episodes:
            histograms = (
                (RETURN_TAG, self._return_bounds, r_counts, r_sum),
                (LENGTH_TAG, self._length_bounds, l_counts, l_sum),
            )
            rows.extend(histogram_rows(s, histograms, self.config.namespace))
        return rows
