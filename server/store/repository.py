"""The trajectory repository: compressed episodes, reference-counted by the archive.

A trajectory's reference count is the number of cells whose best reference points into it.
Only trajectories that some cell references on arrival are stored (an episode that improves no
cell is dropped at once and counted as ``discarded``, never as an eviction). When the stored
compressed bytes exceed the capacity, unreferenced trajectories are evicted oldest (smallest
id) first until the total fits or none is left; referenced ones are never evicted, so the total
may stay above the capacity (``over_capacity`` in the stats). Not thread-safe: the store locks.

A trajectory may also be stored *deferred*: as a source that reads it from the chunks the
session keeps anyway (compressed, for finish()), encoded only when first needed (read,
checkpointed, or when the capacity has to be decided on exact sizes). Until then it counts
an upper bound of its blob's size, so a deferred trajectory never makes the repository evict
what storing it encoded would not: once the bounded total exceeds the capacity, every deferred
trajectory is encoded and the rule above is applied to the exact sizes. Most stored
trajectories are superseded before anything reads them; those are never encoded at all.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import zstandard

from . import codec
from .sources import DeferredEpisode, EpisodeArrays

_STATE_PREFIX = "state/"


def encode_episode(
    episode: EpisodeArrays, level: int = 3, *, compressor: zstandard.ZstdCompressor | None = None
) -> bytes:
    """An episode as one zstd-compressed codec container (``compressor``: a reusable
    :func:`codec.compressor` of the same level; same bytes)."""
    arrays = {"actions": episode.actions, "rewards": episode.rewards}
    arrays.update({_STATE_PREFIX + k: v for k, v in episode.states.items()})
    return codec.compress(codec.pack_arrays(arrays), level, using=compressor)


def decode_episode(blob: bytes) -> EpisodeArrays:
    """Inverse of :func:`encode_episode` (read-only arrays)."""
    arrays, _ = codec.unpack_arrays(codec.decompress(blob))
    states = {k[len(_STATE_PREFIX) :]: v for k, v in arrays.items() if k.startswith(_STATE_PREFIX)}
    return EpisodeArrays(actions=arrays["actions"], rewards=arrays["rewards"], states=states)


def blob_bound(field_bytes: Iterable[tuple[str, str, tuple[int, ...], int]], length: int) -> int:
    """An upper bound of :func:`encode_episode`'s size for an episode of ``length`` steps
    whose arrays are ``(name, dtype.str, trailing shape, bytes per step)``: the packed
    container (header bounded generously) under zstd's worst-case bound."""
    packed = len(codec.MAGIC) + 4 + 64  # magic, header length, JSON braces and meta
    for name, dtype, trailing, per_step in field_bytes:
        dims = ",".join(str(d) for d in (length, *trailing))
        # One header entry (its numbers at most 20 digits each), alignment, the bytes.
        packed += 100 + len(name) + len(dtype) + len(dims) + 63 + length * per_step
    # ZSTD_COMPRESSBOUND, plus a frame header and checksum margin.
    small = ((128 << 10) - packed) >> 11 if packed < (128 << 10) else 0
    return packed + (packed >> 8) + small + 32


def episode_bound(episode: EpisodeArrays) -> int:
    """:func:`blob_bound` of an episode's own arrays."""
    arrays = {"actions": episode.actions, "rewards": episode.rewards}
    arrays.update({_STATE_PREFIX + k: v for k, v in episode.states.items()})
    fields = [
        (k, a.dtype.str, a.shape[1:], a.dtype.itemsize * math.prod(a.shape[1:]))
        for k, a in arrays.items()
    ]
    return blob_bound(fields, episode.length)


@dataclass
class _Entry:
    blob: bytes | None
    length: int
    refcount: int
    source: DeferredEpisode | None = None

    @property
    def nbytes(self) -> int:
        return len(self.blob) if self.blob is not None else self.source.bound


class TrajectoryRepository:
    """Stored trajectories by id, with a byte capacity."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: dict[int, _Entry] = {}
        self._unreferenced: list[int] = []  # min-heap of stored ids with refcount 0
        self.total_bytes = 0
        self.evictions = 0
        self.discarded = 0
        self.next_id = 0
        self._deferred: set[int] = set()
        self._compressor: zstandard.ZstdCompressor | None = None

    @property
    def compressor(self) -> zstandard.ZstdCompressor:
        """The one zstd compressor every blob of this repository is encoded with: built on
        first use and reused under the store's lock (a context per store call cost ~25 us
        per call's first episode and its allocation)."""
        if self._compressor is None:
            self._compressor = codec.compressor()
        return self._compressor

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, trajectory_id: int) -> bool:
        return trajectory_id in self._entries

    def allocate_id(self) -> int:
        """A fresh trajectory id (one per recorded episode, stored or not)."""
        tid = self.next_id
        self.next_id += 1
        return tid

    def add(self, trajectory_id: int, blob: bytes, length: int, refcount: int) -> list[int]:
        """Store a trajectory referenced by ``refcount`` cells; returns the ids evicted."""
        if refcount <= 0:
            self.discarded += 1
            return []
        self._entries[trajectory_id] = _Entry(blob, length, refcount)
        self.total_bytes += len(blob)
        return self.evict_to_capacity()

    def add_deferred(
        self, trajectory_id: int, source: DeferredEpisode, length: int, refcount: int
    ) -> list[int]:
        """:meth:`add`, with the blob encoded from ``source`` only when first needed."""
        if refcount <= 0:
            self.discarded += 1
            return []
        if source.length != length:
            raise ValueError(f"source: expected an episode of {length} steps, got {source.length}")
        self._entries[trajectory_id] = _Entry(None, length, refcount, source)
        self._deferred.add(trajectory_id)
        self.total_bytes += source.bound
        return self.evict_to_capacity()

    @property
    def deferred(self) -> int:
        """Stored trajectories not encoded yet."""
        return len(self._deferred)

    def encode_deferred(self, ids: Iterable[int] | None = None) -> None:
        """Encode deferred trajectories (all, or those of ``ids``), each group's chunks read
        once: sources sorted by group and first step, a chunk dropped from the cache once
        the sources after it start later."""
        todo = self._deferred if ids is None else self._deferred.intersection(ids)
        if not todo:
            return
        order = sorted(
            todo, key=lambda t: (id(self._entries[t].source.group), self._entries[t].source.first)
        )
        cache: dict = {}
        group = None
        for tid in order:
            entry = self._entries[tid]
            source = entry.source
            if source.group is not group:
                group = source.group
                cache.clear()
            episode = source.fetch(cache)
            if episode.length != entry.length:
                raise RuntimeError(
                    f"repository: trajectory {tid} read back {episode.length} steps, "
                    f"stored as {entry.length}"
                )
            entry.blob = encode_episode(episode, compressor=self.compressor)
            entry.source = None
            self.total_bytes += len(entry.blob) - source.bound
            self._deferred.discard(tid)

    def discard(self, count: int) -> None:
        """Count ``count`` episodes that no cell referenced on arrival (never stored)."""
        self.discarded += count

    def release(self, released: dict[int, int]) -> None:
        """Drop references (old best trajectories of improved cells)."""
        for tid, n in released.items():
            entry = self._entries[tid]
            entry.refcount -= n
            if entry.refcount < 0:
                raise RuntimeError(f"repository: trajectory {tid} refcount below zero")
            if entry.refcount == 0:
                heapq.heappush(self._unreferenced, tid)

    def evict_to_capacity(self) -> list[int]:
        """Evict unreferenced trajectories, oldest first, while over capacity."""
        evicted = []
        if self.total_bytes > self.capacity_bytes and self._deferred and self._unreferenced:
            # Decided on exact sizes, as if every trajectory had been encoded on arrival.
            self.encode_deferred()
        while self.total_bytes > self.capacity_bytes and self._unreferenced:
            tid = heapq.heappop(self._unreferenced)
            entry = self._entries.pop(tid)
            self.total_bytes -= entry.nbytes
            self._deferred.discard(tid)
            self.evictions += 1
            evicted.append(tid)
        return evicted

    def blob(self, trajectory_id: int) -> bytes | None:
        entry = self._entries.get(trajectory_id)
        if entry is None:
            return None
        if entry.blob is None:
            self.encode_deferred([trajectory_id])
        return entry.blob

    def refcount(self, trajectory_id: int) -> int | None:
        entry = self._entries.get(trajectory_id)
        return None if entry is None else entry.refcount

    def ids(self) -> list[int]:
        return sorted(self._entries)

    @property
    def unreferenced(self) -> int:
        return len(self._unreferenced)

    def stats(self) -> dict[str, float]:
        return {
            "repository_trajectories": float(len(self._entries)),
            "repository_unreferenced": float(len(self._unreferenced)),
            "repository_bytes": float(self.total_bytes),
            "repository_deferred": float(len(self._deferred)),
            "repository_capacity_bytes": float(self.capacity_bytes),
            "repository_over_capacity": float(self.total_bytes > self.capacity_bytes),
            "repository_evictions": float(self.evictions),
            "repository_discarded": float(self.discarded),
        }

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Ids, lengths, refcounts and all blobs concatenated (with offsets)."""
        self.encode_deferred()
        ids = sorted(self._entries)
        entries = [self._entries[i] for i in ids]
        sizes = np.array([len(e.blob) for e in entries], dtype=np.int64)
        return {
            "ids": np.array(ids, dtype=np.int64),
            "lengths": np.array([e.length for e in entries], dtype=np.int64),
            "refcounts": np.array([e.refcount for e in entries], dtype=np.int64),
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "blobs": np.frombuffer(b"".join(e.blob for e in entries), dtype=np.uint8),
            "counters": np.array([self.next_id, self.evictions, self.discarded], dtype=np.int64),
        }

    @classmethod
    def from_state_arrays(
        cls, capacity_bytes: int, arrays: dict[str, np.ndarray]
    ) -> TrajectoryRepository:
        """Rebuild from :meth:`state_arrays`; refcounts are checked by the store afterwards."""
        names = ("ids", "lengths", "refcounts", "offsets", "blobs", "counters")
        missing = sorted(set(names) - set(arrays))
        if missing:
            raise ValueError(f"repository: checkpoint lacks arrays {missing}")
        ids, lengths, refs, offsets = (
            np.asarray(arrays[n], dtype=np.int64)
            for n in ("ids", "lengths", "refcounts", "offsets")
        )
        blobs = np.asarray(arrays["blobs"], dtype=np.uint8)
        n = ids.shape[0]
        if lengths.shape != (n,) or refs.shape != (n,) or offsets.shape != (n + 1,):
            raise ValueError("repository: inconsistent array shapes in checkpoint")
        if n and (offsets[0] != 0 or offsets[-1] != blobs.size or np.any(np.diff(offsets) < 0)):
            raise ValueError("repository: blob offsets do not cover the blob bytes")
        repo = cls(capacity_bytes)
        raw = blobs.tobytes()
        for i in range(n):
            tid = int(ids[i])
            blob = raw[int(offsets[i]) : int(offsets[i + 1])]
            repo._entries[tid] = _Entry(blob, int(lengths[i]), int(refs[i]))
            repo.total_bytes += len(blob)
            if refs[i] == 0:
                repo._unreferenced.append(tid)
        heapq.heapify(repo._unreferenced)
        repo.next_id, repo.evictions, repo.discarded = (int(v) for v in arrays["counters"][:3])
        return repo
