"""The client's half of finish(): the Finish stream decoded into the padded result.

The header gives every output's shape and each episode's (worker, env, start, length). Then
either each part carries the real steps of a run of rows (no padding), or the server sends
the stored chunks as recorded and the client copies each episode's steps out of them itself,
on two threads (zstd and numpy's fancy-index copies release the GIL). Either way the steps
land in zeroed arrays. Everything the server sends is checked against the header before it
is used: a malformed stream raises RecorderError naming what was expected and what arrived.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from . import _wire
from ._proto import recorder_pb2 as pb
from .errors import DataLossError, RecorderError
from .trajectory import Trajectory, partial_names

logger = logging.getLogger(__name__)

# Steps scattered per fancy-indexed copy (at least one row).
_SCATTER_STEPS = 1 << 20
# Threads copying chunks into the result, and chunks received ahead of them (this bounds
# the compressed frames held besides the result).
_THREADS = 2
_CHUNKS_AHEAD = 16
_INT64_MAX = np.iinfo(np.int64).max


class _Outputs:
    """The zeroed outputs of a header, and which of their rows have arrived."""

    def __init__(self, header: pb.FinishHeader) -> None:
        self.header = header
        self.lengths = np.asarray(header.lengths, dtype=np.int64)
        rows = self.lengths.size
        self.names = [f.name for f in header.fields]
        if len(header.fields) < 2:
            raise RecorderError(
                f"Finish: expected at least the actions and rewards fields, got {self.names}"
            )
        self.arrays: list[np.ndarray] = []
        for f in header.fields:
            what = f"Finish: fields[{f.name!r}]"
            dtype = _wire.parse_dtype(f.dtype, what)
            shape = tuple(int(s) for s in f.shape)
            if len(shape) < 2 or shape[0] != rows or any(s < 0 for s in shape):
                raise RecorderError(
                    f"{what}: expected a shape (B={rows}, T_max, ...), got {list(shape)}"
                )
            self.arrays.append(np.zeros(shape, dtype=dtype))  # calloc: padding costs nothing
        self.max_length = self.arrays[0].shape[1]
        if any(a.shape[1] != self.max_length for a in self.arrays) or (
            rows and not 0 <= self.lengths.min() <= self.lengths.max() <= self.max_length
        ):
            raise RecorderError(
                f"Finish: expected lengths within 0..T_max={self.max_length} for every field, "
                f"got shapes {[list(a.shape) for a in self.arrays]} and lengths "
                f"{self.lengths.min() if rows else '-'}..{self.lengths.max() if rows else '-'}"
            )
        self.ends = np.cumsum(self.lengths)  # steps before each row's end, for part sizes
        self.seen = np.zeros((len(self.arrays), rows), dtype=bool)
        self._scratch = np.empty(0, dtype=np.uint8)
        self.finals = _Finals(header, rows)

    def add(self, part: pb.ArrayPart) -> None:
        """Check one part against the header, decode it and write its steps into their rows."""
        field, lo = int(part.field), int(part.row_start)
        hi = lo + int(part.row_count)
        if field >= len(self.arrays) or hi > self.lengths.size:
            raise RecorderError(
                f"Finish: expected a part within {len(self.arrays)} fields and "
                f"{self.lengths.size} rows, got rows {lo}:{hi} of field {field}"
            )
        out = self.arrays[field]
        if self.seen[field, lo:hi].any():
            raise RecorderError(
                f"Finish: rows {lo}:{hi} of field {self.names[field]!r} arrived twice"
            )
        self.seen[field, lo:hi] = True
        steps = int(self.ends[hi - 1] - (self.ends[lo - 1] if lo else 0)) if hi > lo else 0
        what = f"Finish: part for rows {lo}:{hi} of field {self.names[field]!r}"
        msg = part.array
        try:
            dtype, shape = _wire.check_header(msg.dtype, msg.shape, msg.raw_size, what, out.nbytes)
        except _wire.ArrayDecodeError as exc:
            raise RecorderError(str(exc)) from None
        expected = (steps, *out.shape[2:])
        if shape != expected or dtype != out.dtype:
            raise RecorderError(
                f"{what}: expected {out.dtype} of shape {list(expected)}, "
                f"got {dtype} of shape {list(shape)}"
            )
        if msg.raw_size > self._scratch.size:  # at most the output's size (checked above)
            self._scratch = np.empty(msg.raw_size, dtype=np.uint8)
        flat = self._scratch[: msg.raw_size].view(dtype).reshape(shape)
        try:
            _wire.decode_into(msg.codec, msg.data, flat, what)
        except _wire.ArrayDecodeError as exc:
            raise RecorderError(str(exc)) from None
        if flat.size:
            self._scatter(out, lo, hi, flat)

    def _scatter(self, out: np.ndarray, lo: int, hi: int, flat: np.ndarray) -> None:
        # One fancy-indexed copy of whole steps (one void item each) instead of a slice per
        # row: a step's destination is row * T_max + t. The rest of each row stays zero.
        # Rows go in groups of about _SCATTER_STEPS steps, so that the index (8 bytes a step)
        # stays small however large a part the server sends.
        dst, src = _as_steps(out, 2), _as_steps(flat, 1)
        before = int(self.ends[lo - 1]) if lo else 0  # steps of the rows before the part
        while lo < hi:
            first = int(self.ends[lo - 1]) if lo else 0
            stop = int(np.searchsorted(self.ends, first + _SCATTER_STEPS, side="right"))
            stop = min(hi, max(stop, lo + 1))
            lengths = self.lengths[lo:stop]
            starts = self.ends[lo:stop] - lengths - first  # each row's first step in the group
            dest = np.arange(int(self.ends[stop - 1]) - first, dtype=np.int64)
            dest += np.repeat(
                np.arange(lo, stop, dtype=np.int64) * self.max_length - starts, lengths
            )
            dst[dest] = src[first - before : first - before + dest.size]
            lo = stop

    def trajectory(self, frames: _Frames | None) -> Trajectory:
        if frames is not None:
            if self.seen.any():
                raise RecorderError("Finish: expected either array parts or chunks, got both")
            frames.check_complete()
        elif not self.seen.all():
            field, row = (int(i[0]) for i in np.nonzero(~self.seen))
            raise RecorderError(
                f"Finish: expected every row of every field, row {row} of field "
                f"{self.names[field]!r} never arrived"
            )
        h = self.header
        terminated, truncated = self.finals.flags()
        return Trajectory(
            self.arrays[0],
            self.arrays[1],
            dict(zip(self.names[2:], self.arrays[2:])),
            lengths=self.lengths,
            episode_worker=np.asarray(h.workers, dtype=np.int64),
            episode_env=np.asarray(h.envs, dtype=np.int64),
            episode_start=np.asarray(h.starts, dtype=np.int64),
            episode_done=np.asarray(h.done, dtype=bool),
            worker_ids=list(h.worker_ids),
            corrupt_chunks=list(h.corrupt_chunks),
            num_corrupt_chunks=h.num_corrupt_chunks,
            episode_partial=self._partial(),
            episode_terminated=terminated,
            episode_truncated=truncated,
            final_states=self.finals.result(),
        )

    def _partial(self) -> np.ndarray | None:
        partial = self.header.partial
        if not partial:
            return None
        if len(partial) != self.lengths.size:
            raise RecorderError(
                f"Finish: expected {self.lengths.size} partial flags, got {len(partial)}"
            )
        return partial_names(np.asarray(partial, dtype=np.int64))


class _Finals:
    """The per-episode end of a header: both flags, and the final-state fields, whose rows
    arrive as FinishPart.final parts (one state an episode)."""

    def __init__(self, header: pb.FinishHeader, rows: int) -> None:
        self.header, self.rows = header, rows
        self.names = [f.name for f in header.final_fields]
        self.arrays: list[np.ndarray] = []
        for f in header.final_fields:
            what = f"Finish: final_fields[{f.name!r}]"
            dtype = _wire.parse_dtype(f.dtype, what)
            shape = tuple(int(s) for s in f.shape)
            if not shape or shape[0] != rows or any(s < 0 for s in shape):
                raise RecorderError(f"{what}: expected a shape (B={rows}, ...), got {list(shape)}")
            self.arrays.append(np.zeros(shape, dtype=dtype))
        self.seen = np.zeros((len(self.arrays), rows), dtype=bool)

    def flags(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(terminated, truncated), or Nones from a server that sends neither."""
        h = self.header
        got = (len(h.terminated), len(h.truncated))
        if got == (0, 0) and self.rows:
            return None, None
        if got != (self.rows, self.rows):
            raise RecorderError(
                f"Finish: expected {self.rows} terminated and truncated flags, got {got}"
            )
        return np.asarray(h.terminated, dtype=bool), np.asarray(h.truncated, dtype=bool)

    def add(self, part: pb.ArrayPart) -> None:
        field, lo = int(part.field), int(part.row_start)
        hi = lo + int(part.row_count)
        if field >= len(self.arrays) or hi > self.rows:
            raise RecorderError(
                f"Finish: expected a final part within {len(self.arrays)} fields and "
                f"{self.rows} rows, got rows {lo}:{hi} of field {field}"
            )
        if self.seen[field, lo:hi].any():
            raise RecorderError(
                f"Finish: rows {lo}:{hi} of final field {self.names[field]!r} arrived twice"
            )
        self.seen[field, lo:hi] = True
        out = self.arrays[field]
        what = f"Finish: final part for rows {lo}:{hi} of field {self.names[field]!r}"
        msg = part.array
        try:
            dtype, shape = _wire.check_header(msg.dtype, msg.shape, msg.raw_size, what, out.nbytes)
        except _wire.ArrayDecodeError as exc:
            raise RecorderError(str(exc)) from None
        expected = (hi - lo, *out.shape[1:])
        if shape != expected or dtype != out.dtype:
            raise RecorderError(
                f"{what}: expected {out.dtype} of shape {list(expected)}, "
                f"got {dtype} of shape {list(shape)}"
            )
        try:
            _wire.decode_into(msg.codec, msg.data, out[lo:hi], what)
        except _wire.ArrayDecodeError as exc:
            raise RecorderError(str(exc)) from None

    def result(self) -> dict[str, np.ndarray]:
        if not self.seen.all():
            field, row = (int(i[0]) for i in np.nonzero(~self.seen))
            raise RecorderError(
                f"Finish: expected every row of every final field, row {row} of field "
                f"{self.names[field]!r} never arrived"
            )
        return dict(zip(self.names, self.arrays))


class _WorkerRows:
    """The rows of one worker, and what has arrived of its chunks."""

    def __init__(self, rows: np.ndarray, env: np.ndarray, start: np.ndarray, end: np.ndarray):
        self.rows, self.env, self.start, self.end = rows, env, start, end
        self.by_end = np.argsort(end, kind="stable")
        self.sorted_end = end[self.by_end]
        self.max_end = int(end.max())
        self.num_envs: int | None = None
        self.covered = 0  # steps 0..covered-1 have arrived

    def steps(self, t0: int, t1: int, n: int, t_max: int) -> tuple[np.ndarray, np.ndarray]:
        """(destination item in the (B * T_max) steps, source item in the chunk's T * N) of
        every step of these rows within steps t0..t1-1."""
        # Only rows ending after t0 and at most T_max after t1 can overlap the chunk.
        lo_row, hi_row = np.searchsorted(self.sorted_end, (t0, t1 + t_max), side="right")
        cand = self.by_end[lo_row:hi_row]
        start = self.start[cand]
        lo = np.maximum(start, t0)
        count = np.minimum(self.end[cand], t1) - lo
        keep = count > 0
        cand, start, lo, count = cand[keep], start[keep], lo[keep], count[keep]
        within = np.arange(int(count.sum()), dtype=np.int64)
        within -= np.repeat(np.cumsum(count) - count, count)
        dest = np.repeat(self.rows[cand] * t_max + lo - start, count) + within
        src = (np.repeat(lo - t0, count) + within) * n + np.repeat(self.env[cand], count)
        return dest, src


class _Frames:
    """The chunk-frames form of the stream: each chunk is checked here, in arrival order,
    then copied into the outputs by a pool thread."""

    def __init__(self, outputs: _Outputs) -> None:
        self.outputs = outputs
        h = outputs.header
        rows = outputs.lengths.size
        workers = np.asarray(h.workers, dtype=np.int64)
        env = np.asarray(h.envs, dtype=np.int64)
        start = np.asarray(h.starts, dtype=np.int64)
        if not workers.size == env.size == start.size == rows:
            raise RecorderError(
                f"Finish: expected {rows} workers, envs and starts, "
                f"got {workers.size}, {env.size} and {start.size}"
            )
        if rows and not 0 <= start.min() <= start.max() <= _INT64_MAX - outputs.max_length:
            raise RecorderError(
                f"Finish: expected starts within 0..{_INT64_MAX - outputs.max_length}, "
                f"got {start.min()}..{start.max()}"
            )
        end = start + outputs.lengths
        order = np.argsort(workers, kind="stable")
        ids, first = np.unique(workers[order], return_index=True)
        bounds = [*first.tolist(), rows]
        self.workers = {
            int(w): _WorkerRows(order[a:b], env[order[a:b]], start[order[a:b]], end[order[a:b]])
            for w, a, b in zip(ids, bounds, bounds[1:])
        }
        self.slots = rows * outputs.max_length
        self._local = threading.local()

    def check(self, msg: pb.ChunkFrames) -> tuple[_WorkerRows, list[tuple[int, np.dtype]]]:
        """The chunk's worker and its (field, frame) headers, checked against the header and
        the worker's chunks so far; nothing is decoded or allocated."""
        w, t0, length, n = int(msg.worker), int(msg.t0), int(msg.length), int(msg.num_envs)
        rows = self.workers.get(w)
        what = f"Finish: chunk at step {t0} of worker {w}"
        if rows is None:
            raise RecorderError(f"{what}: expected chunks of the workers of the episodes only")
        if t0 != rows.covered or (t0 and t0 >= rows.max_end):
            raise RecorderError(
                f"{what}: expected the chunk at step {rows.covered} (the episodes end by step "
                f"{rows.max_end})"
            )
        max_env = int(rows.env.max())
        if rows.num_envs is None and not 0 <= max_env < n:
            raise RecorderError(f"{what}: expected more than {max_env} environments, got {n}")
        if n != (rows.num_envs or n) or length < 0 or length * n > self.slots:
            raise RecorderError(
                f"{what}: expected {rows.num_envs or f'more than {max_env}'} environments and "
                f"at most {self.slots} steps in all, got {length} x {n}"
            )
        arrays = self.outputs.arrays
        if len(msg.fields) != len(arrays):
            raise RecorderError(f"{what}: expected {len(arrays)} fields, got {len(msg.fields)}")
        frames = []
        for i, (frame, out) in enumerate(zip(msg.fields, arrays)):
            label = f"{what}, field {self.outputs.names[i]!r}"
            expected = (length, n, *out.shape[2:])
            try:
                # No limit here: the shape must be `expected`, at most B x T_max steps.
                dtype, shape = _wire.check_header(
                    frame.dtype, frame.shape, frame.raw_size, label, _INT64_MAX
                )
            except _wire.ArrayDecodeError as exc:
                raise RecorderError(str(exc)) from None
            # Rewards are recorded in any numeric dtype and cast; other fields keep theirs.
            if shape != expected or (dtype != out.dtype and i != 1):
                raise RecorderError(
                    f"{label}: expected {out.dtype} of shape {list(expected)}, "
                    f"got {dtype} of shape {list(shape)}"
                )
            frames.append((i, dtype))
        rows.num_envs = n
        rows.covered = t0 + length
        return rows, frames

    def copy(
        self, rows: _WorkerRows, msg: pb.ChunkFrames, frames: list[tuple[int, np.dtype]]
    ) -> None:
        """Decode the chunk field by field and copy its steps into their rows."""
        t0, length, n = int(msg.t0), int(msg.length), int(msg.num_envs)
        dest, src = rows.steps(t0, t0 + length, n, self.outputs.max_length)
        if dest.size == 0:
            return
        for i, dtype in frames:
            out = self.outputs.arrays[i]
            if out.size == 0:
                continue
            frame = msg.fields[i]
            flat = self._scratch(frame.raw_size).view(dtype).reshape(tuple(frame.shape))
            label = f"Finish: chunk at step {t0} of worker {int(msg.worker)}, field {i}"
            try:
                _wire.decode_into(frame.codec, frame.data, flat, label)
            except _wire.ArrayDecodeError as exc:
                raise RecorderError(str(exc)) from None
            if flat.dtype == out.dtype:
                _as_steps(out, 2)[dest] = _as_steps(flat, 2)[src]
            else:  # the cast the server's parts make (rewards -> float32)
                trailing = out.shape[2:]
                with np.errstate(over="ignore", invalid="ignore"):
                    picked = flat.reshape(-1, *trailing)[src].astype(out.dtype)
                out.reshape(-1, *trailing)[dest] = picked

    def _scratch(self, size: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < size:
            buf = self._local.buf = np.empty(size, dtype=np.uint8)
        return buf[:size]

    def check_complete(self) -> None:
        for w, rows in self.workers.items():
            if rows.covered < rows.max_end:
                raise RecorderError(
                    f"Finish: expected worker {w}'s chunks up to step {rows.max_end}, "
                    f"got them up to step {rows.covered}"
                )


def _as_steps(a: np.ndarray, axes: int) -> np.ndarray:
    """A C-contiguous array with `axes` leading step axes as a 1-d array of opaque steps."""
    steps = int(np.prod(a.shape[:axes]))
    raw = a.reshape(steps, -1).view(np.uint8)
    return raw.view(np.dtype((np.void, raw.shape[1])))[:, 0]


def assemble(parts: Iterable[pb.FinishPart]) -> Trajectory:
    """The padded trajectory a Finish stream carries."""
    outputs: _Outputs | None = None
    frames: _Frames | None = None
    pending: deque[Future[None]] = deque()
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="finish") as pool:
        try:
            for part in parts:
                kind = part.WhichOneof("kind")
                if kind == "header":
                    if outputs is not None:
                        raise RecorderError("Finish: the server sent a second header")
                    outputs = _Outputs(part.header)
                elif outputs is None:
                    raise RecorderError("Finish: the server sent data before the header")
                elif kind == "final":
                    outputs.finals.add(part.final)
                elif kind == "chunk":
                    frames = frames or _Frames(outputs)
                    rows, checked = frames.check(part.chunk)
                    pending.append(pool.submit(frames.copy, rows, part.chunk, checked))
                    while len(pending) > _CHUNKS_AHEAD:
                        pending.popleft().result()
                else:
                    outputs.add(part.array)
            while pending:
                pending.popleft().result()
        finally:
            for future in pending:  # after an error: the rest is not needed
                future.cancel()
    if outputs is None:
        raise RecorderError("Finish: the server sent no header")
    return outputs.trajectory(frames)


def raises_on_loss(on_data_loss: str) -> bool:
    """Whether data loss raises DataLossError (``"raise"``) or is logged (``"continue"``)."""
    if on_data_loss not in ("raise", "continue"):
        raise ValueError(f"on_data_loss: expected 'raise' or 'continue', got {on_data_loss!r}")
    return on_data_loss == "raise"


def checked(result: Trajectory, raise_loss: bool) -> Trajectory:
    """finish()'s result, after a WARNING when chunks it reads hold zeros for frames found
    not to decode after their ack; with ``raise_loss`` a DataLossError carrying it instead."""
    count = result.num_corrupt_chunks
    if not count:
        return result
    listed = result.corrupt_chunks
    more = f" (and {count - len(listed)} more)" if count > len(listed) else ""
    error = DataLossError(
        f"finish(): {count} acknowledged chunk(s) read as zeros where a frame did not decode: "
        f"{listed[0] if listed else '?'}{more}; this error's .trajectory is the result, whose "
        ".corrupt_chunks lists them",
        trajectory=result,
    )
    logger.warning("%s", error)
    if raise_loss:
        raise error
    return result
