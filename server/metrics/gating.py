"""When the pushed sinks (TensorBoard, JSON lines) write: each sink behind its own gate.

A `GatedSink` holds one sink with its `WriteGate` state: when it last wrote (clock and step),
which changes it has written (a sequence number), and the summary window of the episodes
observed since its previous write. The tracker reads and writes that state under its own
lock; the sink's I/O happens under the per-sink ``io_lock``, which keeps batches in order.
"""

from __future__ import annotations

import threading

from .config import MetricsConfig, WriteGate
from .sinks import JsonlSink, PushSink, TensorBoardSink

NEVER = -(2**62)
"""The step before any write: every step counts as advanced from it."""

EpisodeStats = list[float]
"""[count, return sum, min, max, length sum, min, max, step] of a batch of episodes."""


class GatedSink:
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
        self.last_step = NEVER
        self.written_seq = 0
        # Episode series key -> EpisodeStats of the episodes observed since this sink's
        # previous write.
        self.episodes: dict[object, EpisodeStats] = {}
        self.io_lock = threading.Lock()
        self.closed = False  # set under io_lock

    def opens(self, step: int, now: float) -> bool:
        """Whether the gate opens for a log at ``step`` and clock ``now``; if so the write
        is counted as done then."""
        d = step - self.last_step
        if (d >= self.every_n or d < 0) and now - self.last_time >= self.min_interval:
            self.mark(step, now)
            return True
        return False

    def opens_idle(self, now: float, quiet: float, idle_flush_s: float, pending: bool) -> bool:
        """Whether what the gate held back (``pending``) is written now, whatever the step:
        the sink's interval has passed since its previous write, or a quarter of it since the
        latest value arrived (``quiet`` seconds ago)."""
        interval = self.min_interval or idle_flush_s
        return (pending or bool(self.episodes)) and (
            now - self.last_time >= interval or quiet >= interval / 4
        )

    def mark(self, step: int, now: float) -> None:
        """Count a write as done at ``step`` and clock ``now``."""
        self.last_time = now
        self.last_step = step

    def add_episodes(self, key: object, stats: EpisodeStats) -> None:
        """Merge a batch of one series' episodes into the window of the next write."""
        acc = self.episodes.get(key)
        if acc is None:
            self.episodes[key] = list(stats)
            return
        acc[0] += stats[0]
        acc[1] += stats[1]
        acc[2] = min(acc[2], stats[2])
        acc[3] = max(acc[3], stats[3])
        acc[4] += stats[4]
        acc[5] = min(acc[5], stats[5])
        acc[6] = max(acc[6], stats[6])
        acc[7] = stats[7]


def open_push_sinks(config: MetricsConfig) -> tuple[GatedSink, ...]:
    """The pushed sinks the config asks for, each behind its gate; none is left open when
    one fails to open."""
    sinks: list[GatedSink] = []
    try:
        if config.tensorboard_dir is not None:
            tb = TensorBoardSink(config.tensorboard_dir)
            sinks.append(GatedSink(tb, "tensorboard", config.tensorboard_gate))
        if config.jsonl_path is not None:
            jsonl = JsonlSink(config.jsonl_path)
            sinks.append(GatedSink(jsonl, "jsonl", config.jsonl_gate))
    except BaseException:
        for s in sinks:
            s.sink.close()
        raise
    return tuple(sinks)
