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
