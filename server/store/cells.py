"""Cell keys: the per-step key columns computed from state arrays, and keys as bytes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from recorder_client._wire import STATE_ALIASES
from recorder_client.capture_types import CellField


def find_state(states: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    """The state array called ``name``, or by the other spelling of a renamed field
    (``player_positions`` / ``positions``); None when neither is there."""
    arr = states.get(name)
    if arr is None:
        alias = STATE_ALIASES.get(name)
        if alias is not None:
            arr = states.get(alias)
    return None if arr is None else np.asarray(arr)


def field_column(spec: CellField, states: Mapping[str, np.ndarray], length: int) -> np.ndarray:
    """The (L,) int64 column of one cell field: value at ``spec.index`` floor-divided by bucket."""
    arr = _state_array(states, spec.state_field)
    if arr.ndim != 1 + len(spec.index):
        raise ValueError(
            f"states[{spec.state_field!r}]: per-step shape {arr.shape[1:]} does not take index "
            f"{spec.index} to a scalar"
        )
    if any(i >= n for i, n in zip(spec.index, arr.shape[1:], strict=True)):
        raise ValueError(
            f"states[{spec.state_field!r}]: index {spec.index} out of range for per-step shape "
            f"{arr.shape[1:]}"
        )
    col = arr[(slice(None), *spec.index)]
    kind = col.dtype.kind
    if kind == "b" or kind == "i" or (kind == "u" and col.dtype.itemsize < 8):
        # Exact in int64, so widen first (one contiguous copy) and divide in place.
        out = col.astype(np.int64)
        bucket = spec.bucket
        if bucket != 1:
            if bucket & (bucket - 1) == 0:
                np.right_shift(out, bucket.bit_length() - 1, out=out)  # floor division
            else:
                np.floor_divide(out, bucket, out=out)
    else:
        if kind == "f":
            if not np.isfinite(col).all():
                raise ValueError(f"states[{spec.state_field!r}]: non-finite value in a cell field")
        elif kind != "u":
            raise ValueError(
                f"states[{spec.state_field!r}]: expected a numeric dtype, got {col.dtype}"
            )
        if spec.bucket != 1:
            col = np.floor_divide(col, spec.bucket)
        out = col.astype(np.int64)
    if out.shape != (length,):
        raise ValueError(f"states[{spec.state_field!r}]: expected {length} steps, got {out.shape}")
    return out


def cell_keys(specs: tuple[CellField, ...], states: Mapping[str, np.ndarray], length: int):
    """The (L, F) int64 cell key of every step."""
    keys = np.empty((length, len(specs)), dtype=np.int64)
    for j, spec in enumerate(specs):
        keys[:, j] = field_column(spec, states, length)
    return keys


def key_bytes(keys: np.ndarray) -> np.ndarray:
    """Each (F,) int64 row as one fixed-size void scalar (hashable via ``.tolist()`` -> bytes)."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    return keys.view(np.dtype((np.void, 8 * keys.shape[1]))).reshape(keys.shape[0])


def _state_array(states: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    arr = find_state(states, name)
    if arr is None:
        raise ValueError(f"states: cell field {name!r} is missing; episode has {sorted(states)}")
    return arr


def batch_cell_columns(
    specs: tuple[CellField, ...],
    states: list[Mapping[str, np.ndarray]],
    lengths: list[int],
) -> np.ndarray:
    """The (F, S) int64 cell-key columns of several episodes' steps, concatenated in order.

    ``states[i]`` holds episode i's state fields and ``lengths[i]`` its length. Each state
    field is concatenated once and keyed in one pass when every episode gives it the same
    dtype and per-step shape; otherwise each episode is keyed on its own (keys never depend
    on how episodes are batched).
    """
    total = int(sum(lengths))
    columns = np.empty((len(specs), total), dtype=np.int64)
    if not states:
        return columns
    by_field: dict[str, list[int]] = {}
    for j, spec in enumerate(specs):
        by_field.setdefault(spec.state_field, []).append(j)
    for name, js in by_field.items():
        arrays = [_state_array(st, name) for st in states]
        head = arrays[0]
        if all(a.dtype == head.dtype and a.shape[1:] == head.shape[1:] for a in arrays):
            whole = {name: head if len(arrays) == 1 else np.concatenate(arrays)}
            for j in js:
                columns[j] = field_column(specs[j], whole, total)
        else:
            for j in js:
                columns[j] = np.concatenate(
                    [
                        field_column(specs[j], {name: a}, n)
                        for a, n in zip(arrays, lengths, strict=True)
                    ]
                )
    return columns
