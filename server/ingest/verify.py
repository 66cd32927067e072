"""Proving acknowledged frames decode, off the ack path.

A chunk's action and state frames are acknowledged on their headers (one whole zstd frame
that declares the array's size; `chunks.encoded_array`): decoding them is most of the
server's CPU per chunk, and nothing reads them until finish() or the dataset sink. Their
content is proved here, by a process-wide thread at the lowest CPU priority, which takes
whatever CPU ingest leaves; and by every reader, for the chunks it reads that the thread
has not reached yet (`Session.verify`: finish(), the dataset sink, a stored episode read
back). A frame that does not decode is replaced by one of zeros, so that it cannot fail a
reader, is counted (`Recorder/chunks_corrupt`) and logged with its worker, sequence and
field, and is reported to that worker on its next ack (`RecordAck.late_refusals`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Protocol

logger = logging.getLogger(__name__)


class Verifiable(Protocol):
    def verify_some(self, limit: int) -> None:
        """Verify up to `limit` pending chunks."""
        ...

    def verify_pending(self) -> int:
        """How many chunks wait (read under the verifier's lock: a chunk added before it
        is never left behind)."""
        ...


class BackgroundVerifier:
    """One daemon thread at nice 19, taking sessions with pending chunks in turn."""

    def __init__(self, batch: int = 32, linger_s: float = 0.02) -> None:
        self._batch = batch
        # Once woken, the thread waits this long for more chunks to prove with them: small
        # chunks arriving one at a time then cost a wake-up per batch, not one each (no ack
        # waits for a proof; a reader proves what it reads itself).
        self._linger_s = linger_s
        self._cond = threading.Condition()
        self._queue: deque[weakref.ref] = deque()
        self._queued: weakref.WeakSet = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def submit(self, session: Verifiable) -> None:
        """`session` has pending chunks, added before this call (a no-op when it is
        already queued)."""
        with self._cond:
            if session in self._queued:
                return
            self._queued.add(session)
            self._queue.append(weakref.ref(session))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="frame-verifier", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        try:  # Linux: a thread's own nice value; elsewhere the thread keeps the process's
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                woken = not self._queue
                while not self._queue:
                    self._cond.wait()
            if woken:
                time.sleep(self._linger_s)
            with self._cond:  # only this thread takes from the queue
                ref = self._queue.popleft()
            session = ref()
            if session is None:
                continue
            try:
                session.verify_some(self._batch)
            except Exception:
                logger.exception("verifying acknowledged frames failed")
            with self._cond:
                if session.verify_pending():
                    self._queue.append(ref)
                else:
                    self._queued.discard(session)
            del session


VERIFIER = BackgroundVerifier()
