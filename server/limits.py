"""Bounds on what one server accepts: below the session registry, which enforces them, and
the state loader (durability/snapshot.py), which checks a saved state against them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds on what one server accepts."""

    max_sessions: int = 64
    """Sessions held at once."""
    max_workers_per_session: int = 1024
    """Active workers one session takes (a worker that left or expired does not count)."""
    session_ttl_s: float = 0.0
    """Drop a session unused this long (no join, chunk, finish, reset or store verb);
    0: never."""
    worker_ttl_s: float = 600.0
    """A worker that neither joined nor sent a chunk this long expires: it stops counting
    against max_workers_per_session, and its chunks stay (it resumes by joining again);
    0: never."""
    max_array_bytes: int = 1 << 31
    """Largest raw size of one received array."""
    max_chunk_bytes: int = 256 << 20
    """Largest raw size of one chunk or submitted episode, all its arrays together, as their
    headers declare (checked before anything is decompressed). 256 MiB holds a chunk of
    T=128 steps of N=64 environments with 84x84x4 uint8 observations (231 MB)."""
    max_chunk_env_steps: int = 1 << 21
    """Most env steps (T x N, an empty axis counted as one) in one chunk, or steps in one
    submitted episode: the server keeps about 200 bytes of bookkeeping per env step while it
    splits a chunk, whatever its arrays weigh. 2**21 is T=128 steps of N=16,384
    environments."""
    max_upload_bytes: int = 1 << 30
    """Largest runtime state or store checkpoint a client may load: as sent, and as decoded
    when it arrives compressed."""
