"""What a worker's stream counts: the session's counters as the server last sent them, plus
this worker's queued chunks the server has not counted yet, so that `num_recorded_steps` and
`is_full` are answered in the client without a server call."""

from __future__ import annotations

import time
from typing import Any

from ._pending import PendingChunk
from ._proto import recorder_pb2 as pb

# Seconds without an ack after which an idle worker's counters are asked for again.
_STALE_S = 0.02


def counters_of(msg: Any) -> tuple[int, bool, int, int]:
    """(version, is_full, num_recorded_steps, episodes_finished) of an ack or a status."""
    return (msg.counters_version, msg.is_full, msg.num_recorded_steps, msg.episodes_finished)


class StreamCounters:
    """ChunkSender's counting half: the attributes it reads are set by ChunkSender."""

    _cond: Any
    _counters: tuple[int, bool, int, int]
    _counted: int
    _uncounted: Any
    _uncounted_steps: int
    _uncounted_dones: int
    _uncounted_unknown: int
    _view: tuple[bool, int] | None
    _heard: float
    _refreshing: bool
    _max_episodes: int | None
    _status_call: Any
    _unacked: Any
    _to_send: Any

    def _count_later(self, item: PendingChunk) -> None:
        self._uncounted.append(item)
        self._uncounted_steps += item.length
        item.dones_summed = item.dones is not None
        if item.dones_summed:
            self._uncounted_dones += item.dones or 0
        else:
            self._uncounted_unknown += 1
        self._refresh_view()

    def _count_through(self, through: int) -> None:
        """The server's counters now count this worker's chunks up to `through`."""
        if through < self._counted:  # a restarted server lost chunks: recount the queue
            self._counted = through
            self._uncounted.clear()
            self._uncounted_steps = self._uncounted_dones = self._uncounted_unknown = 0
            for items in (self._unacked.values(), self._to_send):
                for item in items:
                    if item.sequence > through:
                        self._count_later(item)
            self._refresh_view()
            return
        self._counted = through
        while self._uncounted and self._uncounted[0].sequence <= through:
            item = self._uncounted.popleft()
            self._uncounted_steps -= item.length
            if item.dones_summed:
                self._uncounted_dones -= item.dones or 0
            else:
                self._uncounted_unknown -= 1
        self._refresh_view()

    def counters(self) -> tuple[bool, int]:
        """(is_full, num_recorded_steps) once the server takes this worker's chunks that
        its last counters do not count yet, as it would with no other worker sending.

        Other workers' chunks count as of the server's last answer. A worker with nothing in
        flight hears no acks, so after _STALE_S of silence asking starts a status call in
        the background, and a later ask has its answer."""
        if (
            not self._uncounted
            and not self._refreshing
            and time.monotonic() - self._heard > _STALE_S
            and self._status_call is not None
        ):
            self._refresh()
        view = self._view  # kept current by whoever changes what it depends on
        if view is not None:
            return view
        with self._cond:  # near max_episodes, or done flags not counted yet: walk the queue
            _, _, steps, episodes = self._counters
            limit = self._max_episodes or 0
            for item in self._uncounted:  # the chunk that fills the session is kept whole
                if episodes >= limit:
                    break
                steps += item.length
                episodes += item.count_dones()
            return episodes >= limit, steps

    def _refresh_view(self) -> None:
        """The answer of counters() where it is a sum (with the lock held); None where the
        queue must be walked. Read without the lock, so that asking never waits for the
        sender threads."""
        _, full, steps, episodes = self._counters
        limit = self._max_episodes
        if limit is None:
            self._view = (full, steps + self._uncounted_steps)
        elif episodes >= limit:
            self._view = (True, steps)  # the session drops what follows
        elif not self._uncounted_unknown and episodes + self._uncounted_dones < limit:
            self._view = (False, steps + self._uncounted_steps)
        else:
            self._view = None

    def _refresh(self) -> None:
        self._refreshing = True
        asked = time.monotonic()

        def done(reply: pb.StatusReply | None) -> None:
            with self._cond:
                self._refreshing = False
                self._heard = max(self._heard, asked)
                # Newer counters only, and only while nothing of this worker's is in flight
                # (the status does not say which of its chunks it counts).
                if reply is None or self._uncounted:
                    return
                if reply.counters_version >= self._counters[0]:
                    self._counters = counters_of(reply)
                    self._refresh_view()

        assert self._status_call is not None
        self._status_call(done)

    def take_counters(self, status: pb.StatusReply, through: int) -> None:
        """Counters from a status reply, counting this worker's chunks up to `through`."""
        with self._cond:
            self._heard = time.monotonic()
            self._counters = counters_of(status)
            self._count_through(through)
