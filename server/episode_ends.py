"""How each episode ended: the terminated and truncated flags of its last step, and its
final states (the ``final:<name>`` row of that step), read from the stored chunks.

Both are read where the episode ends, so they need no state besides the chunks: WAL replay
and a restored checkpoint give them back as they were. finish() and the dataset use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .chunks import FINAL

# `episodes.StoredChunk` (episodes imports this module): t0 and arrays are what is read.
StoredChunk = Any


def _by_chunk(
    chunks: Sequence[StoredChunk], env: np.ndarray, end: np.ndarray, done: np.ndarray
) -> list[tuple[StoredChunk, np.ndarray, np.ndarray, np.ndarray]]:
    """(chunk, episode indexes, local row, env) of the last steps of the episodes a done
    flag ended, grouped by the chunk that holds that step."""
    rows = np.flatnonzero(done)
    if rows.size == 0 or not chunks:
        return []
    last = end[rows] - 1
    t0 = np.fromiter((c.t0 for c in chunks), dtype=np.int64, count=len(chunks))
    where = np.searchsorted(t0, last, side="right") - 1
    groups = []
    for i in np.unique(where).tolist():
        pick = where == i
        chunk = chunks[i]
        groups.append((chunk, rows[pick], last[pick] - chunk.t0, env[rows[pick]]))
    return groups


def end_flags(
    chunks: Sequence[StoredChunk], env: np.ndarray, end: np.ndarray, done: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(terminated, truncated) per episode: its last step's flags. An episode that ended in
    a chunk recorded with ``done`` only reads terminated = True, truncated = False; one no
    flag ended (a tail), both False."""
    terminated = np.asarray(done, dtype=bool).copy()
    truncated = np.zeros(terminated.size, dtype=bool)
    for chunk, rows, t, e in _by_chunk(chunks, env, end, terminated):
        if "terminated" not in chunk.arrays:
            continue
        terminated[rows] = chunk.arrays["terminated"].decode("stored terminated")[t, e]
        truncated[rows] = chunk.arrays["truncated"].decode("stored truncated")[t, e]
    return terminated, truncated


def final_names(chunks: Sequence[StoredChunk], state_order: Sequence[str]) -> list[str]:
    """The state fields (in ``state_order``) some chunk recorded a final value of."""
    sent = {k[len(FINAL) :] for c in chunks for k in c.arrays if k.startswith(FINAL)}
    return [name for name in state_order if name in sent]


def final_rows(
    chunks: Sequence[StoredChunk],
    name: str,
    env: np.ndarray,
    end: np.ndarray,
    done: np.ndarray,
    out: np.ndarray,
) -> np.ndarray:
    """Write into ``out`` (one row per episode, zeros in) the ``final:<name>`` value of the
    last step of each episode a done flag ended, where its chunk has one; returns (B,) bool,
    the episodes written."""
    key = FINAL + name
    written = np.zeros(len(out), dtype=bool)
    for chunk, rows, t, e in _by_chunk(chunks, env, end, done):
        enc = chunk.arrays.get(key)
        if enc is not None:
            out[rows] = enc.decode(f"stored {key}")[t, e]
            written[rows] = True
    return written
