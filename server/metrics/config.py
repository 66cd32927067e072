"""What a `MetricsTracker` is configured with: which sinks it feeds, their write gates, and
the episode histograms' buckets. Frozen dataclasses, checked when made."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .names import LABEL_NAME


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
        if self.namespace and not LABEL_NAME.match(self.namespace):
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
