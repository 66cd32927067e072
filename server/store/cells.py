"""Episodes as arrays, and the per-step cell keys computed from them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    arr = states.get(name)
    if arr is None and name in _ALIASES:
        arr = states.get(_ALIASES[name])
    if arr is None:
        raise ValueError(f"states: cell field {name!r} is missing; episode has {sorted(states)}")
    return np.asarray(arr)


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


@dataclass(frozen=True, eq=False)
class EpisodeBatch:
    """Several episodes as one set of concatenated arrays plus their lengths.

    The cheap input form of :meth:`TrajectoryStore.record_episode_batch`: episode i is steps
    ``offsets[i]..offsets[i+1]-1`` of every array. Recording a batch is identical to recording
    ``batch.episode(i)`` one by one (stored trajectories are slices of these arrays, so keep
    dtypes what the per-episode arrays would have been).
    """

    actions: np.ndarray
    """(S,) or (S, ...) actions of all episodes, back to back."""
    rewards: np.ndarray
    """(S,) rewards, numeric."""
    states: dict[str, np.ndarray]
    """State fields, each (S, ...)."""
    lengths: np.ndarray
    """(E,) episode lengths (>= 0) summing to S."""
    offsets: np.ndarray = field(init=False, repr=False)
    """(E+1,) start of each episode, then S."""

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths)
        if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
            raise ValueError(f"lengths: expected a 1-d int array, got {lengths!r}")
        lengths = lengths.astype(np.int64)
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"lengths: expected lengths >= 0, got {lengths.min()}")
        whole = EpisodeArrays(self.actions, self.rewards, self.states)
        if int(lengths.sum()) != whole.length:
            raise ValueError(
                f"lengths: sum to {int(lengths.sum())}, but the arrays hold {whole.length} steps"
            )
        offsets = _offsets(lengths)
        object.__setattr__(self, "actions", whole.actions)
        object.__setattr__(self, "rewards", whole.rewards)
        object.__setattr__(self, "states", whole.states)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", offsets)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def episode(self, i: int) -> EpisodeArrays:
        """Episode ``i`` as views into the batch arrays."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return EpisodeArrays(
            actions=self.actions[a:b],
            rewards=self.rewards[a:b],
            states={k: v[a:b] for k, v in self.states.items()},
        )

    @classmethod
    def from_episodes(cls, episodes: Any) -> EpisodeBatch:
        """Concatenate episodes that share dtypes, per-step shapes and state field names."""
        episodes = [EpisodeArrays.coerce(e) for e in episodes]
        if not episodes:
            raise ValueError("episodes: expected at least one episode")
        first = episodes[0]

        def signature(e: EpisodeArrays) -> tuple:
            return (
                (e.actions.dtype, e.actions.shape[1:]),
                (e.rewards.dtype,),
                tuple(sorted((k, v.dtype.str, v.shape[1:]) for k, v in e.states.items())),
            )

        sig = signature(first)
        for i, e in enumerate(episodes):
            if signature(e) != sig:
                raise ValueError(
                    f"episodes[{i}]: dtypes, per-step shapes or state fields differ from "
                    f"episodes[0] ({signature(e)} != {sig})"
                )
        return cls(
            actions=np.concatenate([e.actions for e in episodes]),
            rewards=np.concatenate([e.rewards for e in episodes]),
            states={k: np.concatenate([e.states[k] for e in episodes]) for k in first.states},
            lengths=np.array([e.length for e in episodes], dtype=np.int64),
        )


@dataclass(frozen=True, eq=False)
class EpisodeColumns:
    """Several episodes given by their per-step cell-key columns and rewards only, with the
    full arrays fetched on demand.

    The streaming input form of :meth:`TrajectoryStore.record_episode_columns`: episode i is
    steps ``offsets[i]..offsets[i+1]-1`` of ``rewards`` and of every row of ``columns``
    (what :func:`field_column` gives for the configured cell fields, in order). ``fetch(i)``
    returns episode i's full arrays (anything :meth:`EpisodeArrays.coerce` accepts); the store
    calls it only for the episodes it keeps in its repository. Recording is identical to
    recording ``fetch(i)`` one by one, in order, provided the columns and rewards are those
    of the fetched episodes.
    """

    rewards: np.ndarray
    """(S,) rewards of all episodes, back to back, numeric."""
    columns: np.ndarray
    """(F, S) int64 cell-key columns of the same steps."""
    lengths: np.ndarray
    """(E,) episode lengths (>= 0) summing to S."""
    fetch: Callable[[int], Any] = field(repr=False)
    offsets: np.ndarray = field(init=False, repr=False)
    """(E+1,) start of each episode, then S."""

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths)
        if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
            raise ValueError(f"lengths: expected a 1-d int array, got {lengths!r}")
        lengths = lengths.astype(np.int64)
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"lengths: expected lengths >= 0, got {lengths.min()}")
        rewards = np.asarray(self.rewards)
        if rewards.ndim != 1 or rewards.dtype.kind not in "biuf":
            raise ValueError(f"rewards: expected a numeric (S,) array, got {rewards.shape}")
        columns = np.asarray(self.columns)
        if columns.ndim != 2 or columns.dtype != np.int64:
            raise ValueError(f"columns: expected an (F, S) int64 array, got {columns.shape}")
        total = int(lengths.sum())
        if rewards.shape[0] != total or columns.shape[1] != total:
            raise ValueError(
                f"lengths: sum to {total}, but rewards hold {rewards.shape[0]} and columns "
                f"{columns.shape[1]} steps"
            )
        if not callable(self.fetch):
            raise ValueError("fetch: expected a callable")
        offsets = _offsets(lengths)
        object.__setattr__(self, "rewards", rewards)
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", offsets)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


@dataclass(frozen=True, eq=False)
class EpisodeWindow:
    """Several episodes read in place from a worker's env-major window (the streaming feeder's
    rings): environment ``env[i]``'s steps ``start[i]..start[i]+lengths[i]-1``, time t at
    column ``t % capacity`` of ``key_ring`` (F, N, capacity) ints (the cell-key columns, as
    :func:`field_column` gives them) and ``reward_ring`` (N, capacity) floats, with the full
    arrays fetched on demand. The input of :meth:`TrajectoryStore.record_episode_window`:
    recording it equals recording :meth:`as_columns`, without copying the steps out first.
    """

    key_ring: np.ndarray
    reward_ring: np.ndarray
    env: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    fetch: Callable[[int], Any] = field(repr=False)
    # Episode i's deferred source (repository.DeferredEpisode): stored episodes are then
    # encoded only when first needed, instead of fetched and encoded now.
    defer: Callable[[int], Any] | None = field(default=None, repr=False)
    offsets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys, rewards = self.key_ring, self.reward_ring
        if keys.ndim != 3 or keys.dtype.kind != "i" or not keys.flags.c_contiguous:
            raise ValueError(f"key_ring: expected a C-contiguous (F, N, C) int array, got {keys!r}")
        if rewards.shape != keys.shape[1:] or rewards.dtype not in (np.float32, np.float64):
            raise ValueError(f"reward_ring: expected ({keys.shape[1:]}) floats, got {rewards!r}")
        env, start, lengths = (
            np.ascontiguousarray(a, dtype=np.int64) for a in (self.env, self.start, self.lengths)
        )
        if not env.shape == start.shape == lengths.shape or env.ndim != 1:
            raise ValueError("env, start, lengths: expected three (E,) arrays")
        if env.size and (
            env.min() < 0
            or env.max() >= keys.shape[1]
            or lengths.min() < 0
            or lengths.max() > keys.shape[2]
            or start.min() < 0
        ):
            raise ValueError("env, start, lengths: out of the window's range")
        offsets = _offsets(lengths)
        object.__setattr__(self, "env", env)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", offsets)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.key_ring.shape[2])

    def as_columns(self) -> EpisodeColumns:
        """The same episodes with their steps copied out (an EpisodeColumns)."""
        from . import kernels

        total = int(self.offsets[-1])
        columns = np.empty((self.key_ring.shape[0], total), dtype=np.int64)
        kernels.gather_ring(
            self.key_ring, self.env, self.start, self.lengths, self.capacity, columns
        )
        rewards = np.empty((1, total), dtype=self.reward_ring.dtype)
        kernels.gather_ring(
            self.reward_ring[None], self.env, self.start, self.lengths, self.capacity, rewards
        )
        return EpisodeColumns(rewards[0], columns, self.lengths, self.fetch)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """(E+1,) int64 start of each episode, then the total."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
