"""Episodes as the store takes them: one episode's arrays, and the batch sources it records.

An :class:`EpisodeSource` is several episodes, in recording order, laid out as their producer
has them: one by one (:class:`EpisodeList`), concatenated (:class:`EpisodeBatch`), as cell-key
columns and rewards with the full arrays fetched on demand (:class:`EpisodeColumns`), or read
in place from a feeder's rings (:class:`EpisodeWindow`). The store asks a source for its steps
grouped by cell, and, for the episodes it keeps, their full arrays or a deferred source.
Recording any source is identical to recording its episodes one by one, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from recorder_client.capture_types import CellField

from . import kernels
from .batch import Grouping, group_columns, group_window
from .cells import batch_cell_columns, field_column


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


class DeferredEpisode(Protocol):
    """An episode the repository stores before encoding it: it reads the episode's arrays
    only when first needed (see the repository module's docstring)."""

    length: int
    bound: int  # an upper bound of its blob's size
    group: Any  # sources of one group share the chunks they read (sorted by `first`)
    first: int

    def fetch(self, cache: dict) -> EpisodeArrays:
        """The episode's arrays; ``cache`` is shared by the fetches of one encoding pass."""


@runtime_checkable
class EpisodeSource(Protocol):
    """Several episodes, in recording order, as :meth:`TrajectoryStore.record` reads them."""

    @property
    def lengths(self) -> np.ndarray:
        """(E,) int64 episode lengths (0 allowed)."""
        ...

    @property
    def offsets(self) -> np.ndarray:
        """(E+1,) int64: episode i is steps ``offsets[i]..offsets[i+1]-1`` of the batch."""
        ...

    def __len__(self) -> int: ...

    def group(self, fields: tuple[CellField, ...], powers: Callable[[int], np.ndarray]) -> Grouping:
        """The steps grouped by the cells ``fields`` key them to, with each episode's return.
        ``powers(n)`` is the (U, n) float64 table ``gamma_u ** k`` (k < n) of the store's
        utilities, for a source that adds up the discounted sums as it groups. Raises
        ValueError when the fields cannot key the steps."""
        ...

    def episode(self, i: int) -> EpisodeArrays:
        """Episode i's full arrays (called, under the store's lock, only for the episodes the
        repository keeps and :meth:`deferred` leaves to be encoded now)."""
        ...

    def deferred(self, i: int) -> DeferredEpisode | None:
        """Episode i as a deferred repository source (encoded only when first needed), or None
        to have it encoded from :meth:`episode` now."""
        ...


def as_source(episodes: Any) -> EpisodeSource:
    """``episodes`` itself when it is an EpisodeSource; a sequence of episodes (EpisodeArrays or
    anything :meth:`EpisodeArrays.coerce` takes) as an EpisodeList."""
    if isinstance(episodes, (EpisodeArrays, Mapping)):
        raise ValueError("episodes: expected a sequence of episodes, got a single episode")
    # Known by its hook: isinstance against the Protocol costs ~12 us a call.
    if callable(getattr(episodes, "group", None)):
        return episodes
    if isinstance(episodes, Iterable) and not isinstance(episodes, (str, bytes)):
        return EpisodeList(episodes)
    raise ValueError(
        "episodes: expected an EpisodeSource or a sequence of episodes, got "
        f"{type(episodes).__name__}"
    )


@dataclass(frozen=True, eq=False)
class EpisodeList:
    """Episodes given one by one (EpisodeArrays, or anything :meth:`EpisodeArrays.coerce`
    takes). Each state field is keyed in one pass over all episodes when they share its dtype
    and per-step shape."""

    episodes: Sequence[EpisodeArrays]
    """The episodes; a tuple of EpisodeArrays once built."""
    lengths: np.ndarray = field(init=False, repr=False)
    offsets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        episodes = tuple(EpisodeArrays.coerce(e) for e in self.episodes)
        lengths = np.fromiter(
            (e.rewards.shape[0] for e in episodes), dtype=np.int64, count=len(episodes)
        )
        object.__setattr__(self, "episodes", episodes)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", _offsets(lengths))

    def __len__(self) -> int:
        return len(self.episodes)

    def group(self, fields: tuple[CellField, ...], powers: Callable[[int], np.ndarray]) -> Grouping:
        episodes, lengths = self.episodes, self.lengths
        rewards = np.concatenate([e.rewards for e in episodes] or [np.zeros(0)], dtype=np.float64)
        cumulative = kernels.segment_cumsum(rewards, self.offsets)

        def columns() -> np.ndarray:
            nonempty = [i for i, n in enumerate(lengths.tolist()) if n]
            return batch_cell_columns(
                fields, [episodes[i].states for i in nonempty], [int(lengths[i]) for i in nonempty]
            )

        return group_columns(cumulative, columns, lengths, self.offsets)

    def episode(self, i: int) -> EpisodeArrays:
        return self.episodes[i]

    def deferred(self, i: int) -> None:
        return None


@dataclass(frozen=True, eq=False)
class EpisodeBatch:
    """Several episodes as one set of concatenated arrays plus their lengths: episode i is
    steps ``offsets[i]..offsets[i+1]-1`` of every array. Recording a batch is identical to
    recording ``batch.episode(i)`` one by one (stored trajectories are slices of these arrays,
    so keep dtypes what the per-episode arrays would have been)."""

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
        lengths = _check_lengths(self.lengths)
        whole = EpisodeArrays(self.actions, self.rewards, self.states)
        if int(lengths.sum()) != whole.length:
            raise ValueError(
                f"lengths: sum to {int(lengths.sum())}, but the arrays hold {whole.length} steps"
            )
        object.__setattr__(self, "actions", whole.actions)
        object.__setattr__(self, "rewards", whole.rewards)
        object.__setattr__(self, "states", whole.states)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", _offsets(lengths))

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

    def group(self, fields: tuple[CellField, ...], powers: Callable[[int], np.ndarray]) -> Grouping:
        cumulative = kernels.segment_cumsum(self.rewards.astype(np.float64), self.offsets)
        total = cumulative.shape[0]

        def columns() -> np.ndarray:
            return np.stack([field_column(f, self.states, total) for f in fields])

        return group_columns(cumulative, columns, self.lengths, self.offsets)

    def deferred(self, i: int) -> None:
        return None

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
    full arrays fetched on demand: episode i is steps ``offsets[i]..offsets[i+1]-1`` of
    ``rewards`` and of every row of ``columns`` (what :func:`cells.field_column` gives for the
    store's cell fields, in order). ``fetch(i)`` returns episode i's full arrays (anything
    :meth:`EpisodeArrays.coerce` takes); the store calls it only for the episodes it keeps.
    Recording is identical to recording ``fetch(i)`` one by one, in order, provided the
    columns and rewards are those of the fetched episodes."""

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
        lengths = _check_lengths(self.lengths)
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
        object.__setattr__(self, "rewards", rewards)
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", _offsets(lengths))

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def group(self, fields: tuple[CellField, ...], powers: Callable[[int], np.ndarray]) -> Grouping:
        if self.columns.shape[0] != len(fields):
            raise ValueError(
                f"columns: expected {len(fields)} rows (one per cell field), got "
                f"{self.columns.shape[0]}"
            )
        cumulative = kernels.segment_cumsum(self.rewards.astype(np.float64), self.offsets)
        return group_columns(cumulative, lambda: self.columns, self.lengths, self.offsets)

    def episode(self, i: int) -> EpisodeArrays:
        """``fetch(i)``, checked against episode i's length."""
        episode = EpisodeArrays.coerce(self.fetch(i))
        if episode.length != int(self.lengths[i]):
            raise ValueError(
                f"fetch({i}): expected an episode of {int(self.lengths[i])} steps, got "
                f"{episode.length}"
            )
        return episode

    def deferred(self, i: int) -> None:
        return None


@dataclass(frozen=True, eq=False)
class EpisodeWindow:
    """Several episodes read in place from a worker's env-major window (the streaming feeder's
    rings): environment ``env[i]``'s steps ``start[i]..start[i]+lengths[i]-1``, time t at
    column ``t % capacity`` of ``key_ring`` (F, N, capacity) ints (the cell-key columns, as
    :func:`cells.field_column` gives them) and ``reward_ring`` (N, capacity) floats.
    ``defer(i)`` is episode i's deferred source (a :class:`DeferredEpisode`): the
    episodes the repository keeps are encoded only when first needed. Recording a window
    equals recording :meth:`as_columns`, without copying the steps out first."""

    key_ring: np.ndarray
    reward_ring: np.ndarray
    env: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    defer: Callable[[int], DeferredEpisode] = field(repr=False)
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
        if not callable(self.defer):
            raise ValueError("defer: expected a callable")
        object.__setattr__(self, "env", env)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "offsets", _offsets(lengths))

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.key_ring.shape[2])

    def group(self, fields: tuple[CellField, ...], powers: Callable[[int], np.ndarray]) -> Grouping:
        """One compiled pass over the rings when the keys span a small range; else the
        grouping of :meth:`as_columns`."""
        if self.key_ring.shape[0] != len(fields):
            raise ValueError(
                f"key_ring: expected {len(fields)} rows (one per cell field), got "
                f"{self.key_ring.shape[0]}"
            )
        table = powers(max(int(self.lengths.max(initial=0)), 1))
        grouped = group_window(
            self.key_ring, self.reward_ring, self.env, self.start, self.lengths, self.offsets, table
        )
        return self.as_columns().group(fields, powers) if grouped is None else grouped

    def episode(self, i: int) -> EpisodeArrays:
        """Episode i's arrays read from its deferred source, checked against its length."""
        episode = self.defer(i).fetch({})
        if episode.length != int(self.lengths[i]):
            raise ValueError(
                f"defer({i}): expected an episode of {int(self.lengths[i])} steps, got "
                f"{episode.length}"
            )
        return episode

    def deferred(self, i: int) -> DeferredEpisode:
        return self.defer(i)

    def as_columns(self) -> EpisodeColumns:
        """The same episodes with their steps copied out (an EpisodeColumns whose ``fetch``
        reads the deferred sources)."""
        total = int(self.offsets[-1])
        columns = np.empty((self.key_ring.shape[0], total), dtype=np.int64)
        kernels.gather_ring(
            self.key_ring, self.env, self.start, self.lengths, self.capacity, columns
        )
        rewards = np.empty((1, total), dtype=self.reward_ring.dtype)
        kernels.gather_ring(
            self.reward_ring[None], self.env, self.start, self.lengths, self.capacity, rewards
        )
        return EpisodeColumns(rewards[0], columns, self.lengths, self.episode)


def _check_lengths(lengths: Any) -> np.ndarray:
    """(E,) int64 episode lengths, each >= 0."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
        raise ValueError(f"lengths: expected a 1-d int array, got {lengths!r}")
    lengths = lengths.astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths: expected lengths >= 0, got {lengths.min()}")
    return lengths


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """(E+1,) int64 start of each episode, then the total."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
