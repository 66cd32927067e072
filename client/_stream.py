"""The background chunk pipeline: encode, stream, take acks, reconnect, resend.

record() only enqueues. One sender thread owns the gRPC Record stream: grpc's
request-iterator thread encodes each chunk (zstd) just before it goes out, and
the sender thread reads acknowledgements. Every chunk stays in memory until its
ack arrives, so a lost connection resends exactly what was not acknowledged;
(worker, sequence) makes the resend idempotent on the server. Small chunks that come
quickly join the one still queued before them (linger), one message and one sequence.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ._counters import StreamCounters, counters_of
from ._loss import data_loss_error
from ._pending import PendingChunk, SenderStats, StreamStats, encode_request
from ._poll import POLL_BACKOFF_S, POLL_GAP_S, POLL_LATE_S, POLL_QUIET_S, POLL_S, claim_poll
from ._proto import recorder_pb2 as pb
from ._wire import ERROR_KIND_KEY
from .errors import (
    RecorderError,
    RecorderUnavailableError,
    from_rpc_error,
    from_status,
)

logger = logging.getLogger(__name__)

# Status codes after which the stream is reopened and unacknowledged chunks resent. This
# client never cancels its stream: CANCELLED comes from the transport or the server's side
# (seen with a thousand streams opening at once on a loaded machine).
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.CANCELLED,
}
# Raw bytes up to which small chunks join while they linger.
_LINGER_CAP = 1 << 20
# Refusal kinds a fresh join resolves (the worker expired, or the server restarted).
_REJOIN_KINDS = {"not_joined"}


def _kind(err: grpc.RpcError) -> str:
    for key, value in getattr(err, "trailing_metadata", lambda: None)() or ():
        if key == ERROR_KIND_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


class ChunkSender(StreamCounters):
    """Owns the Record stream of one worker."""

    def __init__(
        self,
        *,
        connection: Any,
        join: Callable[[int], int],
        session: str,
        worker_id: str,
        instance: str = "",
        loss: Callable[[], Any] = lambda: None,
        target: str,
        max_bytes_in_flight: int,
        compression_level: int,
        reconnect_timeout: float,
        wire: Callable[[], tuple[bool, int]] = lambda: (False, 256 << 20),
        on_stored: Callable[[PendingChunk], None] = lambda item: None,
        on_refused: Callable[[PendingChunk], None] = lambda item: None,
        on_error: Callable[[RecorderError], None] | None = None,
        raise_data_loss: bool = True,
        max_episodes: int | None = None,
        status_call: Callable[[Callable[[Any], None]], None] | None = None,
        linger_s: float = 0.0,
        poll: bool = True,
    ) -> None:
        self._connection = connection
        self._on_stored = on_stored
        self._on_refused = on_refused
        # Errors for the caller's on_error, handed over outside the lock.
        self._on_error = on_error
        self._outbox: list[RecorderError] = []
        # Set with every error for the caller; read on each of its calls without the lock (a
        # stale True costs one look under it).
        self.unseen = False
        self._raise_data_loss = raise_data_loss
        # Highest sequence the server acknowledged; sent on every rejoin.
        self._acked = 0
        self._join = join
        self._session = session
        self._worker_id = worker_id
        # The recorder's instance id (sent on every stream's open), and the loss report of
        # its last join (a JoinReply.loss, or None).
        self._instance = instance
        self._loss_report = loss
        self._target = target
        self._max_in_flight = max_bytes_in_flight
        self._level = compression_level
        # Whether the server last joined takes packed codecs (JoinReply.packed_codecs), and
        # the largest request it (and this client) takes.
        self._wire = wire
        self._reconnect_timeout = reconnect_timeout
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The request iterator waits for work on its own condition (same lock): an ack's
        # notify, for flush() and a blocked submit(), does not wake it for nothing.
        self._work = threading.Condition(lock)
        self._to_send: collections.deque[PendingChunk] = collections.deque()
        self._unacked: collections.OrderedDict[int, PendingChunk] = collections.OrderedDict()
        self._in_flight = 0
        self._generation = 0
        self._closing = False
        self._fatal: RecorderError | None = None
        # Whether the caller has seen _fatal (close() does not raise it a second time).
        self.fatal_reported = False
        self.stats = SenderStats()
        self._max_episodes = max_episodes
        # Asks the server for the session's status in the background; calls back with the
        # reply (None on failure).
        self._status_call = status_call
        # The session's counters as the server last sent them: (version, is_full,
        # num_recorded_steps, episodes_finished), counting this worker's chunks up to
        # _counted.
        self._counters: tuple[int, bool, int, int] = (0, False, 0, 0)
        self._counted = 0
        # This worker's queued chunks those counters do not count yet, in sequence order,
        # with their steps and known done flags summed.
        self._uncounted: collections.deque[PendingChunk] = collections.deque()
        self._uncounted_steps = 0
        self._uncounted_dones = 0
        self._uncounted_unknown = 0  # chunks whose done flags are not counted yet
        self._view: tuple[bool, int] | None = (False, 0)
        self._heard = time.monotonic()  # when the server last told this worker its counters
        self._refreshing = False
        # The server's refusal while it has no space; cleared by the next ack.
        self._exhausted: RecorderError | None = None
        self._progress = True
        self._stalled_since = time.monotonic()
        self._backoff = 0.0
        # Whether the sender thread sleeps until woken (else it polls: see POLL_S), and when
        # the last two chunks were queued.
        self._sleeping = True
        self._polling = False
        self._submitted = self._gap = 0.0
        self._may_poll = poll
        self._busy_until = 0.0  # no polling before then: the caller's loop holds the GIL
        # Linger: a small chunk that comes within linger_s of the one before waits up to
        # linger_s for the next ones to join it, so that a loop recording small chunks
        # quickly sends one message (and wakes these threads once) for several. Not with
        # max_episodes: there the chunk that fills the session is kept whole, the next
        # dropped. _holding: the sender waits for a chunk's linger to end; _hurry: flush()
        # or a full in-flight cap wants everything sent now.
        self._linger = 0.0 if max_episodes is not None else linger_s
        self._holding = False
        self._hurry = 0
        # A joined message stays within these: raw bytes, and the server's env-step cap.
        self._join_bytes, self._join_env_steps = _LINGER_CAP, 0
        self._thread = threading.Thread(target=self._run, name="recorder-sender", daemon=True)
        self._thread.start()

    # -- caller side -----------------------------------------------------
    def join_limits(self, max_chunk_bytes: int, max_chunk_env_steps: int) -> None:
        """The caps of the server joined (0: not stated) that a joined message keeps to."""
        with self._cond:
            self._join_bytes = min(_LINGER_CAP, max_chunk_bytes or _LINGER_CAP)
            self._join_env_steps = max_chunk_env_steps

    @property
    def bytes_in_flight(self) -> int:
        return self._in_flight

    def submit(self, item: PendingChunk, *, block: bool) -> bool:
        """Queue a chunk; False when it was dropped for lack of room (block=False). A chunk
        that joined the one queued before it comes back with ``merged`` set."""
        with self._cond:
            self._raise_fatal()
            while self._in_flight and self._in_flight + item.raw_bytes > self._max_in_flight:
                if not block:
                    self.stats.chunks_dropped_in_flight += 1
                    return False
                self._hurry_up(1)
                try:
                    self._cond.wait(0.5)
                finally:
                    self._hurry -= 1
                self._raise_fatal()
            self._in_flight += item.raw_bytes
            now = time.monotonic()
            self._gap, self._submitted = now - self._submitted, now
            tail = self._to_send[-1] if self._to_send else None
            if tail is not None and tail.can_take(item, self._join_bytes, self._join_env_steps):
                tail.take(item)
                self.stats.chunks_joined += 1
                self._uncounted_steps += item.length
                self._refresh_view()
                return True
            item.growable = self._gap < self._linger and item.raw_bytes < self._join_bytes
            item.queued_at = now
            self._to_send.append(item)
            self._count_later(item)
            if self._sleeping or (self._holding and tail is not None):
                self._work.notify()
        return True

    def _hurry_up(self, by: int) -> None:
        self._hurry += by
        if self._holding:
            self._work.notify()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every ack. While the server is out of space this raises its
        ResourceExhaustedError instead of waiting; the chunks stay queued and are
        retried in the background until the server takes them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._hurry_up(1)
        try:
            self._wait_acked(deadline, timeout)
        finally:
            with self._cond:
                self._hurry -= 1

    def _wait_acked(self, deadline: float | None, timeout: float | None) -> None:
        with self._cond:
            while self._to_send or self._unacked:
                self._raise_fatal()
                if self._exhausted is not None:
                    self.stats.errors = [e for e in self.stats.errors if e is not self._exhausted]
                    raise self._exhausted
                if self.stats.errors:  # a refusal is reported now, not after the rest
                    errors, self.stats.errors = self.stats.errors, []
                    raise errors[0]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"flush: {len(self._to_send) + len(self._unacked)} chunks still "
                        f"unacknowledged after {timeout}s"
                    )
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
            self._raise_fatal()

    def snapshot(self) -> StreamStats:
        with self._cond:
            s = self.stats
            return StreamStats(
                s.chunks_sent,
                s.chunks_acked,
                s.chunks_dropped_full,
                s.chunks_dropped_in_flight,
                s.raw_bytes,
                s.wire_bytes,
                s.reconnects,
                s.sequences_lost,
                s.chunks_joined,
            )

    def take_errors(self) -> list[RecorderError]:
        """The errors the caller has not seen, each handed out once; the stream's failure
        comes after them (record() and flush() raise it on every call as well)."""
        with self._cond:
            errors, self.stats.errors = self.stats.errors, []
            if not errors and self._fatal is not None and not self.fatal_reported:
                self.fatal_reported = True
                errors = [self._fatal]
            self.unseen = self._fatal is not None and not self.fatal_reported
            return errors

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._work.notify_all()
        self._thread.join(timeout=10)
        claim_poll(self, False)

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            self.fatal_reported = True
            raise self._fatal

    # -- sender thread ---------------------------------------------------
    def _requests(self, generation: int) -> Iterator[pb.RecordRequest]:
        yield pb.RecordRequest(
            open=pb.RecordOpen(
                session=self._session, worker_id=self._worker_id, instance_id=self._instance
            )
        )
        while True:
            # Polling looks at the queue without the lock: record() never waits for it.
            if not self._to_send and not self._closing and generation == self._generation:
                if self._poll():
                    slept = time.monotonic()
                    time.sleep(POLL_S)
                    woke = time.monotonic()
                    if woke - slept > POLL_S + POLL_LATE_S:
                        self._busy_until = woke + POLL_BACKOFF_S
                    continue
            with self._cond:
                while not self._to_send and not self._closing and generation == self._generation:
                    self._sleeping = True  # under the lock: a chunk queued now wakes it
                    self._work.wait()
                if generation != self._generation or (self._closing and not self._to_send):
                    return
                if self._hold():
                    continue
                item = self._to_send.popleft()
                item.growable = False
                self._unacked[item.sequence] = item
            if item.request is None:
                packed, cap = self._wire()
                error = encode_request(item, self._level, packed, cap)
                if error is not None:
                    with self._cond:
                        self._report(error)
                    self._deliver()
                item.arrays = None  # the encoded copy is all a resend needs
            self.stats.chunks_sent += 1
            yield item.request

    def _hold(self) -> bool:
        """Wait (the lock held) while the only queued chunk lingers for others to join it;
        True when it waited, and the queue must be looked at again."""
        head = self._to_send[0]
        wait = head.queued_at + self._linger - time.monotonic()
        if (
            not head.growable
            or wait <= 0
            or len(self._to_send) > 1
            or self._hurry
            or self._closing
            or head.raw_bytes >= self._join_bytes
        ):
            return False
        # record() does not wake a holding sender for a chunk that joins the held one.
        self._holding, self._sleeping = True, False
        try:
            self._work.wait(wait)
        finally:
            self._holding = False
        return True

    def _poll(self) -> bool:
        """Whether to look at the queue again in POLL_S rather than sleep until woken."""
        now = time.monotonic()
        want = (
            self._may_poll
            and now - self._submitted < POLL_QUIET_S
            and self._gap < POLL_GAP_S
            and now >= self._busy_until
        )
        if want != self._polling:
            self._polling = claim_poll(self, want)
        self._sleeping = not self._polling
        return self._polling

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closing and not self._to_send and not self._unacked:
                    return
                generation = self._generation
            try:
                responses = self._connection.record_stream(self._requests(generation))
                for ack in responses:
                    self._on_ack(ack)
                    if self._outbox:
                        self._deliver()
                with self._cond:
                    if self._closing and not self._to_send and not self._unacked:
                        return
                # The server ended the stream early; reopen it.
                err: grpc.RpcError | None = None
            except grpc.RpcError as exc:
                err = exc
            # Out of space on the server (its kind says so): retried until it has room. A
            # message over the server's size cap says nothing and is never taken: fatal.
            exhausted = (
                err is not None
                and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and _kind(err) == "storage"
            )
            if exhausted:
                # The server could not log the chunk (its disk is full). Tell the
                # caller once, keep every unacknowledged chunk, and keep retrying.
                error = from_rpc_error(err, self._target)
                with self._cond:
                    if self._exhausted is None:
                        self._report(error)
                    self._exhausted = error
                    self._cond.notify_all()
                self._deliver()
            elif (
                err is not None and err.code() not in _RETRYABLE and _kind(err) not in _REJOIN_KINDS
            ):
                self._fail(from_rpc_error(err, self._target))
                return
            if not self._reconnect(err, patient=exhausted):
                return

    def _on_ack(self, ack: pb.RecordAck) -> None:
        with self._cond:
            if ack.counters_version >= self._counters[0]:
                self._counters = counters_of(ack)
            # A chunk answered is counted, or never will be (dropped, refused, a resend).
            self._count_through(max(self._counted, ack.counted_through, ack.sequence))
            self._heard = time.monotonic()
            # Earlier chunks of this worker's, found after their ack not to decode.
            for message in ack.late_refusals:
                self._report(from_status("INVALID_ARGUMENT", message, self._target))
            if ack.late_refusals:
                self._cond.notify_all()
            item = self._unacked.pop(ack.sequence, None)
            if item is None:
                return
            self._in_flight -= item.raw_bytes
            self._exhausted = None
            self._acked = max(self._acked, ack.sequence)
            self._progress = True
            self.stats.chunks_acked += 1
            if ack.result == pb.RecordAck.REJECTED:
                # A chunk that did not encode went as an empty one: reported then, not again.
                if item.request is None or item.request.chunk.HasField("action"):
                    self._report(
                        from_status(ack.error_code or "UNKNOWN", ack.error_message, self._target)
                    )
                self._on_refused(item)
            elif ack.result == pb.RecordAck.DROPPED_FULL:
                self.stats.chunks_dropped_full += 1
            else:
                self.stats.raw_bytes += item.raw_bytes
                self.stats.wire_bytes += item.wire_bytes
                if ack.result == pb.RecordAck.STORED:
                    self._on_stored(item)
            self._cond.notify_all()

    def _reconnect(self, err: grpc.RpcError | None, *, patient: bool = False) -> bool:
        """Rejoin with backoff, forget what the server already has, requeue the rest.

        `patient`: the server is up but out of space; wait for it without a deadline.
        """
        with self._cond:
            self._generation += 1
            # A stream with nothing to send makes no progress and needs none.
            waiting = bool(self._unacked or self._to_send)
            progressed, self._progress = self._progress or not waiting, False
            self._cond.notify_all()
            self._work.notify_all()
        reason = err.details() if err is not None else "stream ended"
        logger.info("stream to %s ended (%s); reconnecting", self._target, reason)
        now = time.monotonic()
        if progressed:
            self._stalled_since, self._backoff = now, 0.0
        else:
            # Reconnected before and no ack since: the server keeps refusing this stream.
            # Back off, and give up once that has gone on for reconnect_timeout (unless the
            # server is only out of space: that is waited out).
            if not patient and now - self._stalled_since > self._reconnect_timeout:
                self._fail(
                    RecorderError(
                        f"the recorder server at {self._target} kept ending this worker's "
                        f"stream for {self._reconnect_timeout}s without taking a chunk "
                        f"(last: {reason})"
                    )
                )
                return False
            self._backoff = min(max(self._backoff * 2, 0.05), 2.0)
            time.sleep(self._backoff)
        if patient:
            time.sleep(0.5)
        delay = 0.05
        deadline = time.monotonic() + self._reconnect_timeout
        while True:
            with self._cond:
                if self._closing:
                    left = len(self._to_send) + len(self._unacked)
                    if left:
                        logger.warning(
                            "closing with %d chunks the server at %s never acknowledged",
                            left,
                            self._target,
                        )
                    return False
            try:
                last = self._join(self._acked)
                break
            except RecorderUnavailableError as exc:
                if time.monotonic() + delay > deadline:
                    self._fail(
                        RecorderUnavailableError(
                            f"lost the recorder server at {self._target} and could not reconnect "
                            f"within {self._reconnect_timeout}s ({reason}; last: {exc})"
                        )
                    )
                    return False
            except RecorderError as exc:  # a refusal (some are ValueErrors): first
                self._fail(exc)
                return False
            except ValueError:  # the channel was closed under us: we are shutting down
                return False
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        if last < self._acked:
            self._lost(last + 1, self._acked, self._loss_report())
        with self._cond:
            self.stats.reconnects += 1
            # The server (perhaps restarted) counts this worker's chunks up to `last`; its
            # versions start again.
            self._counters = (0, *self._counters[1:])
            self._count_through(last)
            resend = [item for seq, item in self._unacked.items() if seq > last]
            for seq, item in list(self._unacked.items()):
                if seq <= last:
                    self._in_flight -= item.raw_bytes
            self._unacked.clear()
            self._to_send.extendleft(reversed(resend))
            self._cond.notify_all()
            self._work.notify_all()
        logger.info("reconnected to %s; resending %d chunks", self._target, len(resend))
        return True

    def _lost(self, first: int, last: int, report: Any = None) -> None:
        error = data_loss_error(self._target, self._worker_id, self._session, first, last, report)
        logger.warning("%s", error)
        with self._cond:
            self.stats.sequences_lost += last - first + 1
            if self._raise_data_loss:
                self._report(error)
            self._cond.notify_all()
        self._deliver()

    def _fail(self, exc: RecorderError) -> None:
        with self._cond:
            self._fatal = exc
            self.unseen = True
            if self._on_error is not None:
                self._outbox.append(exc)
            self._cond.notify_all()
        logger.error("recorder stream failed: %s", exc)
        self._deliver()

    def _report(self, error: RecorderError) -> None:
        """An error for the caller's next call, and for on_error (the lock is held)."""
        self.stats.errors.append(error)
        self.unseen = True
        if self._on_error is not None:
            self._outbox.append(error)

    def _deliver(self) -> None:
        """Hand reported errors to on_error, without the lock: it may call the recorder."""
        with self._cond:
            errors, self._outbox = self._outbox, []
        for error in errors:
            try:
                self._on_error(error)  # type: ignore[misc]
            except Exception:  # the callback's own failure must not stop the stream
                logger.exception("on_error raised while handed %r", error)
