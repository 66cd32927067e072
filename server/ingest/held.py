"""The chunks a worker's open episodes still need, and stored episodes read back from them.

With a trajectory store, each chunk's steps are keyed into the session's window
(`window.Ring`) and the chunk itself is held as the session keeps it (encoded, for finish()),
so holding it costs only its room in the ring. A finished episode the store keeps is not
fetched at once: it becomes a `HeldEpisode`, read from the chunks it spans only when first
needed (most are superseded before anything reads them).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..episodes import StoredChunk
from ..store import EpisodeArrays
from ..store.repository import blob_bound


class HeldChunk:
    """One held chunk: its place on the worker's time axis, the stored chunk (its encoded
    arrays: action, reward, state:<name>), what holding it costs, and why some of its steps
    could not be keyed (None: all could)."""

    __slots__ = ("t0", "length", "source", "nbytes", "error")

    def __init__(self, chunk: StoredChunk, nbytes: int) -> None:
        self.t0 = chunk.t0
        self.length = chunk.length
        self.source = chunk
        self.nbytes = nbytes
        self.error: ValueError | None = None

    @property
    def encoded(self) -> dict:
        """The arrays a stored episode reads, as the session holds them now (a frame found
        not to decode is replaced there)."""
        return {
            k: a
            for k, a in self.source.arrays.items()
            if k in ("action", "reward") or k.startswith("state:")
        }


@dataclass
class Part:
    """A chunk's finished episodes as the store records them: rows of the window, start
    times and lengths, which of the chunk's episodes these are (kept[i] is False for one
    too long for the held tail), each one's deferred source, and why the part cannot be
    recorded (a step of it could not be keyed), or None."""

    rows: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    kept: np.ndarray
    defer: Callable[[int], HeldEpisode]
    error: ValueError | None = None


class HeldChunks:
    """One worker's held chunks, oldest first, and its rows in the session's window."""

    def __init__(self, num_envs: int, prove: Callable[[StoredChunk], None] | None = None) -> None:
        self.num_envs = num_envs
        # Proves a chunk's frames decode before a stored episode decodes them.
        self.prove = prove
        self.row = -1
        self.end = 0  # the window holds this worker's steps first..end
        self.chunks: collections.deque[HeldChunk] = collections.deque()
        self.nbytes = 0
        # The blob size bound of this worker's episodes (its fields are fixed by the session).
        self.bounds: EpisodeBound | None = None

    @property
    def first(self) -> int:
        """The oldest step held."""
        return self.chunks[0].t0 if self.chunks else self.end

    def hold(self, chunk: StoredChunk, width: int) -> HeldChunk:
        # What holding a chunk costs here is its steps' room in the ring (at most int64 keys
        # and float64 rewards): the session holds the chunk itself anyway.
        held = HeldChunk(chunk, chunk.length * self.num_envs * 8 * (width + 1))
        self.chunks.append(held)
        self.nbytes += held.nbytes
        return held

    def trim(self, oldest_open: int, max_bytes: int) -> None:
        """Drop the chunks no open episode needs, and the oldest while over ``max_bytes``
        (an episode reaching back past them is then counted, never stored truncated)."""
        while self.chunks:
            chunk = self.chunks[0]
            over = self.nbytes > max_bytes and len(self.chunks) > 1
            if chunk.t0 + chunk.length > oldest_open and not over:
                break
            self.chunks.popleft()
            self.nbytes -= chunk.nbytes

    def gather(
        self,
        flagged_step: Callable[..., int | None],
        env: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
    ) -> Part:
        """The finished episodes (env, start, end) as the store reads them from the window.
        Episodes whose beginning was dropped under the byte cap are left out (kept[i] is
        False); ``flagged_step(rows, start, lengths)`` finds a step that could not be keyed."""
        held = list(self.chunks)
        kept = start >= held[0].t0
        if not kept.all():
            env, start, end = env[kept], start[kept], end[kept]
        lengths = end - start
        rows = env + self.row
        error = None
        bad = flagged_step(rows, start, lengths) if env.size else None
        if bad is not None:
            error = next(
                (c.error for c in held if c.t0 <= bad < c.t0 + c.length and c.error is not None),
                ValueError("states: a cell field could not be keyed"),
            )
        if self.bounds is None:
            self.bounds = EpisodeBound(held[-1].encoded)
        bounds = self.bounds
        episodes = (env.tolist(), start.tolist(), end.tolist())
        starts: list[int] = []

        def defer(i: int) -> HeldEpisode:
            if not starts:  # only a few episodes of a chunk are stored
                starts.extend(chunk.t0 for chunk in held)
            e, s, t = episodes[0][i], episodes[1][i], episodes[2][i]
            lo = max(bisect.bisect_right(starts, s) - 1, 0)
            hi = bisect.bisect_left(starts, t, lo)
            return HeldEpisode(self, e, s, t, tuple(held[lo:hi]), bounds(t - s))

        return Part(rows, start, lengths, kept, defer, error)


class EpisodeBound:
    """repository.blob_bound of a worker's episodes by length, from its chunks' fields: what
    a stored episode counts until it is encoded."""

    def __init__(self, encoded: dict) -> None:
        self.fields = []
        for key, arr in encoded.items():
            name = _EPISODE_NAMES.get(key, "state/" + key[6:])
            per_step = arr.dtype.itemsize * math.prod(arr.shape[2:])
            self.fields.append((name, arr.dtype.str, tuple(arr.shape[2:]), per_step))

    def __call__(self, length: int) -> int:
        return blob_bound(self.fields, length)


_EPISODE_NAMES = {"action": "actions", "reward": "rewards"}


class HeldEpisode:
    """A stored episode not encoded yet (repository.DeferredEpisode): environment ``env``'s
    steps ``start..end-1`` of a worker, read from the encoded chunks it spans."""

    __slots__ = ("group", "env", "first", "end", "chunks", "bound")

    def __init__(self, group, env: int, start: int, end: int, chunks, bound: int) -> None:
        self.group, self.env, self.first, self.end = group, env, start, end
        self.chunks, self.bound = chunks, bound

    @property
    def length(self) -> int:
        return self.end - self.first

    def fetch(self, cache: dict) -> EpisodeArrays:
        """The episode's arrays; ``cache`` keeps decoded chunks by start step for the fetches
        after this one (in start order), which never need a chunk that ends before them."""
        for t0 in [t0 for t0, (end, _) in cache.items() if end <= self.first]:
            del cache[t0]
        pieces: dict[str, list[np.ndarray]] = {}
        for chunk in self.chunks:
            hit = cache.get(chunk.t0)
            if hit is None:
                if self.group.prove is not None and chunk.source.unverified:
                    self.group.prove(chunk.source)
                hit = cache[chunk.t0] = (
                    chunk.t0 + chunk.length,
                    {k: a.decode() for k, a in chunk.encoded.items()},
                )
            lo = max(self.first, chunk.t0) - chunk.t0
            hi = min(self.end, chunk.t0 + chunk.length) - chunk.t0
            for k, a in hit[1].items():
                pieces.setdefault(k, []).append(a[lo:hi, self.env])
        joined = {k: v[0].copy() if len(v) == 1 else np.concatenate(v) for k, v in pieces.items()}
        states = {k[6:]: v for k, v in joined.items() if k.startswith("state:")}
        return EpisodeArrays(joined["action"], joined["reward"], states)
