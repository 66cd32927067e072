"""The client's Finish assembly on hand-made streams: a valid one gives the padded arrays,
and every malformed one raises RecorderError naming what was expected and what arrived."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from recorder_client import _finish
from recorder_client._finish import assemble
from recorder_client._messages import array_to_proto
from recorder_client._proto import recorder_pb2 as pb
from recorder_client.errors import RecorderError

LENGTHS = [3, 0, 5, 1, 5]
T_MAX = 5
FIELDS = [("actions", "<i4", ()), ("rewards", "<f4", ()), ("positions", "<i4", (1, 3))]


def _padded() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for _, dtype, trailing in FIELDS:
        a = np.zeros((len(LENGTHS), T_MAX, *trailing), dtype=dtype)
        for row, n in enumerate(LENGTHS):
            a[row, :n] = rng.integers(1, 100, size=(n, *trailing))
        out.append(a)
    return out


def _stream() -> list[pb.FinishPart]:
    header = pb.FinishHeader(
        num_episodes=len(LENGTHS),
        max_length=T_MAX,
        fields=[
            pb.FieldSpec(name=name, dtype=dtype, shape=[len(LENGTHS), T_MAX, *trailing])
            for name, dtype, trailing in FIELDS
        ],
        lengths=LENGTHS,
        workers=[0] * len(LENGTHS),
        envs=range(len(LENGTHS)),
        starts=[0] * len(LENGTHS),
        done=[True] * len(LENGTHS),
        worker_ids=["w"],
    )
    parts = [pb.FinishPart(header=header)]
    for field, padded in enumerate(_padded()):
        for lo, hi in ((0, 2), (2, 5)):  # two parts a field, rows 0:2 and 2:5
            flat = np.concatenate([padded[r, :n] for r, n in enumerate(LENGTHS[lo:hi], lo)])
            parts.append(
                pb.FinishPart(
                    array=pb.ArrayPart(
                        field=field, row_start=lo, row_count=hi - lo, array=array_to_proto(flat)
                    )
                )
            )
    return parts


@pytest.mark.parametrize("group", [1 << 20, 4, 1])
def test_a_valid_stream_gives_the_padded_arrays(monkeypatch, group):
    # Small groups scatter a part's rows a few at a time (a row at a time for 1).
    monkeypatch.setattr(_finish, "_SCATTER_STEPS", group)
    traj = assemble(_stream())
    expected = _padded()
    for got, want in zip((traj.actions, traj.rewards, traj.positions), expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)
    assert traj.lengths.tolist() == LENGTHS


def _set_array(index: int, arr: np.ndarray) -> Callable[[list[pb.FinishPart]], None]:
    def edit(parts: list[pb.FinishPart]) -> None:
        parts[index].array.array.CopyFrom(array_to_proto(arr))

    return edit


MALFORMED: dict[str, tuple[Callable[[list[pb.FinishPart]], object], str]] = {
    "no header": (lambda p: p.pop(0), "data before the header"),
    "nothing": (lambda p: p.clear(), "no header"),
    "second header": (lambda p: p.insert(1, p[0]), "second header"),
    "field out of range": (
        lambda p: setattr(p[1].array, "field", 3),
        "within 3 fields and 5 rows, got rows 0:2 of field 3",
    ),
    "rows out of range": (
        lambda p: setattr(p[2].array, "row_count", 4),
        "got rows 2:6 of field 0",
    ),
    # (steps, 1, 1) would broadcast into (steps, 1, 3) without the shape check.
    "trailing shape": (
        _set_array(5, np.ones((3, 1, 1), dtype=np.int32)),
        "expected int32 of shape [3, 1, 3], got int32 of shape [3, 1, 1]",
    ),
    "dtype": (_set_array(1, np.ones(3, dtype=np.int64)), "expected int32 of shape [3]"),
    "step count": (_set_array(1, np.ones(4, dtype=np.int32)), "shape [3], got int32 of shape [4]"),
    "raw size": (
        lambda p: setattr(p[1].array.array, "raw_size", 13),
        "expected 12 bytes for dtype <i4 and shape [3], got 13",
    ),
    "more than the output": (
        _set_array(1, np.ones(26, dtype=np.int32)),
        "expected at most 100 bytes, got 104",
    ),
    "corrupt frame": (
        lambda p: setattr(p[1].array.array, "data", p[1].array.array.data[:-3]),
        "rows 0:2 of field 'actions'.data",
    ),
    "rows twice": (lambda p: p.insert(2, p[1]), "rows 0:2 of field 'actions' arrived twice"),
    "rows missing": (lambda p: p.pop(4), "row 2 of field 'rewards' never arrived"),
    "length over T_max": (
        lambda p: p[0].header.lengths.__setitem__(2, 6),
        "expected lengths within 0..T_max=5",
    ),
    "negative length": (
        lambda p: p[0].header.lengths.__setitem__(1, -1),
        "expected lengths within 0..T_max=5",
    ),
    "rows of a field": (
        lambda p: p[0].header.fields[1].shape.__setitem__(0, 4),
        "fields['rewards']: expected a shape (B=5, T_max, ...), got [4, 5]",
    ),
    "T_max of a field": (
        lambda p: p[0].header.fields[2].shape.__setitem__(1, 4),
        "expected lengths within 0..T_max=5 for every field",
    ),
    "one field": (
        lambda p: p[0].header.ClearField("fields"),
        "expected at least the actions and rewards fields",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_stream_raises_recorder_error(case):
    edit, message = MALFORMED[case]
    parts = _stream()
    edit(parts)
    with pytest.raises(RecorderError) as info:
        assemble(parts)
    assert message in str(info.value)


# -- chunk frames: the stored chunks, copied out by the client ------------------------------

# Per worker: its N, chunk lengths, and episodes (env, start, end); worker 1 has 3 envs and
# an empty tail. Episodes span chunks.
WORKERS = [
    (2, [3, 4], [(0, 0, 3), (0, 3, 7), (1, 0, 5)]),
    (3, [5], [(0, 0, 2), (2, 0, 5), (1, 5, 5)]),
]
CHUNK_T_MAX = 5


def _recorded(seed: int, t: int, n: int) -> list[np.ndarray]:
    """One worker's (T, N, ...) fields as recorded: rewards in float64."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, 100, size=(t, n)).astype(np.int32),
        rng.normal(size=(t, n)),
        rng.integers(1, 100, size=(t, n, 1, 3)).astype(np.int32),
    ]


def _chunk_stream() -> tuple[list[pb.FinishPart], list[np.ndarray]]:
    rows = [(w, e, s, end) for w, (_, _, eps) in enumerate(WORKERS) for e, s, end in eps]
    header = pb.FinishHeader(
        num_episodes=len(rows),
        max_length=CHUNK_T_MAX,
        fields=[
            pb.FieldSpec(name=name, dtype=dtype, shape=[len(rows), CHUNK_T_MAX, *trailing])
            for name, dtype, trailing in FIELDS
        ],
        lengths=[end - s for _, _, s, end in rows],
        workers=[w for w, *_ in rows],
        envs=[e for _, e, _, _ in rows],
        starts=[s for _, _, s, _ in rows],
        done=[True] * len(rows),
        worker_ids=["a", "b"],
    )
    parts = [pb.FinishPart(header=header)]
    expected = [np.zeros(spec.shape, dtype=spec.dtype) for spec in header.fields]
    for w, (n, chunk_lengths, _) in enumerate(WORKERS):
        fields = _recorded(w, sum(chunk_lengths), n)
        t0 = 0
        for length in chunk_lengths:
            msg = pb.ChunkFrames(worker=w, t0=t0, length=length, num_envs=n)
            for f in fields:
                msg.fields.append(array_to_proto(f[t0 : t0 + length]))
            parts.append(pb.FinishPart(chunk=msg))
            t0 += length
        for row, (rw, e, s, end) in enumerate(rows):
            if rw == w:
                for out, f in zip(expected, fields):
                    out[row, : end - s] = f[s:end, e]
    return parts, expected


def test_chunk_frames_give_the_padded_arrays():
    parts, expected = _chunk_stream()
    traj = assemble(parts)
    for got, want in zip((traj.actions, traj.rewards, traj.positions), expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)
    assert list(traj.worker_ids) == ["a", "b"]


def _set_frame(index: int, field: int, arr: np.ndarray) -> Callable[[list[pb.FinishPart]], None]:
    def edit(parts: list[pb.FinishPart]) -> None:
        parts[index].chunk.fields[field].CopyFrom(array_to_proto(arr))

    return edit


MALFORMED_CHUNKS: dict[str, tuple[Callable[[list[pb.FinishPart]], object], str]] = {
    "a missing chunk": (
        lambda p: p.pop(2),
        "expected worker 0's chunks up to step 7, got them up to step 3",
    ),
    "a skipped chunk": (
        lambda p: p.pop(1),
        "chunk at step 3 of worker 0: expected the chunk at step 0",
    ),
    "a chunk twice": (
        lambda p: p.insert(2, p[1]),
        "chunk at step 0 of worker 0: expected the chunk at step 3",
    ),
    "an unknown worker": (
        lambda p: setattr(p[3].chunk, "worker", 7),
        "worker 7: expected chunks of the workers of the episodes only",
    ),
    "an episode outside the envs": (
        lambda p: p[0].header.envs.__setitem__(3, 3),
        "worker 1: expected more than 3 environments, got 3",
    ),
    "N changes": (
        lambda p: setattr(p[2].chunk, "num_envs", 3),
        "expected 2 environments and at most 30 steps in all, got 4 x 3",
    ),
    "more steps than the result": (
        lambda p: setattr(p[1].chunk, "length", 16),
        "at most 30 steps in all, got 16 x 2",
    ),
    "a negative start": (
        lambda p: p[0].header.starts.__setitem__(0, -1),
        "expected starts within 0..",
    ),
    "a field missing": (lambda p: p[1].chunk.fields.pop(), "expected 3 fields, got 2"),
    "a frame's dtype": (
        _set_frame(1, 0, np.ones((3, 2), dtype=np.int64)),
        "field 'actions': expected int32 of shape [3, 2], got int64 of shape [3, 2]",
    ),
    "a frame's shape": (
        _set_frame(1, 2, np.ones((3, 2, 1, 1), dtype=np.int32)),
        "expected int32 of shape [3, 2, 1, 3], got int32 of shape [3, 2, 1, 1]",
    ),
    "a frame's raw size": (
        lambda p: setattr(p[1].chunk.fields[0], "raw_size", 25),
        "expected 24 bytes for dtype <i4 and shape [3, 2], got 25",
    ),
    "a corrupt frame": (
        lambda p: setattr(p[1].chunk.fields[1], "data", p[1].chunk.fields[1].data[:-3]),
        "chunk at step 0 of worker 0, field 1.data",
    ),
    "parts and chunks": (
        lambda p: p.append(
            pb.FinishPart(
                array=pb.ArrayPart(
                    field=0, row_start=0, row_count=1, array=array_to_proto(np.ones(3, np.int32))
                )
            )
        ),
        "expected either array parts or chunks, got both",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CHUNKS))
def test_malformed_chunk_frames_raise_recorder_error(case):
    edit, message = MALFORMED_CHUNKS[case]
    parts, _ = _chunk_stream()
    edit(parts)
    with pytest.raises(RecorderError) as info:
        assemble(parts)
    assert message in str(info.value)
