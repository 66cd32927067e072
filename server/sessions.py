"""Every session of a server: creation on first join, limits, log replay, consistent locking.

Plain Python; the gRPC edge calls it from its worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from typing import Any

from recorder_client import _wire

from .chunks import SessionConfig
from .durability import records, snapshot
from .errors import ErrorKind, RequestError
from .identity import Tombstones, check_claim, dropped_error, proof
from .limits import ServiceLimits
from .loss import LossCause
from .session import Journal, Session, append, check_acked, check_session_name

logger = logging.getLogger(__name__)


class Sessions:
    """The registry: sessions by name, each created on its first join."""

    def __init__(self, limits: ServiceLimits, metrics, journal: Journal | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        # Appends a write-ahead log record; None without a log.
        self.journal = journal
        self._sessions: dict[str, Session] = {}
        self._lock = threading.RLock()
        # The dataset sink (serve --dataset-uri), or None.
        self.dataset: Any = None
        # Dropped sessions' names and the recorders that had joined them.
        self.tombstones = Tombstones()
        # What the last stop may have cost acknowledged chunks under the fsync policy (set
        # after recovery); explains a claim of a worker not yet joined in this process.
        self.start_cause: LossCause | None = None

    def _new(self, name: str, config: SessionConfig) -> Session:
        session = Session(
            name,
            config,
            self.metrics,
            max_workers=self.limits.max_workers_per_session,
            journal=self.journal,
        )
        if self.dataset is not None:
            session.before_reset = self.dataset.flush_now
        return session

    def join(
        self,
        name: str,
        config: SessionConfig,
        worker_id: str,
        acked: int = 0,
        *,
        instance: str = "",
        log: bool = True,
    ) -> tuple[Session, int]:
        """Create the session on first use and add (or resume) the worker; logged before it
        counts. Returns the session and the last sequence it held for the worker.

        A live join (``log``) is refused when the session was dropped under this recorder
        ``instance``, when ``acked`` claims more than the server can have acknowledged, or
        when another instance holds the worker id (identity.py)."""
        name = check_session_name(name)
        check_acked(acked)
        holder = proof(instance)
        with self._lock:
            if log:
                self.tombstones.check(name, instance, acked)
            session = self._sessions.get(name)
            cause = None
            if log:
                cause = self._check_claim(session, name, worker_id, acked)
            if session is None:
                if len(self._sessions) >= self.limits.max_sessions:
                    raise RequestError(
                        ErrorKind.LIMIT,
                        f"session: this server allows at most {self.limits.max_sessions} "
                        f"sessions, got a new one ({name!r}); drop finished ones "
                        "(rollout-recorder sessions drop, or serve --session-ttl)",
                    )
                session = self._new(name, config)
                try:
                    session.check_join(worker_id, config)
                    if log and self.journal is not None:
                        append(self.journal, records.join(name, worker_id, config, acked, holder))
                except BaseException:
                    session.close()
                    raise
                self._sessions[name] = session
                logger.info("session %r created: %s", name, config)
            else:
                if log:  # another instance's live lease refuses the join here
                    session.identity.check(worker_id, instance)
                # A new holder is logged too: a restart gives the lease back to it alone.
                if session.needs_log(worker_id, acked) or (
                    log and holder != session.identity.holder(worker_id)
                ):
                    session.check_join(worker_id, config)
                    if log and self.journal is not None:
                        append(self.journal, records.join(name, worker_id, config, acked, holder))
            _timeline, held = session.join(worker_id, config, acked, cause)
            if log:
                session.identity.take(worker_id, instance)
                if cause is not None:
                    session.identity.last_loss[worker_id] = cause
            return session, held

    def _check_claim(
        self, session: Session | None, name: str, worker_id: str, acked: int
    ) -> LossCause | None:
        """The cause of the loss a join's claim reveals, or INVALID (identity.py)."""
        if session is None:  # nothing held, nothing joined here
            return check_claim(name, worker_id, acked, 0, [], self.start_cause, set())
        held = session.last_sequence.get(worker_id, session.forgotten.get(worker_id, 0))
        return check_claim(
            name,
            worker_id,
            acked,
            held,
            session.loss_causes,
            self.start_cause,
            session.identity.joined_here,
        )

    def leave(
        self,
        name: str,
        worker_id: str,
        *,
        expired: bool = False,
        log: bool = True,
        instance: str | None = None,
    ) -> None:
        """The worker no longer counts against the session's worker limit (logged), and
        its worker id is free. ``instance``: the recorder that leaves (refused while another
        one holds the id); None for an expiry."""
        session = self.get(name)
        with self._lock:
            # A replayed leave releases the lease its join restored.
            session.identity.release(worker_id, instance if log else None)
            if worker_id not in session.active:
                return
            if log and self.journal is not None:
                append(self.journal, records.leave(name, worker_id, expired=expired))
            session.leave(worker_id)
        logger.info(
            "worker %r %s session %r", worker_id, "expired from" if expired else "left", name
        )

    def drop(self, name: str, *, log: bool = True) -> None:
        """Forget a session and everything it holds (logged; the caller checkpoints)."""
        session = self.get(name)
        if log and self.dataset is not None:
            # Every finished episode reaches the dataset before the session goes: no chunk is
            # taken from here on, and a failed write keeps the session as it was.
            with session.dataset_lock:
                with session.lock:
                    session.dropped = True
                    session.dropped_at = time.time()
                try:
                    self.dataset.flush_now(session)
                except BaseException:
                    with session.lock:
                        session.dropped = False
                        session.dropped_at = 0.0
                    raise
        with self._lock:
            session = self.get(name)
            with session.lock:
                if log and self.journal is not None:
                    append(self.journal, records.drop(name))
                session.dropped = True
                session.dropped_at = session.dropped_at or time.time()
                del self._sessions[name]
            # Its recorders are refused from now on (also when the drop is replayed: the
            # checkpoint that would have kept its tombstone may not have been written).
            self.tombstones.add(name, session.identity.members(), session.dropped_at)
        if log:
            session.identity.end_streams(dropped_error(name, session.dropped_at))
        session.close()
        self.metrics.forget(session=name)
        logger.info("session %r dropped", name)

    def idle(self, now: float, session_ttl: float, worker_ttl: float):
        """Sessions idle for session_ttl, and (session, worker) pairs idle for worker_ttl
        (a ttl of 0: never)."""
        sessions = self.all()
        stale = [s.name for s in sessions if session_ttl and now - s.last_used >= session_ttl]
        workers = [
            (s.name, w)
            for s in sessions
            if worker_ttl and s.name not in stale
            for w in s.idle_workers(now, worker_ttl)
        ]
        return stale, workers

    def get(self, name: str) -> Session:
        check_session_name(name)
        with self._lock:
            session = self._sessions.get(name)
        if session is None:
            raise RequestError(
                ErrorKind.UNKNOWN_SESSION,
                f"session: expected a session that was joined, got {name!r}",
            )
        return session

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def publish_levels(self) -> None:
        """Set the gauges measured rather than counted (each worker's lag, the held wire
        bytes, the unverified chunks): before each Prometheus scrape and each `status`."""
        now = time.monotonic()
        for session in self.all():
            lags = session.worker_lags(now)
            held = session.status().wire_bytes
            unverified = session.unverified_chunks()
            if session.dropped:  # its series are forgotten: not brought back
                continue
            for worker_id, lag in lags.items():
                self.metrics.set(
                    "Recorder/worker_lag_seconds", lag, session=session.name, worker=worker_id
                )
            self.metrics.set("Recorder/held_wire_bytes", held, session=session.name)
            self.metrics.set("Recorder/chunks_unverified", unverified, session=session.name)

    def restore(self, meta: dict[str, Any], blobs: list, *, limit: bool = False) -> Session:
        """Replace (or create) a session from a saved state, checked like live input.
        ``limit``: refuse a new session beyond max_sessions (recovery restores whatever
        the last checkpoint held)."""
        if not isinstance(meta, dict):
            raise snapshot.SnapshotError("state: expected a mapping")
        name = meta.get("name")
        if not isinstance(name, str):
            raise snapshot.SnapshotError(
                f"state.name: expected a session name, got {_wire.shown(repr(name))}"
            )
        try:
            check_session_name(name)
        except RequestError as exc:
            raise snapshot.SnapshotError(f"state.{exc}") from None
        config = snapshot.session_config(meta)
        session = self._new(name, config)
        try:
            snapshot.restore_session(session, meta, blobs, self.limits if limit else None)
        except BaseException:
            session.close()
            raise
        with self._lock:
            old = self._sessions.get(name)
            if limit and old is None and len(self._sessions) >= self.limits.max_sessions:
                session.close()
                raise snapshot.SnapshotError(
                    f"state.name: this server allows at most {self.limits.max_sessions} "
                    f"sessions and holds as many, got a new one ({_wire.shown(name)}); load "
                    "into an existing session, or drop one first"
                )
            self._sessions[name] = session
        if old is not None:
            old.close()
        return session

    def replay(self, record: records.Record | bytes) -> None:
        """Apply one write-ahead log record (nothing is logged again). A record that does
        not apply raises RequestError (recovery reports it); one that does not decode,
        ValueError."""
        if not isinstance(record, records.Record):
            record = records.decode(record)
        if record.kind == records.JOIN:
            join = record.body
            self.join(record.session, join.config, record.worker, join.acked, log=False)
            self.get(record.session).identity.restore(record.worker, join.holder)
        elif record.kind == records.LEAVE:
            self.leave(record.session, record.worker, expired=bool(record.body), log=False)
        elif record.kind == records.DROP:
            self.drop(record.session, log=False)
        elif record.kind == records.CHUNK:
            self.get(record.session).apply(record.worker, record.body, log=False)
        elif record.kind == records.SKIP:
            skipped = record.body
            self.get(record.session).skip(record.worker, skipped.sequence, cut=skipped.cut)
        elif record.kind == records.RESET:
            self.get(record.session).reset(log=False)
        elif record.kind == records.EPISODE:
            self.get(record.session).submit_episode(record.body, log=False)
        elif record.kind == records.DATASET_WRITE:
            self.get(record.session).dataset.intent(record.body)
        elif record.kind == records.DATASET_COMMIT:
            self.get(record.session).dataset.commit(record.body)

    def discard_all(self) -> None:
        """Forget every session without a trace (recovery, after a checkpoint that did not
        restore whole)."""
        with self._lock:
            gone = list(self._sessions.values())
            self._sessions.clear()
        for session in gone:
            session.close()
            self.metrics.forget(session=session.name)

    def lock_all(self, stack: ExitStack) -> list[Session]:
        """Hold every lock that guards a change, feeders drained (a consistent checkpoint)."""
        stack.enter_context(self._lock)
        sessions = sorted(self._sessions.values(), key=lambda s: s.name)
        for session in sessions:
            stack.enter_context(session.quiet())
        for session in sessions:
            session.drain()
        return sessions

    def drain(self) -> None:
        for session in self.all():
            session.drain()

    def close(self) -> None:
        for session in self.all():
            session.close()
