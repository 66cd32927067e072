"""Episode splitting and assembly: the pure core of a recording session.

Chunks are kept as they arrived on the wire (compressed); only their episode
boundaries are computed at ingest. `assemble` rebuilds the padded result the
in-process recorder returns: chunks joined along time per worker, split per
environment at the done flags, environment by environment, worker by worker.

A sequence gap (chunks of a worker lost after their ack) cuts the worker's time axis: no
episode spans it. What a gap ended, or whose start it hid, is kept marked (`GAP_AFTER`,
`GAP_BEFORE`); the steps on both sides stay on one axis, so starts and lengths still place
every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from recorder_client._wire import trajectory_name
from recorder_client.trajectory import CORRUPT, GAP_AFTER, GAP_BEFORE

from .chunks import FINAL, STATE, EncodedArray, Schema, is_obs_field
from .episode_ends import end_flags, final_names, final_rows


@dataclass
class StoredChunk:
    """One stored chunk: its place on the worker's time axis and its arrays."""

    t0: int
    length: int
    arrays: dict[str, EncodedArray]  # "action", "reward", "done", "state:<name>"
    wire_bytes: int
    outcome: EncodedArray | None = None
    """The (T, N) outcome codes as sent, when the chunk had them (the dataset sink reads
    them; finish() does not)."""
    unverified: tuple[str, ...] = ()
    """Keys of `arrays` whose frames are not yet proved to decode (`Session.verify`)."""
    worker: str = ""  # the worker and sequence that sent it, named when a frame does not
    sequence: int = 0  # decode
    corrupt: tuple[str, ...] = ()
    """Why frames of it read as zeros: a message per frame found not to decode after the ack
    (finish() hands them to its caller)."""

    def spans(self, start: int, end: int) -> bool:
        """Whether any of steps start..end-1 lie in this chunk."""
        return self.t0 < end and start < self.t0 + self.length


@dataclass
class EpisodeTable:
    """Per-episode metadata of one worker, in ingest order."""

    env: list[np.ndarray] = field(default_factory=list)
    start: list[np.ndarray] = field(default_factory=list)
    end: list[np.ndarray] = field(default_factory=list)
    partial: list[np.ndarray] = field(default_factory=list)
    """uint8 flags per episode: GAP_BEFORE when a gap hid its start, else 0."""

    def __post_init__(self) -> None:
        if len(self.partial) != len(self.env):  # a table restored without its flags
            self.partial = [np.zeros(e.size, dtype=np.uint8) for e in self.env]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.env:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        if len(self.env) > 1:  # joined once: the next call starts from one array per column
            self.env = [np.concatenate(self.env)]
            self.start = [np.concatenate(self.start)]
            self.end = [np.concatenate(self.end)]
            self.partial = [np.concatenate(self.partial)]
        return self.env[0], self.start[0], self.end[0]

    def flags(self) -> np.ndarray:
        """The partial flags of every episode, in the order of `arrays`."""
        if not self.arrays()[0].size:
            return np.zeros(0, dtype=np.uint8)
        return self.partial[0]


class WorkerTimeline:
    """The time axis of one worker: stored chunks and finished episodes per env.

    The one owner of where each environment's open episode starts (``open_start``).
    """

    def __init__(self, worker_id: str, index: int) -> None:
        self.worker_id = worker_id
        self.index = index
        self.clear()

    def clear(self) -> None:
        self.num_envs: int | None = None
        self.chunks: list[StoredChunk] = []
        self.t_total = 0
        self.open_start: np.ndarray | None = None  # (N,) start of each env's open tail
        self.finished_per_env: np.ndarray | None = None  # (N,) finished episode counts
        # (N,) whether a sequence gap hid where each env's open episode starts.
        self.open_partial: np.ndarray | None = None
        # A gap before the first chunk: the first chunk's open episodes start unknown.
        self.start_unknown = False
        # (env, start, end, flags) of each open episode a gap ended (unfinished tails).
        self.cut_tails: list[tuple[int, int, int, int]] = []
        self.cuts: list[int] = []  # steps a gap lies just before
        self.table = EpisodeTable()
        self.episodes_finished = 0
        self.raw_bytes = 0
        self.wire_bytes = 0
        self.chunks_dropped = 0

    def add_chunk(
        self,
        dones: np.ndarray,
        arrays: dict[str, EncodedArray],
        wire_bytes: int,
        outcome: EncodedArray | None = None,
        valid: np.ndarray | None = None,
        parts: tuple[int, ...] = (),
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Store a validated chunk and split it at its done flags.

        Returns the (env, start, end) arrays of the episodes this chunk finished,
        on the worker's time axis, and their partial flags (GAP_BEFORE where a gap
        hid the start). Rows ``valid`` marks False belong to no episode: they stand only
        where an env's open episode has no step yet (checked by `chunks.check_open_rows`),
        so each start moves past them to the env's next valid row. A chunk joined from
        several calls (``parts``: their lengths) lists its episodes call by call, each env by
        env, as those calls sent alone would.
        """
        length, n = dones.shape
        if self.num_envs is None:
            self.num_envs = n
            self.open_start = np.zeros(n, dtype=np.int64)
            self.finished_per_env = np.zeros(n, dtype=np.int64)
        assert self.open_start is not None and self.finished_per_env is not None
        open_partial = self._open_partial() if self.cuts else None
        t0 = self.t_total
        # Sorted by env, then by time: the order finish() lists episodes in. A flat search of
        # the flags copied env-major: np.nonzero of the transposed view is 2-5x as slow.
        env, t = np.divmod(np.flatnonzero(np.ascontiguousarray(dones.T)), length)
        end = t + (t0 + 1)
        start = np.empty_like(end)
        partial = np.zeros(end.size, dtype=np.uint8)
        skip = None if valid is None or valid.all() else _next_valid(valid)
        if end.size:
            start[1:] = end[:-1]
            first = np.ones(end.size, dtype=bool)
            first[1:] = env[1:] != env[:-1]
            start[first] = self.open_start[env[first]]
            if skip is not None:  # a start in this chunk moves to its env's next valid row
                here = start >= t0
                start[here] = t0 + skip[start[here] - t0, env[here]]
            if self.cuts:
                partial[first] = np.where(open_partial[env[first]], GAP_BEFORE, 0)
            last = np.ones(end.size, dtype=bool)
            last[:-1] = env[1:] != env[:-1]
            self.open_start[env[last]] = end[last]
            if self.cuts:  # without a gap, no open start is unknown
                open_partial[env[last]] = False
            np.add.at(self.finished_per_env, env, 1)
            if parts:
                call = np.searchsorted(np.cumsum(parts), end - t0, side="left")
                order = np.lexsort((end, env, call))
                env, start, end, partial = env[order], start[order], end[order], partial[order]
            self.table.env.append(env)
            self.table.start.append(start)
            self.table.end.append(end)
            self.table.partial.append(partial)
        if skip is not None:  # open episodes with no step yet start at their next valid row
            here = np.flatnonzero(self.open_start >= t0)
            self.open_start[here] = t0 + skip[self.open_start[here] - t0, here]
        self.chunks.append(StoredChunk(t0, length, arrays, wire_bytes, outcome))
        self.t_total += length
        self.episodes_finished += int(end.size)
        self.raw_bytes += sum(a.nbytes for a in arrays.values())
        self.wire_bytes += wire_bytes
        return env, start, end, partial

    def cut(self, fresh: bool = False) -> None:
        """Chunks of this worker were lost just before its next step (a sequence gap).

        Every open episode ends here as an unfinished tail (GAP_AFTER); what follows, up to
        each env's next done, starts unknown (GAP_BEFORE). Nothing is joined across.
        ``fresh``: what follows starts new episodes instead (another recorder instance took
        the worker id), whose starts are known.
        """
        t = self.t_total
        if fresh and (self.open_start is None or not (self.open_start < t).any()):
            return  # no episode has steps to end
        if not self.cuts or self.cuts[-1] != t:
            self.cuts.append(t)
        if self.num_envs is None:
            self.start_unknown = True
            return
        assert self.open_start is not None
        open_partial = self._open_partial()
        for e in np.flatnonzero(self.open_start < t).tolist():
            flags = GAP_AFTER | (GAP_BEFORE if open_partial[e] else 0)
            self.cut_tails.append((e, int(self.open_start[e]), t, flags))
        self.open_start[:] = t
        open_partial[:] = not fresh

    def _open_partial(self) -> np.ndarray:
        """(N,) whether a gap hid each env's open start (call once num_envs is known)."""
        if self.open_partial is None:
            assert self.num_envs is not None
            self.open_partial = np.full(self.num_envs, self.start_unknown, dtype=bool)
        return self.open_partial

    def gap_state(self) -> dict | None:
        """What a checkpoint keeps of the gaps (None when there were none): plain lists."""
        if not self.cuts:
            return None
        flags = self.table.flags()
        marked = np.flatnonzero(flags)
        return {
            "cuts": list(self.cuts),
            "start_unknown": self.start_unknown,
            "open_partial": (
                [] if self.open_partial is None else np.flatnonzero(self.open_partial).tolist()
            ),
            "cut_tails": [list(tail) for tail in self.cut_tails],
            "marked": [[int(i), int(flags[i])] for i in marked],
        }

    def load_gap_state(self, state: dict | None) -> None:
        """Inverse of `gap_state`, after the chunks, table and open starts are restored;
        ValueError names what does not fit."""
        n = self.num_envs or 0
        self.open_partial = None if self.num_envs is None else np.zeros(n, dtype=bool)
        if state is None:
            return
        if not isinstance(state, dict):
            raise ValueError(f"gaps: expected a mapping, got {type(state).__name__}")
        t = self.t_total
        cuts = state.get("cuts", [])
        if not all(isinstance(c, int) and 0 <= c <= t for c in cuts) or cuts != sorted(cuts):
            raise ValueError(f"gaps.cuts: expected sorted steps in [0, {t}], got {cuts!r}")
        self.cuts = list(cuts)
        self.start_unknown = bool(state.get("start_unknown", False))
        envs = state.get("open_partial", [])
        if not all(isinstance(e, int) and 0 <= e < n for e in envs):
            raise ValueError(f"gaps.open_partial: expected envs in [0, {n}), got {envs!r}")
        if self.open_partial is not None:
            self.open_partial[envs] = True
        tails = []
        for tail in state.get("cut_tails", []):
            if not (
                isinstance(tail, list)
                and len(tail) == 4
                and all(isinstance(v, int) for v in tail)
                and 0 <= tail[0] < n
                and 0 <= tail[1] < tail[2] <= t
                and tail[3] & GAP_AFTER
            ):
                raise ValueError(f"gaps.cut_tails: expected [env, start, end, flags], got {tail!r}")
            tails.append(tuple(tail))
        self.cut_tails = tails
        env = self.table.arrays()[0]
        flags = np.zeros(env.size, dtype=np.uint8)
        for pair in state.get("marked", []):
            if not (isinstance(pair, list) and len(pair) == 2 and 0 <= pair[0] < env.size):
                raise ValueError(f"gaps.marked: expected [row < {env.size}, flags], got {pair!r}")
            flags[pair[0]] = pair[1]
        if env.size:
            self.table.partial = [flags]

    def open_empty(self) -> np.ndarray | None:
        """(N,) whether each env's open episode has no step yet (None before the first
        chunk). Starts skip invalid rows, so that is exactly an open start at t_total."""
        if self.open_start is None:
            return None
        return self.open_start == self.t_total

    def oldest_open(self) -> int:
        """The first step some open episode still needs (t_total when none is open)."""
        if self.open_start is None or not self.open_start.size:
            return self.t_total
        return int(self.open_start.min())

    def episodes(
        self, pad_incomplete: bool, include_partial: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(env, start, end, done, partial flags) of every episode, env by env, in time
        order. Pieces whose start a gap hid only with ``include_partial``; unfinished tails
        (a gap's or the last one) only with ``pad_incomplete``."""
        env, start, end = self.table.arrays()
        flags = self.table.flags()
        if self.cuts and not include_partial:
            whole = (flags & GAP_BEFORE) == 0
            env, start, end, flags = env[whole], start[whole], end[whole], flags[whole]
        done = np.ones(env.size, dtype=bool)
        if pad_incomplete and self.num_envs:
            assert self.open_start is not None and self.finished_per_env is not None
            open_partial = self._open_partial()
            tails = [t for t in self.cut_tails if include_partial or not t[3] & GAP_BEFORE]
            # The in-process rule: keep the tail when the env never finished an
            # episode (even an empty one), or when steps follow its last done. One a gap
            # began is kept when it has steps (and partial pieces are asked for). Invalid
            # rows alone (an open start moved past them) make no episode.
            has_steps = self.open_start < self.t_total
            keep = np.where(
                open_partial,
                has_steps & include_partial,
                ((self.finished_per_env == 0) & (self.open_start == 0)) | has_steps,
            )
            tail_env = np.nonzero(keep)[0].astype(np.int64)
            cut = np.asarray(tails, dtype=np.int64).reshape(-1, 4)
            env = np.concatenate([env, cut[:, 0], tail_env])
            start = np.concatenate([start, cut[:, 1], self.open_start[tail_env]])
            end = np.concatenate(
                [end, cut[:, 2], np.full(tail_env.size, self.t_total, dtype=np.int64)]
            )
            done = np.concatenate([done, np.zeros(len(tails) + tail_env.size, dtype=bool)])
            open_flags = np.where(open_partial[tail_env], GAP_BEFORE, 0)
            flags = np.concatenate([flags, cut[:, 3], open_flags]).astype(np.uint8)
        order = np.lexsort((start, env))
        return env[order], start[order], end[order], done[order], flags[order]


def _next_valid(valid: np.ndarray) -> np.ndarray:
    """(T + 1, N): for each local row and env, the first row at or after it that ``valid``
    marks True (T when none)."""
    length = valid.shape[0]
    rows = np.where(valid, np.arange(length)[:, None], length)
    out = np.full((length + 1, valid.shape[1]), length, dtype=np.int64)
    out[:length] = np.minimum.accumulate(rows[::-1], axis=0)[::-1]
    return out


def field_array(chunks: list[StoredChunk], key: str, until: int) -> np.ndarray:
    """Decode and join one field over the chunks that begin before `until`, each chunk
    straight into its place (no per-chunk arrays to join)."""
    arrays = [c.arrays[key] for i, c in enumerate(chunks) if c.t0 < until or i == 0]
    first = arrays[0]
    out = np.empty((sum(a.shape[0] for a in arrays), *first.shape[1:]), dtype=first.dtype)
    t = 0
    for a in arrays:
        # The session's schema keeps a field's dtype, N and trailing shape across chunks.
        assert a.dtype == first.dtype and a.shape[1:] == first.shape[1:], key
        a.decode_into(out[t : t + a.shape[0]], f"stored {key}")
        t += a.shape[0]
    return out


@dataclass
class FieldOut:
    """One padded output field: its trajectory name, source key, dtype and trailing shape."""

    name: str
    key: str
    dtype: np.dtype
    trailing: tuple[int, ...]


@dataclass
class WorkerRows:
    """One worker's share of the result: its chunks, the rows it owns, their episodes."""

    position: int  # the worker's index in the result (join order)
    chunks: list[StoredChunk]
    rows: np.ndarray
    env: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def needed_chunks(self) -> list[StoredChunk]:
        """The chunks some row's steps lie in: from the first, up to the last row's end."""
        if self.rows.size == 0:
            return []
        until = int(self.end.max())
        return [c for i, c in enumerate(self.chunks) if c.t0 < until or i == 0]


@dataclass
class Assembly:
    """What finish() returns, before it is streamed: metadata plus a row filler."""

    num_episodes: int
    max_length: int
    lengths: np.ndarray
    workers: np.ndarray
    envs: np.ndarray
    starts: np.ndarray
    done: np.ndarray
    partial: np.ndarray
    """(B,) uint8 flags: why each episode is not whole (0: it is)."""
    fields: list[FieldOut]
    per_worker: list[WorkerRows]
    terminated: np.ndarray
    truncated: np.ndarray
    """(B,) bool each: the flags of each episode's last step (`episode_ends.end_flags`)."""
    finals: list[FieldOut]
    """The final-state fields, (B, ...) each: key ``final:<name>``, trailing shape."""
    _step_index: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def mark_corrupt(self) -> None:
        """Flag CORRUPT the rows that read a chunk whose frames were found not to decode
        (call once the chunks the rows need are proved)."""
        for part in self.per_worker:
            for chunk in part.needed_chunks():
                if chunk.corrupt:
                    hit = (part.start < chunk.t0 + chunk.length) & (chunk.t0 < part.end)
                    self.partial[part.rows[hit]] |= CORRUPT

    def chunk_frames(self) -> list[tuple[int, StoredChunk]] | None:
        """(worker position, chunk) of every chunk the rows need, in stream order; None when
        a chunk has more steps than the result's B x T_max (the receiver bounds its buffers
        by the result's shape), so that gathered parts travel instead."""
        slots = self.num_episodes * self.max_length
        frames = []
        for part in self.per_worker:
            for chunk in part.needed_chunks():
                if chunk.length * chunk.arrays["action"].shape[1] > slots:
                    return None
                frames.append((part.position, chunk))
        return frames

    def final_parts(self, spec: FieldOut, part_bytes: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(first row, row count, rows) of a final-state field: each episode's state after
        its last step (zeros where no flag ended it), in parts of at most part_bytes (at
        least one row). Call once the chunks are proved (`Session.verify`)."""
        out = np.zeros((self.num_episodes, *spec.trailing), dtype=spec.dtype)
        name = spec.key[len(FINAL) :]
        for part in self.per_worker:
            got = np.zeros((part.rows.size, *spec.trailing), dtype=spec.dtype)
            final_rows(part.chunks, name, part.env, part.end, self.done[part.rows], got)
            out[part.rows] = got
        row_bytes = max(1, out[:1].nbytes)
        step = max(1, part_bytes // row_bytes)
        for lo in range(0, self.num_episodes, step):
            hi = min(self.num_episodes, lo + step)
            yield lo, hi - lo, out[lo:hi]

    def field_parts(self, spec: FieldOut, part_bytes: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(first row, row count, real steps of those rows joined episode by episode), parts
        of at most part_bytes (at least one row); rows of several workers share a part.

        Only real steps travel: the receiver writes them into zeros (the padding).
        """
        step_bytes = max(1, int(np.prod(spec.trailing, dtype=np.int64)) * spec.dtype.itemsize)
        pieces: list[np.ndarray] = []
        first = count = size = 0
        for w, part in enumerate(self.per_worker):
            rows, start, end = part.rows, part.start, part.end
            if rows.size == 0:
                continue
            src = field_array(part.chunks, spec.key, int(end.max()))
            steps = self._steps(w, src.shape[1])
            ends = np.cumsum(end - start)
            cum = ends * step_bytes
            lo = 0
            while lo < rows.size:
                base = int(cum[lo - 1]) if lo else 0
                hi = int(np.searchsorted(cum, base + part_bytes - size, side="right"))
                if hi <= lo and pieces:  # this row does not fit beside the others
                    yield first, count, _joined(pieces)
                    pieces, count, size = [], 0, 0
                    continue
                hi = max(hi, lo + 1)
                if not pieces:
                    first = int(rows[lo])
                step_lo = int(ends[lo - 1]) if lo else 0
                pieces.append(_gather(src, steps[step_lo : int(ends[hi - 1])], spec.dtype))
                count += hi - lo
                size += int(cum[hi - 1]) - base
                lo = hi
                if size >= part_bytes:
                    yield first, count, _joined(pieces)
                    pieces, count, size = [], 0, 0
        if pieces:
            yield first, count, _joined(pieces)

    def _steps(self, worker: int, num_envs: int) -> np.ndarray:
        """Where each real step of a worker's rows lies in its (T, N, ...) fields (item
        t * N + e), episode by episode: built once and shared by every field."""
        steps = self._step_index.get(worker)
        if steps is None:
            part = self.per_worker[worker]
            env, start, end = part.env, part.start, part.end
            lengths = end - start
            steps = np.arange(int(lengths.sum()), dtype=np.int64)
            steps += np.repeat(start - (np.cumsum(lengths) - lengths), lengths)
            steps *= num_envs
            steps += np.repeat(env, lengths)
            self._step_index[worker] = steps
        return steps


def _gather(src: np.ndarray, steps: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The steps of a (T, N, ...) field at flat indices `steps`, cast to the output dtype."""
    # One fancy-indexed gather of whole steps (one opaque item each): measured faster than a
    # slice per episode.
    step_bytes = src.dtype.itemsize * int(np.prod(src.shape[2:], dtype=np.int64))
    if steps.size == 0 or step_bytes == 0:  # nothing to copy
        flat = np.empty((steps.size, *src.shape[2:]), dtype=src.dtype)
    else:
        items = src.reshape(src.shape[0] * src.shape[1], step_bytes // src.dtype.itemsize)
        picked = items.view(np.dtype((np.void, step_bytes)))[steps, 0]
        flat = picked.view(src.dtype).reshape(steps.size, *src.shape[2:])
    # The cast (rewards -> float32) is the one assignment into the padded array does.
    with np.errstate(over="ignore", invalid="ignore"):
        return flat.astype(dtype, copy=False)


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class NoEpisodesError(ValueError):
    """finish() found nothing to return; the message is the in-process recorder's."""


NO_DATA_MESSAGE = "No data recorded. Call record() first."
NO_EPISODES_MESSAGE = (
    "No complete episodes found. Try recording more steps or set pad_incomplete=True."
)


def assemble(
    timelines: list[WorkerTimeline],
    *,
    pad_incomplete: bool,
    max_episodes: int | None,
    schema: Schema,
    state_order: list[str],
    include_partial: bool = False,
) -> Assembly:
    """Plan the padded result: which episode goes to which row, and the fields."""
    if not any(tl.chunks for tl in timelines):
        raise NoEpisodesError(NO_DATA_MESSAGE)
    per: list[WorkerRows] = []
    total = 0
    metas = []
    # Workers are numbered by their place in `timelines` (join order): a forgotten worker's
    # index leaves a gap in `tl.index`, never in the result.
    for position, tl in enumerate(timelines):
        if not tl.chunks:
            continue
        env, start, end, done, flags = tl.episodes(pad_incomplete, include_partial)
        if max_episodes is not None:
            take = max(0, min(env.size, max_episodes - total))
            env, start, end, done = env[:take], start[:take], end[:take], done[:take]
            flags = flags[:take]
        rows = np.arange(total, total + env.size, dtype=np.int64)
        total += env.size
        per.append(WorkerRows(position, list(tl.chunks), rows, env, start, end))
        metas.append(
            (position, env, start, end, done, flags, *end_flags(tl.chunks, env, end, done))
        )
    if total == 0:
        raise NoEpisodesError(NO_EPISODES_MESSAGE)
    lengths = np.concatenate([m[3] - m[2] for m in metas])
    fields = [
        FieldOut("actions", "action", *schema["action"]),
        FieldOut("rewards", "reward", np.dtype(np.float32), ()),
    ]
    # Observation fields are recorded whatever state_fields say: after them, in schema order.
    names = [*state_order]
    names += [
        k[len(STATE) :] for k in schema if k.startswith(STATE) and is_obs_field(k[len(STATE) :])
    ]
    names = list(dict.fromkeys(names))
    for name in names:
        key = f"state:{name}"
        if key in schema:
            fields.append(FieldOut(trajectory_name(name), key, *schema[key]))
    chunks = [c for part in per for c in part.chunks]
    finals = [
        FieldOut(trajectory_name(name), FINAL + name, *schema[STATE + name])
        for name in final_names(chunks, names)
        if STATE + name in schema
    ]
    return Assembly(
        num_episodes=total,
        max_length=int(lengths.max()),
        lengths=lengths,
        workers=np.concatenate([np.full(m[1].size, m[0], dtype=np.int64) for m in metas]),
        envs=np.concatenate([m[1] for m in metas]),
        starts=np.concatenate([m[2] for m in metas]),
        done=np.concatenate([m[4] for m in metas]),
        partial=np.concatenate([m[5] for m in metas]).astype(np.uint8),
        fields=fields,
        per_worker=per,
        terminated=np.concatenate([m[6] for m in metas]),
        truncated=np.concatenate([m[7] for m in metas]),
        finals=finals,
    )
