"""Who may write as a worker: one live stream per (session, worker_id), checked claims of
acknowledged chunks, and the names of dropped sessions.

A lease ties a worker id to the recorder instance that joined with it
(``JoinRequest.instance_id``, a random id each RolloutRecorder makes once). It is held while
one of that instance's Record streams is open, and for a grace period after its join or after
its last stream ended, so that its own reconnect finds it again; another instance is refused
(WORKER_IN_USE) meanwhile. A client that names no instance (an empty id) holds the worker id
only while its stream is open: it has nothing to prove a reconnect is its own. Leave and expiry release it. Each stream opened takes the next
epoch of the lease: only the newest stream writes (an older one of the same instance that
the server has not seen end yet is refused), so a reconnect never races its old stream.

The instance id is never shown to another client: knowing it is what proves "its own". The
server keeps only a digest of it, which checkpoints and the log carry, so that after a restart
the holder's reconnect finds its lease again (for a grace period) and a stranger does not.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from recorder_client import _wire

from .errors import ErrorKind, RequestError, invalid
from .loss import LossCause, LossKind

# Highest chunk sequence a worker may use or claim acknowledged: 2**40 chunks (35 years at
# 1,000 a second), so that counts summed over any number of workers stay in 64 bits.
MAX_SEQUENCE = 1 << 40

# How long a lease outlives the join or stream that last held it, for its own reconnect: the
# client's reconnect backoff tops out at 2 s, so a live holder is back well within this.
GRACE_S = 10.0

# Dropped sessions remembered, and recorder instances remembered across all of them (the
# oldest drops are forgotten beyond either).
MAX_TOMBSTONES = 4096
MAX_TOMBSTONE_MEMBERS = 1 << 18
# Instances a session remembers besides its lease holders (the most recent joins).
MAX_INSTANCES = 4096

# What each cause of loss says, before its detail.
_SAYS = {
    LossKind.TORN_TAIL: "the write-ahead log ended in a torn record",
    LossKind.CHECKPOINT_FALLBACK: "the newest checkpoint did not load and an older one was used",
    LossKind.DROP: "the session was dropped",
    LossKind.UNSYNCED_TAIL: "the server stopped before its write-ahead log synced them",
}


def describe(cause: LossCause) -> str:
    """A loss cause for people."""
    return f"{_SAYS[cause.kind]}: {cause.detail}" if cause.detail else _SAYS[cause.kind]


_shown = _wire.shown


def proof(instance: str) -> str:
    """What the server keeps of an instance id ("" for none)."""
    return hashlib.sha256(instance.encode()).hexdigest()[:32] if instance else ""


def _utc(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


def check_session_name(name: str) -> str:
    try:
        return _wire.check_session_name(name)
    except ValueError as exc:
        raise RequestError(ErrorKind.INVALID_NAME, str(exc)) from None


def check_worker_id(worker_id: str) -> str:
    try:
        return _wire.check_worker_id(worker_id)
    except ValueError as exc:
        raise RequestError(ErrorKind.INVALID_NAME, str(exc)) from None


def check_acked(acked: int) -> int:
    if not 0 <= acked <= MAX_SEQUENCE:
        raise invalid(f"acked_sequence: expected 0..{MAX_SEQUENCE}, got {acked}")
    return acked


@dataclass
class Lease:
    instance: str
    """proof() of the holder's instance id."""
    since: float
    """Wall clock when this instance took the worker id."""
    idle_since: float
    """Monotonic time since which no stream of it is open (its join, or its last stream's
    end); meaningless while one is."""
    epoch: int = 0
    streams: dict[int, Callable[[RequestError], None]] = field(default_factory=dict)
    """Open streams by epoch, each with what ends it from outside (a drop)."""


class Identities:
    """The leases of one session's workers, and who ever joined it."""

    def __init__(self, session: str, grace: float | None = None) -> None:
        self.session = session
        self.grace = GRACE_S if grace is None else grace
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # proof() of the instances that joined lately (a drop refuses these and every lease
        # holder afterwards), oldest first.
        self._instances: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Workers that joined this server process: it knows every ack it sent them, so a
        # claim above what it holds has no cause it could name.
        self.joined_here: set[str] = set()
        # worker -> the cause of the loss its last join counted, until its reply takes it.
        self.last_loss: dict[str, LossCause] = {}

    def _joined(self, instance: str) -> None:
        # Call with the lock held.
        self._instances[instance] = None
        self._instances.move_to_end(instance)
        while len(self._instances) > MAX_INSTANCES:
            self._instances.popitem(last=False)

    def members(self) -> set[str]:
        """proof() of the recorders a drop must refuse: every holder, and recent joiners."""
        with self._lock:
            return set(self._instances) | {lease.instance for lease in self._leases.values()}

    # -- leases ----------------------------------------------------------
    def _refuse(self, worker_id: str, lease: Lease, now: float) -> RequestError:
        retry_after = None
        if lease.streams:
            state = "with a Record stream open"
        else:
            idle = now - lease.idle_since
            retry_after = max(0.0, self.grace - idle)
            state = (
                f"without a stream for {idle:.1f} s (kept {self.grace - idle:.1f} s more for "
                "its own reconnect)"
            )
        return RequestError(
            ErrorKind.WORKER_IN_USE,
            f"worker_id: {_shown(worker_id)} of session {self.session!r} is held by another "
            f"recorder since {_utc(lease.since)}, {state}; expected a worker id no live "
            "recorder holds. Give each recorder its own worker_id (two trainers given one "
            "id would overwrite each other), or close the other recorder first",
            retry_after=retry_after,
        )

    def _live_other(self, worker_id: str, instance: str, now: float) -> Lease | None:
        # Call with the lock held.
        lease = self._leases.get(worker_id)
        if lease is None or lease.instance == instance:
            return None
        if lease.streams:
            return lease
        # The grace is for the holder's own reconnect: one that named no instance cannot
        # prove a reconnect is its own, so its id is free once its streams end.
        if lease.instance and now - lease.idle_since < self.grace:
            return lease
        return None

    def _refuse_other(self, worker_id: str, instance: str, now: float) -> None:
        # Call with the lock held: raise WORKER_IN_USE when another instance's lease is live.
        lease = self._live_other(worker_id, instance, now)
        if lease is not None:
            raise self._refuse(worker_id, lease, now)

    def check(self, worker_id: str, instance: str) -> None:
        """Raise WORKER_IN_USE when another instance holds the worker id."""
        instance, now = proof(instance), time.monotonic()
        with self._lock:
            self._refuse_other(worker_id, instance, now)

    def take(self, worker_id: str, instance: str) -> None:
        """A join: the instance holds the worker id (again), its grace counted from now."""
        instance, now = proof(instance), time.monotonic()
        with self._lock:
            self._refuse_other(worker_id, instance, now)
            lease = self._leases.get(worker_id)
            if lease is None or lease.instance != instance:
                self._leases[worker_id] = Lease(instance, time.time(), now)
            elif not lease.streams:
                lease.idle_since = now
            self._joined(instance)
            self.joined_here.add(worker_id)

    def open(self, worker_id: str, instance: str, end: Callable[[RequestError], None]) -> int:
        """A Record stream of this instance opens; returns its epoch (the newest)."""
        instance, now = proof(instance), time.monotonic()
        with self._lock:
            self._refuse_other(worker_id, instance, now)
            lease = self._leases.get(worker_id)
            if lease is None or lease.instance != instance:
                lease = self._leases[worker_id] = Lease(instance, time.time(), now)
                self._joined(instance)
            lease.epoch += 1
            lease.streams[lease.epoch] = end
            return lease.epoch

    def current(self, worker_id: str, epoch: int) -> bool:
        """Whether the stream of this epoch is the worker's newest (read without the lock:
        one chunk's check)."""
        lease = self._leases.get(worker_id)
        return lease is not None and lease.epoch == epoch

    def superseded(self, worker_id: str) -> RequestError:
        return RequestError(
            ErrorKind.WORKER_IN_USE,
            f"worker_id: a newer Record stream of {_shown(worker_id)} in session "
            f"{self.session!r} was opened; this one no longer writes",
        )

    def close(self, worker_id: str, epoch: int) -> None:
        """A stream ended: once none is open, the grace period starts."""
        with self._lock:
            lease = self._leases.get(worker_id)
            if lease is None or lease.streams.pop(epoch, None) is None:
                return
            if not lease.streams:
                lease.idle_since = time.monotonic()

    def release(self, worker_id: str, instance: str | None = None) -> None:
        """Leave (``instance``: the leaving one; another instance's live lease stays, and
        refuses it) or expiry (None: released unless a stream is open)."""
        now = time.monotonic()
        if instance is not None:
            instance = proof(instance)
        with self._lock:
            lease = self._leases.get(worker_id)
            if lease is None:
                return
            if instance is not None and lease.instance != instance:
                self._refuse_other(worker_id, instance, now)
            if not lease.streams:
                del self._leases[worker_id]

    def holder(self, worker_id: str) -> str:
        """proof() of the instance holding the worker id ("" for none named)."""
        lease = self._leases.get(worker_id)
        return "" if lease is None else lease.instance

    def restore(self, worker_id: str, holder: object) -> None:
        """The holder a checkpoint or the log recorded (after a restart): its reconnect
        finds the lease for a grace period from now. Anything but a digest: none."""
        with self._lock:
            if isinstance(holder, str) and 0 < len(holder) <= 64:
                self._leases[worker_id] = Lease(holder, time.time(), time.monotonic())
                self._joined(holder)
            else:
                self._leases.pop(worker_id, None)

    def clear(self) -> None:
        """Forget every lease without an open stream (a loaded state names holders of
        another run)."""
        with self._lock:
            for worker_id in [w for w, lease in self._leases.items() if not lease.streams]:
                del self._leases[worker_id]

    def end_streams(self, error: RequestError) -> None:
        """End every open stream with ``error`` (the session is dropped)."""
        with self._lock:
            ends = [end for lease in self._leases.values() for end in lease.streams.values()]
        for end in ends:
            end(error)


def check_claim(
    session: str,
    worker_id: str,
    acked: int,
    held: int,
    causes: list[LossCause],
    start_cause: LossCause | None,
    joined_here: set[str],
) -> LossCause | None:
    """The cause of the loss a join claiming ``acked`` reveals (None: no loss), or INVALID
    when the server cannot have acknowledged that much.

    ``held``: the highest sequence the session holds for the worker. A cause that recovery
    recorded for this worker (or for all of the session's) explains any claim above it; so
    does ``start_cause`` (what the fsync policy may have lost when the server last stopped)
    for a worker not in ``joined_here`` (the workers that joined this process: every ack
    this process sent, it still holds)."""
    if acked <= held:
        return None
    for cause in causes:
        if cause.worker_id in ("", worker_id) and cause.first_sequence <= held + 1:
            return cause
    if start_cause is not None and worker_id not in joined_here:
        return start_cause
    raise invalid(
        f"acked_sequence: expected at most {held} for worker {_shown(worker_id)} of session "
        f"{session!r} (the highest sequence this server holds or could have acknowledged for "
        f"it: no torn log tail, checkpoint fallback or unsynced log explains more), got {acked}"
    )


def start_cause(log: bool, fsync: str, window_s: float) -> LossCause | None:
    """What the last stop may have cost acknowledged chunks, by the log's fsync policy
    (server/durability/wal.py): with "always" nothing (each ack follows its fsync); with
    "batch" or "never", or without a log, a power cut loses records a previous process
    acknowledged, and the log cannot say how many."""
    if not log:
        detail = "the server runs without a write-ahead log (--no-wal), and a restart keeps none"
    elif fsync == "batch":
        detail = (
            f"--wal-fsync batch syncs every {window_s * 1000:.0f} ms, and a power cut loses "
            "what came since"
        )
    elif fsync == "never":
        detail = (
            "--wal-fsync never leaves syncing to the OS, and a power cut loses what it had not "
            "written"
        )
    else:
        return None
    return LossCause(LossKind.UNSYNCED_TAIL, detail)


@dataclass(frozen=True)
class Tombstone:
    dropped_unix: float
    instances: frozenset[str]


class Tombstones:
    """Dropped sessions by name, with the instances that had joined them: those get
    SESSION_DROPPED from then on, even after a new recorder created the session again."""

    def __init__(self, limit: int = MAX_TOMBSTONES, members: int = MAX_TOMBSTONE_MEMBERS) -> None:
        self._limit = limit
        self._members_limit = members
        self._members = 0
        self._lock = threading.Lock()
        self._dropped: collections.OrderedDict[str, Tombstone] = collections.OrderedDict()

    def add(self, name: str, instances: set[str], when: float | None = None) -> None:
        """``instances``: proof() of each recorder that joined the session."""
        self._put(proof(name), instances, when)

    def _put(self, key: str, instances: set[str], when: float | None) -> None:
        # Keyed by proof(name): a checkpoint of tombstones holds no session name.
        with self._lock:
            old = self._dropped.pop(key, None)
            if old is not None:
                self._members -= len(old.instances)
            members = frozenset(instances) | (old.instances if old else frozenset())
            self._dropped[key] = Tombstone(time.time() if when is None else when, members)
            self._members += len(members)
            while len(self._dropped) > 1 and (
                len(self._dropped) > self._limit or self._members > self._members_limit
            ):
                _, gone = self._dropped.popitem(last=False)
                self._members -= len(gone.instances)

    def entries(self) -> list[list]:
        """Every tombstone as JSON-ready ``[proof(name), dropped_unix, [proofs]]``, oldest
        first (for a checkpoint: a restart keeps refusing the dropped sessions' recorders)."""
        with self._lock:
            return [[n, t.dropped_unix, sorted(t.instances)] for n, t in self._dropped.items()]

    def load(self, entries: object) -> None:
        """Add what entries() gave; anything malformed is skipped."""
        for entry in entries if isinstance(entries, list) else ():
            if not (isinstance(entry, list) and len(entry) == 3):
                continue
            name, when, members = entry
            if (
                isinstance(name, str)
                and isinstance(when, (int, float))
                and isinstance(members, list)
                and all(isinstance(m, str) for m in members)
            ):
                self._put(name, set(members), float(when))

    def get(self, name: str) -> Tombstone | None:
        with self._lock:
            return self._dropped.get(proof(name))

    def check(self, name: str, instance: str, acked: int = 0) -> None:
        """Raise SESSION_DROPPED for a recorder of a dropped session. An instance that named
        none is taken for one of the dropped session's when it claims acknowledged chunks."""
        stone = self.get(name)
        if stone is None:
            return
        if proof(instance) in stone.instances and (instance or acked > 0):
            raise dropped_error(name, stone.dropped_unix)


def dropped_error(name: str, when: float) -> RequestError:
    return RequestError(
        ErrorKind.SESSION_DROPPED,
        f"session: {name!r} was dropped at {_utc(when)}; this recorder's worker no longer "
        "records into it, and a reconnect does not create it again. Make a new recorder to "
        "record into a new session of that name",
    )
