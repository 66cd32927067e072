"""The dashboard's recent episodes: the last `KEEP` finished episodes of each session (return
and length), for the recent mean return and for histograms whose buckets follow the range
the episodes actually span.

`EpisodeWindow` wraps the server's metrics object (a `MetricsTracker` or `NullMetrics`):
every call goes through to it unchanged, and the episodes that `observe_episodes` and
`observe_feed` report are also kept here. It costs the ingest path one array copy per chunk
that finishes episodes.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

import numpy as np

KEEP = 1000
"""Episodes kept per session (the histograms' window)."""
RECENT = 100
"""Episodes the recent mean is taken over."""
BUCKETS = 20
"""About how many buckets a histogram has."""


class EpisodeWindow:
    """The metrics object, with the last `keep` episodes of each session kept beside it."""

    def __init__(self, metrics: Any, keep: int = KEEP) -> None:
        self._metrics = metrics
        self._keep = keep
        self._lock = threading.Lock()
        # session -> chunks of (returns, lengths), oldest first, and their episode count
        self._rings: dict[str, deque[tuple[np.ndarray, np.ndarray]]] = {}
        self._sizes: dict[str, int] = {}
        # The calls the ingest path makes per chunk, bound once rather than looked up per call.
        self.inc = metrics.inc
        self.inc_many = metrics.inc_many
        self.set = metrics.set

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)

    def observe_episodes(
        self, returns: np.ndarray, lengths: np.ndarray, step: int, **labels: object
    ) -> None:
        self._metrics.observe_episodes(returns, lengths, step, **labels)
        self._keep_episodes(returns, lengths, labels)

    def observe_feed(
        self,
        counters: Any,
        episodes: list[tuple[np.ndarray, np.ndarray, int]],
        scalars: Any,
        step: int,
        **labels: object,
    ) -> None:
        self._metrics.observe_feed(counters, episodes, scalars, step, **labels)
        for returns, lengths, _ in episodes:
            self._keep_episodes(returns, lengths, labels)

    def _keep_episodes(self, returns: Any, lengths: Any, labels: dict[str, object]) -> None:
        session = labels.get("session")
        if session is None:
            return
        # Copies: the caller may reuse its arrays once this returns.
        kept_returns = np.array(returns, dtype=np.float64).reshape(-1)[-self._keep :]
        kept_lengths = np.array(lengths, dtype=np.float64).reshape(-1)[-self._keep :]
        if kept_returns.size == 0 or kept_returns.size != kept_lengths.size:
            return  # the tracker has refused a mismatch already
        name = str(session)
        with self._lock:
            ring = self._rings.setdefault(name, deque())
            ring.append((kept_returns, kept_lengths))
            size = self._sizes.get(name, 0) + kept_returns.size
            while size - ring[0][0].size >= self._keep:
                size -= ring.popleft()[0].size
            self._sizes[name] = size

    def forget(self, **labels: object) -> int:
        if set(labels) == {"session"}:  # the session was dropped: its episodes go too
            with self._lock:
                self._rings.pop(str(labels["session"]), None)
                self._sizes.pop(str(labels["session"]), None)
        return self._metrics.forget(**labels)

    def recent(self, session: str) -> tuple[np.ndarray, np.ndarray]:
        """(returns, lengths) of the session's last `keep` episodes, oldest first."""
        with self._lock:
            chunks = list(self._rings.get(session, ()))
        if not chunks:
            return np.zeros(0), np.zeros(0)
        returns = np.concatenate([r for r, _ in chunks])[-self._keep :]
        lengths = np.concatenate([n for _, n in chunks])[-self._keep :]
        return returns, lengths


def _nice_width(span: float, buckets: int) -> float:
    """The smallest of 1, 2 or 5 times a power of ten at least span / buckets."""
    raw = span / buckets
    power = 10.0 ** math.floor(math.log10(raw))
    for step in (1.0, 2.0, 5.0, 10.0):
        if step * power >= raw:
            return step * power
    return 10.0 * power


def histogram(
    values: np.ndarray, *, integer: bool = False, buckets: int = BUCKETS
) -> dict[str, Any] | None:
    """Counts over buckets that span the finite values' range: equal widths of 1, 2 or 5 times
    a power of ten (whole numbers with ``integer``), about ``buckets`` of them. Bucket i holds
    ``edges[i] <= v < edges[i + 1]``. None without values; non-finite ones are counted apart."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return None
    finite = values[np.isfinite(values)]
    out: dict[str, Any] = {
        "count": int(values.size),
        "nonfinite": int(values.size - finite.size),
        "sum": float(finite.sum()),
        "edges": [],
        "counts": [],
    }
    if finite.size == 0:
        return out
    lo, hi = float(finite.min()), float(finite.max())
    width = _nice_width(hi - lo, buckets) if hi > lo else 1.0
    if integer:
        width = max(1.0, math.ceil(width))
    start = math.floor(lo / width) * width
    n = int(math.floor((hi - start) / width)) + 1  # the top value falls in the last bucket
    edges = start + width * np.arange(n + 1)
    while edges[-1] <= hi:  # float rounding: the top edge must lie above every value
        n += 1
        edges = start + width * np.arange(n + 1)
    index = np.clip(np.searchsorted(edges, finite, side="right") - 1, 0, n - 1)
    out["edges"] = [float(e) for e in edges]
    out["counts"] = np.bincount(index, minlength=n).tolist()
    return out
