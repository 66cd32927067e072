"""What record() checks before it queues a chunk: its shapes against (T, N), and its
layout (N, dtypes, trailing shapes, state fields) against the worker's earlier chunks.

Each refusal the server would send for a layout the client can see is raised here first,
naming the field, what was expected and what arrived.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _torch, _wire
from .capture_types import TrajectoryTrainingConfiguration
from .errors import InvalidChunkError

#: A chunk's layout: each array's key -> (shape, dtype); outcome codes are left out.
Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


# Optional chunk by chunk: outside a worker's fixed layout.
_OPTIONAL = frozenset({"outcome", "terminated", "truncated", "valid"})
_MASKS = ("terminated", "truncated", "valid")


def _is_obs(key: str) -> bool:
    return key == "state:obs" or key.startswith("state:obs.")


def _label(key: str) -> str:
    if _is_obs(key):
        return f"trajectories.{key[len('state:') :]}"
    if key.startswith("final:"):
        return f"trajectories.final_obs ({key[len('final:') :]})"
    if key.startswith("state:"):
        return key.replace("state:", "env_states.")
    return f"trajectories.{key}"


def _fixed(key: str) -> bool:
    return key not in _OPTIONAL and not key.startswith("final:")


def check_kept_tensors(arrays: dict[str, Any]) -> None:
    """The CPU tensors record() kept after two properties (see _torch.KEPT): refused here,
    naming the field, when nested or of a dtype numpy does not hold. Called before anything
    reads their shapes or values."""
    tensor = _torch.KEPT[0]
    if tensor is None:
        return
    for key, value in arrays.items():
        if type(value) is tensor:
            _torch.check_kept(value, _label(key))


def check_outcome(codes: Any) -> None:
    if np.dtype(codes.dtype).kind not in "iu":
        raise InvalidChunkError(
            f"trajectories.outcome: expected integer codes, got dtype {codes.dtype}"
        )
    # A device array's values are not read here (that would wait for the device); the
    # server checks them, and refuses that chunk alone.
    if (
        isinstance(codes, np.ndarray)
        and codes.size
        and (int(codes.min()) < 0 or int(codes.max()) > 4)
    ):
        bad = codes[(codes < 0) | (codes > 4)].ravel()[0]
        raise InvalidChunkError(
            "trajectories.outcome: expected codes 0 (unknown), 1 (win), 2 (loss), "
            f"3 (draw) or 4 (incomplete), got {int(bad)}"
        )


def check_layout(
    arrays: dict[str, Any], previous: Layout | None, capture: TrajectoryTrainingConfiguration | None
) -> tuple[int, Layout]:
    """Every check of a chunk, against ``previous`` (the worker's layout, None before its
    first chunk); returns its bytes per step (every array has the same T once checked)
    and its layout."""
    schema = {k: (tuple(v.shape), _torch.dtype_of(v)) for k, v in arrays.items()}
    a_shape = schema["action"][0]
    if len(a_shape) not in (2, 3):
        raise InvalidChunkError(
            f"trajectories.action: expected shape (T, N) or (T, N, P), got {a_shape}"
        )
    if a_shape[1] < 1:  # the worker's N would be fixed at 0, and every later chunk refused
        raise InvalidChunkError(
            f"trajectories.action: expected N >= 1 environments, got shape {a_shape}"
        )
    tn = a_shape[:2]
    for key, (shape, dtype) in schema.items():
        label = _label(key)
        if key != "action" and key.startswith("state:") and shape[:2] != tn:
            raise InvalidChunkError(
                f"{label}: expected shape starting with (T, N) = {tn}, got {shape}"
            )
        if key in ("reward", "done", "outcome", *_MASKS) and shape != tn:
            raise InvalidChunkError(
                f"trajectories.{key}: expected shape (T, N) = {tn}, got {shape}"
            )
        if key in _MASKS and dtype != np.bool_:
            raise InvalidChunkError(f"trajectories.{key}: expected dtype bool, got {dtype}")
        if key.startswith("final:"):
            want = schema.get("state:" + key[len("final:") :])
            if want is not None and (shape, dtype) != want:
                raise InvalidChunkError(
                    f"{label}: expected {want[1]} of shape {want[0]} like the observation, "
                    f"got {dtype} of shape {shape}"
                )
        if key == "outcome" and dtype.kind not in "iu":
            raise InvalidChunkError(
                f"trajectories.outcome: expected integer codes, got dtype {dtype}"
            )
        try:
            _wire.check_dtype(dtype, label)
        except ValueError as exc:
            raise InvalidChunkError(str(exc)) from None
    observed = [k[len("state:") :] for k in schema if _is_obs(k)]
    fields = sum(k.startswith("state:") for k in schema)
    if fields > _wire.MAX_STATE_FIELDS:
        raise InvalidChunkError(
            f"{'trajectories.obs' if observed else 'env_states'}: expected at most "
            f"{_wire.MAX_STATE_FIELDS} state fields (observation fields and env_states "
            f"together), got {fields}"
        )
    problem = _wire.obs_names_error(observed) if observed else None
    if problem is not None:  # trajectories.obs flattens to good names: env_states' are not
        raise InvalidChunkError(f"env_states: {problem}")
    if capture is not None:  # the store keys cells on them: the server refuses without
        for cell in capture.cell_fields:
            if f"state:{cell.state_field}" not in schema:
                got = sorted(k[6:] for k in schema if k.startswith("state:"))
                raise InvalidChunkError(
                    f"env_states: expected the cell-key field {cell.state_field!r} of the "
                    f"session's capture configuration (record it with record_states=True), "
                    f"got fields {got}"
                )
    # Outcome codes, flags, the valid mask and final observations are optional chunk by
    # chunk; everything else must stay the same.
    fixed = {k: v for k, v in schema.items() if _fixed(k)}
    if previous is not None:
        check_against(previous, fixed)
    step = sum(int(np.prod(s[1:], dtype=np.int64)) * d.itemsize for s, d in schema.values())
    return step, fixed


def check_against(previous: Layout, schema: Layout) -> None:
    obs_before = sorted(k[len("state:") :] for k in previous if _is_obs(k))
    obs_now = sorted(k[len("state:") :] for k in schema if _is_obs(k))
    if obs_before != obs_now:
        raise InvalidChunkError(
            f"trajectories.obs: expected the keys {obs_before} like this worker's earlier "
            f"chunks, got {obs_now}"
        )
    if set(previous) != set(schema):
        want = sorted(k[6:] for k in previous if k.startswith("state:"))
        got = sorted(k[6:] for k in schema if k.startswith("state:"))
        raise InvalidChunkError(
            f"env_states: expected state fields {want} like this worker's earlier chunks, got {got}"
        )
    n_prev, n_now = previous["action"][0][1], schema["action"][0][1]
    if n_prev != n_now:
        raise InvalidChunkError(
            f"N: expected {n_prev} environments like this worker's earlier chunks, got {n_now}"
        )
    for key, (shape, dtype) in schema.items():
        p_shape, p_dtype = previous[key]
        label = _label(key)
        if dtype != p_dtype:
            raise InvalidChunkError(
                f"{label}.dtype: expected {p_dtype} like this worker's earlier chunks, got {dtype}"
            )
        if shape[2:] != p_shape[2:]:
            raise InvalidChunkError(
                f"{label}.shape: expected trailing shape {p_shape[2:]} after (T, N) like "
                f"this worker's earlier chunks, got {shape[2:]}"
            )


def check_flags(
    arrays: dict[str, Any], open_empty: np.ndarray | None, done_given: bool = True
) -> np.ndarray | None:
    """The values of the flags and the valid mask (host arrays only; the server checks a
    device array's): ``done`` is terminated | truncated (not compared when ``done_given`` is
    False: it was made as their OR), and a row marked False stands only where the env's
    open episode has no step yet (``open_empty``: (N,) before this chunk, None when not
    known) and carries no flag. Returns ``open_empty`` after the chunk."""
    done = arrays["done"]
    if _torch.is_tensor(done):  # its values are read here
        done = arrays["done"] = _torch.host_view(done)
    masks = [arrays[k] for k in ("terminated", "truncated", "valid") if k in arrays]
    # Shapes and dtypes are check_layout's to refuse (called after this, before the chunk
    # fixes the worker's layout): their values are read only when they are right.
    if (
        not isinstance(done, np.ndarray)
        or done.ndim != 2
        or not all(
            isinstance(m, np.ndarray) and m.shape == done.shape and m.dtype == np.bool_
            for m in masks
        )
    ):
        return None
    if done.dtype != np.bool_:
        done = done.astype(bool)
    if done_given and "terminated" in arrays:
        term, trunc = arrays["terminated"], arrays["truncated"]
        cell = _wire.flags_disagree(done, term, trunc)
        if cell is not None:
            row, env = cell
            raise InvalidChunkError(
                "trajectories.done: expected terminated | truncated, got "
                f"done={bool(done[row, env])} with terminated={bool(term[row, env])} and "
                f"truncated={bool(trunc[row, env])} at row {row}, env {env}"
            )
    valid = arrays.get("valid")
    if valid is None:
        return None
    if not done.shape[0]:
        return open_empty
    if valid.all():
        return done[-1].copy()
    invalid = ~valid  # made once: the rules below and the open episodes all read it
    cell = _wire.flag_on_invalid_row(valid, done, invalid)
    if cell is not None:
        row, env = cell
        raise InvalidChunkError(
            f"trajectories.valid: expected no done, terminated or truncated flag on a "
            f"row marked False, got one at row {row}, env {env}"
        )
    cell = _wire.invalid_row_in_episode(valid, done, open_empty, invalid)
    if cell is not None:
        row, env = cell
        raise InvalidChunkError(
            f"trajectories.valid: expected True at row {row}, env {env}, got False: a "
            "row outside every episode may only stand where the env's open episode has "
            "no step yet (its first row, right after a done, or after another False row)"
        )
    return done[-1] | invalid[-1]
