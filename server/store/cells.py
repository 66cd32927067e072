"""Episodes as arrays, and the per-step cell keys computed from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recorder_client.capture_types import CellField
from recorder_client.naming import STATE_TO_TRAJECTORY

# Either spelling of a renamed field finds the other (player_positions <-> positions).
_ALIASES: dict[str, str] = {
    **STATE_TO_TRAJECTORY,
    **{v: k for k, v in STATE_TO_TRAJECTORY.items()},
}


@dataclass(frozen=True, eq=False)
class EpisodeArrays:
    """One episode (or a prefix of one) as numpy arrays with a common leading length L."""

    actions: np.ndarray
    """Actions, shape (L,) or (L, ...), any numeric dtype."""
    rewards: np.ndarray
    """Rewards, shape (L,), numeric; the store accumulates them in float64."""
    states: dict[str, np.ndarray] = field(default_factory=dict)
    """State fields keyed by their original env-state names (e.g. ``player_positions``),
    each of shape (L, ...)."""

    def __post_init__(self) -> None:
        actions = np.asarray(self.actions)
        rewards = np.asarray(self.rewards)
        if rewards.ndim != 1:
            raise ValueError(f"rewards: expected shape (L,), got {rewards.shape}")
        length = rewards.shape[0]
        if actions.ndim < 1 or actions.shape[0] != length:
            raise ValueError(f"actions: expected leading length {length}, got {actions.shape}")
        for name, arr in (("actions", actions), ("rewards", rewards)):
            if arr.dtype.kind not in "biuf":
                raise ValueError(f"{name}: expected a numeric dtype, got {arr.dtype}")
        if not isinstance(self.states, Mapping):
            raise ValueError(f"states: expected a mapping of arrays, got {type(self.states)}")
        states = {}
        for name, value in self.states.items():
            arr = np.asarray(value)
            if arr.ndim < 1 or arr.shape[0] != length:
                raise ValueError(
                    f"states[{name!r}]: expected leading length {length}, got {arr.shape}"
                )
            states[str(name)] = arr
        object.__setattr__(self, "actions", actions)
        object.__setattr__(self, "rewards", rewards)
        object.__setattr__(self, "states", states)

    @property
    def length(self) -> int:
        """Number of steps L."""
        return int(self.rewards.shape[0])

    def prefix(self, step: int) -> EpisodeArrays:
        """A copy of steps 0..step (inclusive)."""
        if not 0 <= step < self.length:
            raise ValueError(f"step: expected 0 <= step < {self.length}, got {step}")
        end = step + 1
        return EpisodeArrays(
            actions=self.actions[:end].copy(),
            rewards=self.rewards[:end].copy(),
            states={k: v[:end].copy() for k, v in self.states.items()},
        )

    @classmethod
    def coerce(cls, value: Any) -> EpisodeArrays:
        """Accept an EpisodeArrays, or a mapping / object with actions, rewards (and states)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            get = value.get
        else:

            def get(name: str, default: Any = None) -> Any:
                return getattr(value, name, default)

        actions, rewards = get("actions"), get("rewards")
        if actions is None or rewards is None:
            raise ValueError(
                f"trajectory: expected EpisodeArrays or actions/rewards/states, got {type(value)}"
            )
        return cls(actions=actions, rewards=rewards, states=dict(get("states", None) or {}))


def field_column(spec: CellField, states: Mapping[str, np.ndarray], length: int) -> np.ndarray:
    """The (L,) int64 column of one cell field: value at ``spec.index`` floor-divided by bucket."""
    arr = states.get(spec.state_field)
    if arr is None and spec.state_field in _ALIASES:
        arr = states.get(_ALIASES[spec.state_field])
    if arr is None:
        raise ValueError(
            f"states: cell field {spec.state_field!r} is missing; episode has {sorted(states)}"
        )
    arr = np.asarray(arr)
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
    if col.dtype.kind == "b":
        col = col.astype(np.int64)
    elif col.dtype.kind == "f":
        if not np.isfinite(col).all():
            raise ValueError(f"states[{spec.state_field!r}]: non-finite value in a cell field")
    elif col.dtype.kind not in "iu":
        raise ValueError(f"states[{spec.state_field!r}]: expected a numeric dtype, got {col.dtype}")
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


@dataclass(frozen=True, eq=False)
class EpisodeCells:
    """The distinct cells of one episode, in some fixed order."""

    keys: np.ndarray
    """(U, F) int64 distinct cell keys."""
    key_ids: list[bytes]
    """The same keys as bytes (dict keys of the archive index)."""
    first_step: np.ndarray
    """(U,) first step at which each cell is visited."""
    inverse: np.ndarray
    """(L,) index into ``keys`` of each step's cell."""
    best_step: np.ndarray
    """(U,) the step with the highest cumulative reward in the cell, earliest on a tie."""
    best_return: np.ndarray
    """(U,) cumulative reward (float64, up to and including ``best_step``)."""


def group_episode(keys: np.ndarray, cumulative: np.ndarray) -> EpisodeCells:
    """Group steps by cell and find each cell's best step within the episode."""
    voids = key_bytes(keys)
    uniq, first, inverse = np.unique(voids, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    steps = np.arange(keys.shape[0])
    # Primary key cell, then cumulative reward descending, then step ascending.
    order = np.lexsort((steps, -cumulative, inverse))
    sorted_cells = inverse[order]
    starts = np.flatnonzero(np.r_[True, sorted_cells[1:] != sorted_cells[:-1]])
    best = order[starts]
    return EpisodeCells(
        keys=keys[first],
        key_ids=uniq.tolist(),
        first_step=first,
        inverse=inverse,
        best_step=best,
        best_return=cumulative[best],
    )
