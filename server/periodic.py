"""A call repeated on a daemon thread every so many seconds until stopped, outliving any one
failure (timed checkpoints, the session sweep, idle metric flushes)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class Periodic:
    def __init__(self, every: float, fn: Callable[[], object], name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(every, fn, name), name=name, daemon=True
        )
        self._thread.start()

    def _loop(self, every: float, fn: Callable[[], object], name: str) -> None:
        while not self._stop.wait(every):
            try:
                fn()
            except Exception:  # the next round may well succeed
                logging.getLogger(__name__).exception("%s failed", name)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
