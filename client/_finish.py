"""The client's half of finish(): the Finish stream decoded into the padded result.

The header gives every output's shape and each episode's length; each part then carries the
real steps of a run of rows (no padding), which land in zeroed arrays. Everything the server
sends is checked against the header before it is used: a malformed stream raises
RecorderError naming what was expected and what arrived.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from . import _wire
from ._proto import recorder_pb2 as pb
from .errors import RecorderError
from .trajectory import Trajectory

# Steps scattered per fancy-indexed copy (at least one row).
_SCATTER_STEPS = 1 << 20


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

    def trajectory(self) -> Trajectory:
        if not self.seen.all():
            field, row = (int(i[0]) for i in np.nonzero(~self.seen))
            raise RecorderError(
                f"Finish: expected every row of every field, row {row} of field "
                f"{self.names[field]!r} never arrived"
            )
        h = self.header
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
        )


def _as_steps(a: np.ndarray, axes: int) -> np.ndarray:
    """A C-contiguous array with `axes` leading step axes as a 1-d array of opaque steps."""
    steps = int(np.prod(a.shape[:axes]))
    raw = a.reshape(steps, -1).view(np.uint8)
    return raw.view(np.dtype((np.void, raw.shape[1])))[:, 0]


def assemble(parts: Iterable[pb.FinishPart]) -> Trajectory:
    """The padded trajectory a Finish stream carries."""
    outputs: _Outputs | None = None
    for part in parts:
        if part.WhichOneof("kind") == "header":
            if outputs is not None:
                raise RecorderError("Finish: the server sent a second header")
            outputs = _Outputs(part.header)
        elif outputs is None:
            raise RecorderError("Finish: the server sent data before the header")
        else:
            outputs.add(part.array)
    if outputs is None:
        raise RecorderError("Finish: the server sent no header")
    return outputs.trajectory()
