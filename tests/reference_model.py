"""A small, readable reference model of the rollout recorder.

Written from the text of the in-process recorder's documentation
(``shared/seeds/rollout_recorder_api.txt``) and from DESIGN.md, "Semantics
that must hold exactly".  It is a test oracle, not product code: it keeps every
chunk in memory and favours plainness over speed.

Single worker (:class:`ReferenceRecorder`)
------------------------------------------
* ``record(trajectories, env_states)`` stores one ``(T, N)`` chunk: ``action``
  ``(T, N)`` or ``(T, N, P)``, ``reward`` and ``done`` ``(T, N)``.  Both
  arguments may be objects (attribute access) or mappings (key access).  When
  the recorder is already full the whole chunk is dropped.  With
  ``record_states`` each name in ``state_fields`` is read from ``env_states``;
  a name that is absent (or whose value is ``None``), or ``env_states=None``,
  is skipped in silence *for that chunk only*.  Every state field therefore has
  its own list of chunks, exactly as in the in-process recorder; a field that is
  missing from some chunks ends up with a shorter time axis than the actions and
  is cut at the same step indices (so it is misaligned, and shorter episodes are
  zero padded).  That is what the in-process recorder does; the model mirrors it.
* ``is_full``: ``sum(done)`` over every stored chunk (all environments)
  ``>= max_episodes``; always False when ``max_episodes`` is None.  For 0/1 or
  boolean done flags the sum is the number of done flags.
* ``num_recorded_steps``: sum of ``T`` over the stored chunks.
* ``finish(pad_incomplete=True)``:
    1. no stored chunk -> ``ValueError("No data recorded. ...")``;
    2. chunks are joined along time (``np.concatenate``, so mixed dtypes
       promote as numpy promotes them);
    3. for env 0, 1, ..., N-1: one episode per done flag, in time order, each
       ending at (and including) its done step; then, with ``pad_incomplete``,
       the trailing unfinished episode when the env has no done flag at all
       (an *empty* episode when the joined time axis has length 0) or its last
       done flag is before the final step;
    4. no episode -> ``ValueError("No complete episodes found. ...")``;
    5. the list is cut to ``max_episodes`` (Python slicing);
    6. everything is zero padded to the longest kept episode: actions keep the
       joined dtype, rewards are assigned into a float32 array (numpy assignment
       casting), state fields keep their joined dtype;
    7. state fields are renamed ``player_positions``->``positions``,
       ``map``->``block_map``, every other name unchanged.  When two recorded
       fields map to the same name (``positions`` and ``player_positions``), the
       field recorded *later* (dict insertion order of first recording) wins,
       as in the in-process recorder.
  Extra keys: ``lengths`` (B,) int64, ``episode_env`` (B,) int64,
  ``episode_start`` (B,) int64 (first step of the episode on the joined time
  axis of its worker) and ``episode_done`` (B,) bool (a done flag ended it).
  ``finish`` does not clear; ``reset()`` clears the data and keeps the config.

Model decisions where the in-process recorder has no sensible behaviour
------------------------------------------------------------------------
* Duplicate names in ``state_fields`` are read once (the in-process recorder
  stores the field twice per chunk, which doubles its time axis and then crashes
  with a numpy broadcasting error or returns garbage).
* A recorded state field whose trajectory name is one of :data:`RESERVED_KEYS`
  raises ``ValueError`` in ``finish`` (after the two errors above).  The
  in-process recorder raises ``TypeError`` from ``Trajectory(...)`` for
  ``rewards`` and ``actions``, and for every name outside its fixed list.

Several workers (:class:`ReferenceMultiWorker`)
-----------------------------------------------
Workers are numbered 0..W-1 in the order they joined; that is also the output
order (worker by worker, then env by env, then time).  Each worker's chunks are
joined and split on their own (a worker's environments are distinct streams).
``is_full`` is global (done flags of every worker) and ``max_episodes`` cuts the
whole list.  Because a chunk is dropped when the recorder is full *at the moment
it is recorded*, the result depends on how the workers' calls interleave; the
model therefore takes an explicit global order of ``record(worker, ...)``
calls (see :meth:`ReferenceMultiWorker.replay`).  The output also has
``episode_worker`` (B,) int64.  Workers must agree on the action dtype and
trailing shape and on each state field's dtype and trailing shape (N may
differ); otherwise ``finish`` raises ``ValueError``.  A worker that never stored
a state field that another worker stored contributes zero-filled (length-0)
state slices for it.  Rewards are cast to float32 per worker (after that
worker's own concatenation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_STATE_FIELDS: tuple[str, ...] = ("player_positions", "player_inventory")

#: Env-state name -> trajectory name, for the names that differ.
STATE_TO_TRAJ: dict[str, str] = {"player_positions": "positions", "map": "block_map"}

#: Keys of the result that a state field may not take.
RESERVED_KEYS: frozenset[str] = frozenset(
    {
        "actions",
        "rewards",
        "lengths",
        "episode_env",
        "episode_start",
        "episode_done",
        "episode_worker",
    }
)

NO_DATA_MESSAGE = "No data recorded. Call record() first."
NO_EPISODES_MESSAGE = (
    "No complete episodes found. Try recording more steps or set pad_incomplete=True."
)


def traj_name(state_name: str) -> str:
    """Trajectory name of an env-state field."""
    return STATE_TO_TRAJ.get(state_name, state_name)


def read_field(container: Any, name: str) -> Any:
    """``container[name]`` for a mapping, ``getattr(container, name)`` otherwise.

    Returns None when the name is absent.
    """
    if isinstance(container, Mapping):
        return container.get(name)
    return getattr(container, name, None)


def _required(container: Any, name: str) -> np.ndarray:
    value = read_field(container, name)
    if value is None:
        raise ValueError(f"trajectories has no {name!r}")
    return np.asarray(value)


@dataclass
class Episode:
    """One episode cut from one worker's joined chunks (unpadded)."""

    worker: int
    env: int
    start: int
    length: int
    done: bool
    actions: np.ndarray  # (length, ...) or (length, P)
    rewards: np.ndarray  # (length,), original (joined) dtype
    states: dict[str, np.ndarray]  # env-state name -> (<= length, ...)


@dataclass
class _WorkerBuffer:
    """The chunks one worker stored, unjoined."""

    actions: list[np.ndarray] = field(default_factory=list)
    rewards: list[np.ndarray] = field(default_factory=list)
    dones: list[np.ndarray] = field(default_factory=list)
    # Insertion order = order in which each field was first stored.
    states: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(
        self,
        trajectories: Any,
        env_states: Any,
        record_states: bool,
        state_fields: Sequence[str],
    ) -> int:
        """Store one chunk; return its done count (``sum(done)``)."""
        actions = _required(trajectories, "action")
        rewards = _required(trajectories, "reward")
        dones = _required(trajectories, "done")
        self.actions.append(actions)
        self.rewards.append(rewards)
        self.dones.append(dones)
        if record_states and env_states is not None:
            for name in dict.fromkeys(state_fields):  # de-duplicated, order kept
                value = read_field(env_states, name)
                if value is None:
                    continue
                self.states.setdefault(name, []).append(np.asarray(value))
        return int(dones.sum())

    @property
    def num_steps(self) -> int:
        return sum(chunk.shape[0] for chunk in self.actions)

    def split(self, worker: int, pad_incomplete: bool) -> list[Episode]:
        """Join this worker's chunks along time and cut them into episodes."""
        if not self.actions:
            return []
        actions = np.concatenate(self.actions, axis=0)
        rewards = np.concatenate(self.rewards, axis=0)
        dones = np.concatenate(self.dones, axis=0)
        states = {name: np.concatenate(chunks, axis=0) for name, chunks in self.states.items()}
        total_steps, num_envs = dones.shape[:2]

        episodes: list[Episode] = []

        def cut(env: int, start: int, stop: int, done: bool) -> None:
            episodes.append(
                Episode(
                    worker=worker,
                    env=env,
                    start=start,
                    length=stop - start,
                    done=done,
                    actions=actions[start:stop, env],
                    rewards=rewards[start:stop, env],
                    # A state field with a shorter time axis gives a shorter slice.
                    states={name: arr[start:stop, env] for name, arr in states.items()},
                )
            )

        for env in range(num_envs):
            done_steps = np.flatnonzero(dones[:, env])
            start = 0
            for step in done_steps:
                cut(env, start, int(step) + 1, done=True)
                start = int(step) + 1
            no_done = len(done_steps) == 0
            if pad_incomplete and (no_done or done_steps[-1] < total_steps - 1):
                cut(env, start, total_steps, done=False)
        return episodes


def _pad(pieces: Sequence[np.ndarray], length: int, dtype: Any, trailing: tuple) -> np.ndarray:
    out = np.zeros((len(pieces), length, *trailing), dtype=dtype)
    for i, piece in enumerate(pieces):
        out[i, : piece.shape[0]] = piece
    return out


def _assemble(
    episodes: list[Episode],
    field_order: Sequence[str],
    max_episodes: int | None,
    with_worker: bool,
) -> dict[str, np.ndarray]:
    """Cut to ``max_episodes``, pad, rename; ``episodes`` must be non-empty."""
    if max_episodes is not None:
        episodes = episodes[:max_episodes]
    longest = max(ep.length for ep in episodes)

    first = episodes[0].actions
    for ep in episodes:
        if ep.actions.dtype != first.dtype or ep.actions.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"workers disagree on actions: {first.dtype}{first.shape[1:]} "
                f"vs {ep.actions.dtype}{ep.actions.shape[1:]}"
            )
    result: dict[str, np.ndarray] = {
        "actions": _pad([ep.actions for ep in episodes], longest, first.dtype, first.shape[1:]),
        # Assignment into float32 casts exactly as the in-process recorder does.
        "rewards": _pad([ep.rewards for ep in episodes], longest, np.float32, ()),
    }

    for name in field_order:
        present = [ep.states[name] for ep in episodes if name in ep.states]
        if not present:
            continue
        dtype, trailing = present[0].dtype, present[0].shape[1:]
        for arr in present:
            if arr.dtype != dtype or arr.shape[1:] != trailing:
                raise ValueError(
                    f"workers disagree on state field {name!r}: {dtype}{trailing} "
                    f"vs {arr.dtype}{arr.shape[1:]}"
                )
        empty = np.zeros((0, *trailing), dtype=dtype)
        pieces = [ep.states.get(name, empty) for ep in episodes]
        key = traj_name(name)
        if key in RESERVED_KEYS:
            raise ValueError(
                f"state field {name!r} maps to the trajectory name {key!r}, "
                f"which is reserved for the recorder's own output"
            )
        result[key] = _pad(pieces, longest, dtype, trailing)  # a later field overwrites

    result["lengths"] = np.array([ep.length for ep in episodes], dtype=np.int64)
    result["episode_env"] = np.array([ep.env for ep in episodes], dtype=np.int64)
    result["episode_start"] = np.array([ep.start for ep in episodes], dtype=np.int64)
    result["episode_done"] = np.array([ep.done for ep in episodes], dtype=bool)
    if with_worker:
        result["episode_worker"] = np.array([ep.worker for ep in episodes], dtype=np.int64)
    return result


class ReferenceMultiWorker:
    """Reference model for one recording session shared by several workers.

    ``record(worker, trajectories, env_states)`` calls must be made in the
    global order in which the session receives them; worker indices are the
    join order.
    """

    def __init__(
        self,
        num_workers: int,
        max_episodes: int | None = None,
        record_states: bool = False,
        state_fields: Sequence[str] = DEFAULT_STATE_FIELDS,
    ) -> None:
        self.num_workers = num_workers
        self.max_episodes = max_episodes
        self.record_states = record_states
        self.state_fields = tuple(state_fields)
        self.reset()

    def reset(self) -> None:
        """Drop all data; keep the configuration (and the number of workers)."""
        self._buffers = [_WorkerBuffer() for _ in range(self.num_workers)]
        self._done_count = 0
        self._field_order: dict[str, None] = {}  # global first-stored order

    @property
    def is_full(self) -> bool:
        if self.max_episodes is None:
            return False
        return self._done_count >= self.max_episodes

    @property
    def num_recorded_steps(self) -> int:
        return sum(buf.num_steps for buf in self._buffers)

    def record(self, worker: int, trajectories: Any, env_states: Any = None) -> bool:
        """Store one chunk of ``worker``; return False when it was dropped (full)."""
        if self.is_full:
            return False
        buf = self._buffers[worker]
        self._done_count += buf.add(trajectories, env_states, self.record_states, self.state_fields)
        for name in buf.states:
            self._field_order.setdefault(name, None)
        return True

    def _episodes(self, pad_incomplete: bool) -> list[Episode]:
        if not any(buf.actions for buf in self._buffers):
            raise ValueError(NO_DATA_MESSAGE)
        episodes = [
            ep
            for worker, buf in enumerate(self._buffers)
            for ep in buf.split(worker, pad_incomplete)
        ]
        if not episodes:
            raise ValueError(NO_EPISODES_MESSAGE)
        return episodes

    def finish(self, pad_incomplete: bool = True) -> dict[str, np.ndarray]:
        episodes = self._episodes(pad_incomplete)
        return _assemble(episodes, list(self._field_order), self.max_episodes, with_worker=True)

    @classmethod
    def replay(
        cls,
        worker_calls: Sequence[Sequence[tuple[Any, Any]]],
        order: Sequence[int] | None = None,
        **config: Any,
    ) -> ReferenceMultiWorker:
        """Build a model and feed it every worker's ``(trajectories, env_states)`` calls.

        ``order`` lists worker indices; the k-th occurrence of ``w`` is worker
        ``w``'s k-th call.  It must use every call exactly once.  The default is
        round robin (w0 c0, w1 c0, ..., w0 c1, w1 c1, ...).
        """
        if order is None:
            order = [
                w
                for k in range(max((len(c) for c in worker_calls), default=0))
                for w, calls in enumerate(worker_calls)
                if k < len(calls)
            ]
        counts = [0] * len(worker_calls)
        for w in order:
            counts[w] += 1
        if counts != [len(c) for c in worker_calls]:
            raise ValueError(
                f"order uses {counts} calls per worker, expected {[len(c) for c in worker_calls]}"
            )
        model = cls(len(worker_calls), **config)
        position = [0] * len(worker_calls)
        for w in order:
            trajectories, env_states = worker_calls[w][position[w]]
            position[w] += 1
            model.record(w, trajectories, env_states)
        return model


class ReferenceRecorder:
    """Reference model of the single-worker recorder (see the module docstring)."""

    def __init__(
        self,
        max_episodes: int | None = None,
        record_states: bool = False,
        state_fields: Sequence[str] = DEFAULT_STATE_FIELDS,
    ) -> None:
        self._session = ReferenceMultiWorker(1, max_episodes, record_states, state_fields)

    # Configuration is read through to the session so that it survives reset().
    @property
    def max_episodes(self) -> int | None:
        return self._session.max_episodes

    @property
    def record_states(self) -> bool:
        return self._session.record_states

    @property
    def state_fields(self) -> tuple[str, ...]:
        return self._session.state_fields

    @property
    def is_full(self) -> bool:
        return self._session.is_full

    @property
    def num_recorded_steps(self) -> int:
        return self._session.num_recorded_steps

    def record(self, trajectories: Any, env_states: Any = None) -> bool:
        """Store one chunk; return False when it was dropped because the recorder is full."""
        return self._session.record(0, trajectories, env_states)

    def finish(self, pad_incomplete: bool = True) -> dict[str, np.ndarray]:
        episodes = self._session._episodes(pad_incomplete)
        return _assemble(
            episodes, list(self._session._field_order), self.max_episodes, with_worker=False
        )

    def reset(self) -> None:
        self._session.reset()
