"""The dataset sink's gather: finished episodes' steps out of the stored chunks, as flat
per-field arrays in episode order, a row group of whole episodes at a time.

Each chunk a row group spans is decoded once into a buffer reused for every chunk, and its
steps are copied to their rows through one flat index (t * N + e) shared by every field: a
row group costs its own steps plus one decoded chunk per field, however long its episodes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import numpy as np


def spanned(chunks: list, lo: int, hi: int) -> list:
    """The chunks (in time order) holding any of steps lo..hi-1."""
    i = bisect.bisect_right(chunks, lo, key=lambda c: c.t0) - 1
    j = bisect.bisect_left(chunks, hi, key=lambda c: c.t0)
    return chunks[max(i, 0) : j]


def batches(parts: list, step_bytes: int, budget: int) -> Iterator[list]:
    """The sink's parts (per worker: id, index, env, start, end, chunks, store ids, flags) cut into row groups of whole episodes, about ``budget`` bytes of
    steps each (at least one episode); a row group may hold several workers' episodes."""
    batch: list = []
    room = budget
    for worker_id, index, env, start, end, chunks, ids, flags in parts:
        size = np.cumsum(end - start) * step_bytes
        lo = 0
        while lo < env.size:
            base = int(size[lo - 1]) if lo else 0
            hi = int(np.searchsorted(size, base + room, side="right"))
            if hi <= lo and batch:
                yield batch
                batch, room = [], budget
                continue
            hi = max(hi, lo + 1)
            cut = slice(lo, hi)
            batch.append(
                (
                    worker_id,
                    index,
                    env[cut],
                    start[cut],
                    end[cut],
                    chunks,
                    None if ids is None else ids[cut],
                    flags[cut].copy(),
                )
            )
            room -= int(size[hi - 1]) - base
            lo = hi
            if room <= 0:
                yield batch
                batch, room = [], budget
    if batch:
        yield batch


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def gather_steps(
    chunks: list, fields: list, env: np.ndarray, start: np.ndarray, lengths: np.ndarray
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every step of the episodes (env, start, length), joined episode by episode, per field
    column, and their outcome codes. Chunks are decoded one at a time (one chunk per field
    in memory beside the result, however long the episodes), each once."""
    total = int(lengths.sum())
    t = np.repeat(start - (np.cumsum(lengths) - lengths), lengths)
    t += np.arange(total)
    t0 = np.asarray([c.t0 for c in chunks], dtype=np.int64)
    which = np.searchsorted(t0, t, side="right") - 1
    t -= t0[which]  # the step's row in its chunk
    e = np.repeat(env, lengths)
    # The steps grouped by chunk: a stable sort of small ints (radix), not of the times.
    order = np.argsort(which.astype(np.min_scalar_type(len(chunks))), kind="stable")
    bounds = np.searchsorted(which, np.arange(len(chunks) + 1), sorter=order)
    del which
    out = {f.column: np.empty((total, *f.shape), dtype=f.dtype) for f in fields}
    codes = np.zeros(total, dtype=np.int64)
    scratch: dict[str, np.ndarray] = {}
    for i, chunk in enumerate(chunks):
        rows = order[bounds[i] : bounds[i + 1]]
        if not rows.size:
            continue
        items = None
        for spec in fields:
            src = chunk.arrays[spec.key]
            buf = scratch.get(spec.key)
            if buf is None or buf.shape != src.shape:
                buf = scratch[spec.key] = np.empty(src.shape, dtype=src.dtype)
            src.decode_into(buf, f"stored {spec.key}")
            if items is None:  # the steps' flat items t * N + e, shared by every field
                items = t[rows] * buf.shape[1] + e[rows]
            copy_steps(out[spec.column], rows, buf, items)
        if chunk.outcome is not None:
            if items is None:
                items = t[rows] * chunk.outcome.shape[1] + e[rows]
            codes[rows] = chunk.outcome.decode().reshape(-1)[items]
    return out, codes


def copy_steps(dest: np.ndarray, rows: np.ndarray, src: np.ndarray, items: np.ndarray) -> None:
    """dest[rows] = the steps at flat ``items`` of a (T, N, ...) array: each step one opaque
    item (one memcpy), or through a cast when the dtypes differ (rewards -> float32)."""
    step_bytes = src.itemsize * int(np.prod(src.shape[2:], dtype=np.int64))
    if step_bytes == 0:
        return
    flat = src.reshape(src.shape[0] * src.shape[1], step_bytes // src.itemsize)
    if dest.dtype != src.dtype:
        with np.errstate(over="ignore", invalid="ignore"):
            dest[rows] = flat[items].reshape(items.size, *dest.shape[1:])
        return
    item = np.dtype((np.void, step_bytes))
    dest.reshape(dest.shape[0], -1).view(item)[rows, 0] = flat.view(item)[items, 0]


def last_nonzero(codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per episode (lengths, back to back in ``codes``): its last non-zero code, or 0."""
    where = np.where(codes != 0, np.arange(codes.size), -1)
    last = np.maximum.reduceat(where, np.cumsum(lengths) - lengths)
    return np.where(last >= 0, codes[np.maximum(last, 0)], 0).astype(np.int64)
