"""The server's metrics: one tracker of counters, gauges and stepped scalars, and its sinks
(Prometheus, TensorBoard, JSON lines)."""

from .tracker import (
    MetricsConfig,
    MetricsTracker,
    NullMetrics,
    WriteGate,
    fold_tag,
    prometheus_name,
)

__all__ = [
    "MetricsConfig",
    "MetricsTracker",
    "NullMetrics",
    "WriteGate",
    "fold_tag",
    "prometheus_name",
]
