"""The metrics object of a server that keeps none (`serve --no-metrics`): every call the
tracker takes, doing nothing. The baseline the metrics cost is measured against."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


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

    def observe_feed(
        self,
        counters: Mapping[str, float],
        episodes: list[tuple[np.ndarray, np.ndarray, int]],
        scalars: Mapping[str, float],
        step: int,
        **labels: object,
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
