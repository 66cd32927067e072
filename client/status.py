"""What `RolloutRecorder.status()` returns: a session's counters and its workers'."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerStatus:
    """One worker of a session, as the server counts it."""

    worker_id: str
    worker_index: int
    """Place in join order, from 0: the order of its episodes in finish()."""
    num_envs: int
    """Environments per chunk (N); 0 before its first stored chunk."""
    last_sequence: int
    """Highest chunk sequence number the server has taken from it."""
    chunks_stored: int
    chunks_dropped: int
    steps: int
    """Sum of T over its stored chunks."""
    episodes_finished: int
    raw_bytes: int
    """Uncompressed bytes of its stored chunks."""
    wire_bytes: int
    """Bytes of its stored chunks as they travelled (compressed)."""
    sequences_lost: int = 0
    """Acknowledged chunks the server lost (a power cut under batched fsync); the worker
    went on from the next sequence."""
    active: bool = True
    """False once the worker left (close()) or expired (--worker-ttl): it no longer counts
    against the worker limit, and its stored chunks stay."""
    idle_seconds: float = field(default=0.0, compare=False)
    """Seconds since it last joined or sent a chunk (a clock reading: not compared)."""
    joined_unix: float = field(default=0.0, compare=False)
    """When it first joined, in seconds since the Unix epoch (the server's clock)."""


@dataclass(frozen=True)
class SessionStatus:
    """A session's counters; every worker of it in join order."""

    session: str
    is_full: bool
    """Whether the done count has reached max_episodes (over every worker)."""
    num_recorded_steps: int
    """Sum of T over the stored chunks of every worker."""
    episodes_finished: int
    """Done flags counted over every stored chunk of every worker."""
    chunks_stored: int
    chunks_dropped: int
    raw_bytes: int
    wire_bytes: int
    max_episodes: int | None
    record_states: bool
    state_fields: tuple[str, ...]
    workers: tuple[WorkerStatus, ...]
    sequences_lost: int = 0
    """Acknowledged chunks lost over every worker."""
    idle_seconds: float = field(default=0.0, compare=False)
    """Seconds since the session was last used; --session-ttl drops it after that long (a
    clock reading: not compared)."""
