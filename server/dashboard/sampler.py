"""The dashboard's history: one sample of every session's counters a second, in a ring.

A timer thread reads what the server already keeps (each `Session.status()` and the metrics
tracker's `snapshot()`), never the ingest path: one sample costs a session lock held for a
status copy and one metrics snapshot, whatever the ingest rate. Rates (MB/s, env steps/s) and
the mean return and length of the episodes between two samples come from differences of
consecutive samples. Env steps are T×N (each worker's time steps times its environments),
the unit a training run counts samples in.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from recorder_client.status import SessionStatus

logger = logging.getLogger(__name__)

PERIOD_S = 1.0
"""Seconds between samples."""
RING = 900
"""Samples kept per session (15 minutes at one a second)."""

# Metric tags a sample reads from the tracker's snapshot (folded with ``/session=NAME``).
_TAGS = {
    "episode_count": "Episode/count",
    "return_mean": "Episode/return_mean",
    "length_mean": "Episode/length_mean",
    "cells": "Trajectories/archive_cells",
    "repository_bytes": "Trajectories/repository_bytes",
    "repository_capacity_bytes": "Trajectories/repository_capacity_bytes",
    "midpoint_starts": "Trajectories/curriculum_midpoint_starts",
}


@dataclass(frozen=True)
class Sample:
    """A session's cumulative counters at one moment."""

    time: float
    """Unix seconds."""
    steps: int
    raw_bytes: int
    wire_bytes: int
    chunks: int
    episodes: int
    values: dict[str, float] = field(default_factory=dict)
    """The tracker's values of `_TAGS` for the session (absent without metrics)."""
    env_steps: int = 0
    """Sum of T×N over the stored chunks of every worker."""


def session_values(snapshot: dict[str, float], session: str) -> dict[str, float]:
    """``{tag: value}`` of the snapshot's series labelled with this session only."""
    suffix = f"/session={session}"
    return {k[: -len(suffix)]: v for k, v in snapshot.items() if k.endswith(suffix)}


def worker_values(snapshot: dict[str, float], tag: str, session: str) -> dict[str, float]:
    """``{worker: value}`` of a tag labelled session=..., worker=... (folded in that order)."""
    head = f"{tag}/session={session}/worker="
    return {k[len(head) :]: v for k, v in snapshot.items() if k.startswith(head)}


def env_steps(status: SessionStatus) -> int:
    """T×N over the session's stored chunks (a worker's N is fixed by its first chunk)."""
    return sum(w.steps * w.num_envs for w in status.workers)


def take(status: SessionStatus, values: dict[str, float], now: float) -> Sample:
    return Sample(
        time=now,
        steps=status.num_recorded_steps,
        raw_bytes=status.raw_bytes,
        wire_bytes=status.wire_bytes,
        chunks=status.chunks_stored,
        episodes=status.episodes_finished,
        values={name: values[tag] for name, tag in _TAGS.items() if tag in values},
        env_steps=env_steps(status),
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _rate(a: float | None, b: float | None, dt: float, scale: float = 1.0) -> float | None:
    """Per-second change from a to b; None when either is unknown or the counter went down."""
    if a is None or b is None or b < a:
        return None
    return (b - a) / dt / scale


def _interval_mean(before: dict[str, float], after: dict[str, float], mean: str) -> float | None:
    """Mean of the episodes finished between two samples, from the running count and mean."""
    n0, n1 = before.get("episode_count", 0.0), after.get("episode_count", 0.0)
    if n1 <= n0 or mean not in after:
        return None
    return _finite((after[mean] * n1 - before.get(mean, 0.0) * n0) / (n1 - n0))


def history(samples: Iterable[Sample]) -> dict[str, list]:
    """Series over time, one point per pair of consecutive samples (its later time and its
    env steps, the two x axes the page offers): rates per second, the mean return and length of the episodes finished between the two (None
    when none did), and the store's levels. A counter that went down (a session reset) gives
    no rate at that point."""
    out: dict[str, list] = {
        k: []
        for k in (
            "time",
            "env_steps",
            "raw_mb_s",
            "wire_mb_s",
            "steps_s",
            "env_steps_s",
            "chunks_s",
            "episodes_s",
            "return_mean",
            "length_mean",
            "cells",
            "repository_bytes",
            "repository_capacity_bytes",
            "midpoint_starts",
        )
    }
    previous: Sample | None = None
    for s in samples:
        if previous is not None and s.time > previous.time:
            dt = s.time - previous.time
            pv, sv = previous.values, s.values
            out["time"].append(s.time)
            out["env_steps"].append(s.env_steps)
            out["raw_mb_s"].append(_rate(previous.raw_bytes, s.raw_bytes, dt, 1e6))
            out["wire_mb_s"].append(_rate(previous.wire_bytes, s.wire_bytes, dt, 1e6))
            out["steps_s"].append(_rate(previous.steps, s.steps, dt))
            out["env_steps_s"].append(_rate(previous.env_steps, s.env_steps, dt))
            out["chunks_s"].append(_rate(previous.chunks, s.chunks, dt))
            out["episodes_s"].append(_rate(previous.episodes, s.episodes, dt))
            out["return_mean"].append(_interval_mean(pv, sv, "return_mean"))
            out["length_mean"].append(_interval_mean(pv, sv, "length_mean"))
            for name in ("cells", "repository_bytes", "repository_capacity_bytes"):
                out[name].append(sv.get(name))
            out["midpoint_starts"].append(sv.get("midpoint_starts"))
        previous = s
    return out


class Sampler:
    """Samples every session once per `period` seconds on a thread of its own; `close` stops
    it. A dropped session's history goes with it."""

    def __init__(
        self,
        sessions,
        metrics,
        *,
        period: float = PERIOD_S,
        ring: int = RING,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sessions = sessions
        self._metrics = metrics
        self._period = period
        self._ring = ring
        self._clock = clock
        self._lock = threading.Lock()
        self._rings: dict[str, deque[Sample]] = {}
        self.started = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="dashboard-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.sample()
            except Exception:  # the sampler must outlive one bad read
                logger.exception("dashboard sample failed")

    def sample(self) -> None:
        """Take one sample of every session now."""
        now = self._clock()
        snapshot = self._metrics.snapshot()
        taken: dict[str, Sample] = {}
        for session in self._sessions.all():
            status = session.status()
            taken[status.session] = take(status, session_values(snapshot, status.session), now)
        with self._lock:
            for name in [n for n in self._rings if n not in taken]:
                del self._rings[name]
            for name, sample in taken.items():
                ring = self._rings.get(name)
                if ring is None:
                    ring = self._rings[name] = deque(maxlen=self._ring)
                ring.append(sample)

    def samples(self, session: str) -> list[Sample]:
        with self._lock:
            return list(self._rings.get(session, ()))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
