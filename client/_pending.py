"""A chunk between record() and its acknowledgement, how it goes on the wire, and what a
worker's stream counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _torch
from ._checks import _label
from ._messages import fill_array
from ._proto import recorder_pb2 as pb
from .errors import InvalidChunkError, RecorderError


@dataclass
class PendingChunk:
    """A chunk between record() and its acknowledgement."""

    sequence: int
    raw_bytes: int
    # Host arrays (or device arrays with a host copy under way) until encoded.
    arrays: dict[str, Any] | None
    request: pb.RecordRequest | None = None
    wire_bytes: int = 0
    # The chunk's layout, which fixes the worker's once the server stores it.
    schema: Any = None
    # Its time steps, and its done flags: counted by record() for host arrays (before the
    # sender threads wake), else at encoding or when asked.
    length: int = 0
    dones: int | None = None
    # Whether `dones` was known when the chunk was queued (it is in the running sum).
    dones_summed: bool = False
    # Small chunks that come quickly join the one queued before them while it waits (see
    # ChunkSender's linger): their layout (key, trailing shape, dtype per array, from
    # record()'s check), whether later chunks may still join it, when it was queued, the
    # arrays of those that joined, and whether this one joined another (no sequence then).
    signature: Any = None
    growable: bool = False
    queued_at: float = 0.0
    parts: list[dict[str, Any]] | None = None
    part_lengths: list[int] | None = None  # T of each call joined here, this one first
    merged: bool = False
    # N, and whether chunks were dropped just before this one (the server cuts there).
    envs: int = 0
    cut_before: bool = False
    fresh_start: bool = False  # a new instance's first chunk of a worker id used before

    def can_take(self, item: PendingChunk, cap: int, env_steps: int = 0) -> bool:
        """Whether ``item`` may join this chunk: it still waits, has the same layout and the
        same arrays, no dropped chunk lies between them, and the two stay within ``cap`` raw
        bytes and ``env_steps`` steps x envs (the server's cap; 0: not stated)."""
        return (
            self.growable
            and self.arrays is not None
            and not item.cut_before
            and item.signature is not None
            and (item.signature is self.signature or item.signature == self.signature)
            and self.raw_bytes + item.raw_bytes <= cap
            and (not env_steps or (self.length + item.length) * self.envs <= env_steps)
        )

    def take(self, item: PendingChunk) -> None:
        """Append ``item``'s steps: its arrays join along time when this chunk is encoded."""
        if self.parts is None:
            self.parts, self.part_lengths = [], [self.length]
        self.parts.append(item.arrays or {})
        self.part_lengths.append(item.length)
        self.raw_bytes += item.raw_bytes
        self.length += item.length
        item.merged = True

    def joined_arrays(self) -> dict[str, Any] | None:
        """The arrays of this chunk and of every chunk that joined it, joined along time."""
        arrays, parts = self.arrays, self.parts
        if arrays is None or not parts:
            return arrays
        every = [arrays, *parts]
        return {k: np.concatenate([_to_host(a[k]) for a in every]) for k in arrays}

    def count_dones(self) -> int:
        if self.dones is None and self.arrays is not None:
            every = [self.arrays, *(self.parts or ())]
            self.dones = sum(int(np.count_nonzero(_to_host(a["done"]))) for a in every)
        # Encoding counts them before it lets the arrays go.
        return self.dones if self.dones is not None else 0


@dataclass(frozen=True)
class StreamStats:
    """A worker's stream so far."""

    chunks_sent: int
    """Chunk messages sent, resends included."""
    chunks_acked: int
    chunks_dropped_full: int
    """Chunks the session did not store because it was full (max_episodes)."""
    chunks_dropped_in_flight: int
    """Chunks dropped at the in-flight cap (on_backpressure="drop")."""
    raw_bytes: int
    """Uncompressed bytes of the chunks the server stored."""
    wire_bytes: int
    """Bytes those chunks took on the wire."""
    reconnects: int
    sequences_lost: int = 0
    """Acknowledged chunks the server later reported lost (see DataLossError)."""
    chunks_joined: int = 0
    """record() calls whose chunk joined the one queued before it (linger_ms): sent in that
    chunk's message, under its sequence."""


@dataclass
class SenderStats:
    chunks_sent: int = 0
    chunks_acked: int = 0
    chunks_dropped_full: int = 0
    chunks_dropped_in_flight: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    reconnects: int = 0
    sequences_lost: int = 0
    chunks_joined: int = 0
    errors: list[RecorderError] = field(default_factory=list)


def _to_host(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return _torch.host_view(value) if _torch.is_tensor(value) else np.asarray(value)


def encode_chunk(item: PendingChunk, level: int, pack: bool = False) -> pb.RecordRequest:
    """The chunk's request; ``pack``: integer arrays packed where the server takes that."""
    arrays = item.arrays or {}
    request = pb.RecordRequest()
    chunk = request.chunk  # filled in place: no message copied
    chunk.sequence = item.sequence
    if item.part_lengths:  # the server hands the calls' episodes on call by call
        chunk.part_lengths.extend(item.part_lengths)
    if item.cut_before:
        chunk.cut_before = True
    if item.fresh_start:
        chunk.fresh_start = True
    fill_array(chunk.action, _to_host(arrays["action"]), level, pack)
    fill_array(chunk.reward, _to_host(arrays["reward"]), level, pack)
    done = _to_host(arrays["done"])
    if done.dtype != np.bool_:
        done = done.astype(bool)
    if item.dones is None:
        item.dones = int(np.count_nonzero(done))
    fill_array(chunk.done, done, level, pack)
    for name in ("outcome", "terminated", "truncated", "valid"):
        if name in arrays:
            fill_array(getattr(chunk, name), _to_host(arrays[name]), level, pack)
    for name, value in arrays.items():
        if name.startswith("state:"):
            named = chunk.states.add(name=name[6:])
        elif name.startswith("final:"):
            named = chunk.finals.add(name=name[6:])
        else:
            continue
        fill_array(named.array, _to_host(value), level, pack)
    return request


def encode_request(
    item: PendingChunk, level: int, pack: bool, max_bytes: int
) -> InvalidChunkError | None:
    """Set ``item.request`` (and ``wire_bytes``) to the chunk's request; or, when it cannot
    be encoded or is bigger than ``max_bytes`` (the gRPC cap: a bigger message would end the
    stream), to an empty chunk of its sequence, which the server refuses (the sequence stays
    gapless), and return the error that says why."""
    try:
        item.arrays, item.parts = item.joined_arrays(), None
        request = encode_chunk(item, level, pack)
    except Exception as exc:  # one bad array must not stall the chunks behind it
        error = InvalidChunkError(f"chunk {item.sequence} could not be encoded: {exc}")
    else:
        size = request.ByteSize()
        if size <= max_bytes:
            item.request, item.wire_bytes = request, size
            return None
        chunk = request.chunk
        sizes = [
            (getattr(chunk, k).ByteSize(), k)
            for k in ("action", "reward", "done", "outcome", "terminated", "truncated", "valid")
        ]
        sizes += [(a.ByteSize(), f"state:{a.name}") for a in chunk.states]
        sizes += [(a.ByteSize(), f"final:{a.name}") for a in chunk.finals]
        most, key = max(sizes)
        error = InvalidChunkError(
            f"chunk {item.sequence}: expected at most {max_bytes} bytes compressed (the gRPC "
            f"message cap), got {size}, {most} of them {_label(key)}; record fewer steps a "
            "chunk"
        )
    item.request = pb.RecordRequest(chunk=pb.Chunk(sequence=item.sequence))
    item.wire_bytes = item.request.ByteSize()
    return error
