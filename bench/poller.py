"""What an open dashboard page asks the server for, once a second, from a thread.

The page (server/dashboard/static/app.js) polls every second: `/api/sessions`, then the
selected session's `/api/sessions/NAME` (and its archive every 2 s when the session has a
store; the bench's dashboard row has none). `DashboardPoller` makes the same requests on the
same clock, so a run with it measures a server with one browser watching. Times are
perf_counter_ns (CLOCK_MONOTONIC), comparable with the bench workers' own.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from typing import Any


class DashboardPoller:
    def __init__(self, base_url: str, interval_s: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self.polls = 0
        self.errors: list[str] = []
        self.latencies_ms: list[float] = []
        self.spans_ns: list[tuple[int, int]] = []  # each poll's perf_counter_ns start and end
        self._stop = threading.Event()
        self._active = threading.Event()  # polls are made only while set (`pause`, `resume`)
        self._active.set()
        self._clock = threading.Lock()
        self._next_at = time.monotonic()  # the next poll, while active
        self._due_in = 0.0  # seconds of active time to the next poll, while paused
        self._thread = threading.Thread(target=self._run, name="dashboard-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def pause(self) -> None:
        """No polls until `resume`. The clock counts only the time between `resume` and
        `pause`: a poll a second of the watched server's own run time, however its turns
        are interleaved with other servers'."""
        with self._clock:
            if self._active.is_set():
                self._due_in = max(0.0, self._next_at - time.monotonic())
            self._active.clear()

    def resume(self) -> None:
        with self._clock:
            if not self._active.is_set():
                self._next_at = time.monotonic() + self._due_in
            self._active.set()

    def stop(self) -> None:
        """Stops polling (again: a no-op)."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(10)

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.base_url}{path}", timeout=10) as reply:
            return json.loads(reply.read())

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._active.wait(0.05):
                continue
            with self._clock:
                wait = self._next_at - time.monotonic()
            if wait > 0:
                self._stop.wait(min(wait, 0.05))
                continue
            t0 = time.perf_counter_ns()
            try:
                sessions = self._get("/api/sessions").get("sessions", [])
                if sessions:
                    name = urllib.parse.quote(sessions[0]["name"], safe="")
                    self._get(f"/api/sessions/{name}")
                t1 = time.perf_counter_ns()
                self.polls += 1
                self.latencies_ms.append((t1 - t0) / 1e6)
                self.spans_ns.append((t0, t1))
            except (OSError, ValueError, KeyError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            with self._clock:
                self._next_at += self.interval_s
                if not self._active.is_set():  # paused during the poll
                    self._due_in = max(0.0, self._next_at - time.monotonic())

    def summary(self, window_ns: tuple[int, int] | None = None) -> dict[str, Any]:
        """Counts and latencies; with `window_ns` (perf_counter_ns), the polls overlapping it."""
        lat = sorted(self.latencies_ms)
        out: dict[str, Any] = {}
        if window_ns is not None:
            start, end = window_ns
            out["polls_in_window"] = sum(t0 <= end and t1 >= start for t0, t1 in self.spans_ns)
        return out | {
            "polls": self.polls,
            "interval_s": self.interval_s,
            "errors": self.errors[:5],
            "error_count": len(self.errors),
            "poll_ms_median": lat[len(lat) // 2] if lat else None,
            "poll_ms_max": lat[-1] if lat else None,
        }
