"""The padded episodes finish() returns, with the metadata that tells padding apart."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._wire import RESERVED_NAMES

_META = (
    "lengths",
    "episode_worker",
    "episode_env",
    "episode_start",
    "episode_done",
    "episode_terminated",
    "episode_truncated",
)

# Why an episode is partial, as bit flags (the wire's FinishHeader.partial, the dataset's
# `partial` column as names joined by "+"). 0: a whole episode.
GAP_BEFORE = 1
"""It starts right after a sequence gap (lost chunks): its true start is unknown."""
GAP_AFTER = 2
"""A sequence gap ended it: the steps after its last recorded one were lost."""
CORRUPT = 4
"""It reads an acknowledged chunk whose frames did not decode (zeros there)."""
PARTIAL_NAMES = {GAP_BEFORE: "gap_before", GAP_AFTER: "gap_after", CORRUPT: "corrupt"}


def partial_name(flags: int) -> str:
    """The reason string of a flag set: "" when whole, else names joined by "+"."""
    return "+".join(name for bit, name in PARTIAL_NAMES.items() if flags & bit)


def partial_names(flags: np.ndarray | list[int]) -> np.ndarray:
    """(B,) reason strings of (B,) flag sets."""
    flags = np.asarray(flags, dtype=np.int64)
    names = np.full(flags.size, "", dtype="<U32")
    for value in np.unique(flags[flags != 0]).tolist():
        names[flags == value] = partial_name(value)
    return names


class Trajectory:
    """Padded episodes: every array field is (B, T_max, ...).

    `actions` and `rewards` always exist; each recorded state field is an
    attribute under its trajectory name (`player_positions` -> `positions`,
    `map` -> `block_map`, any other name unchanged). Per episode: `lengths`
    (real steps), `episode_worker`, `episode_env`, `episode_start` (step on that
    worker's time axis), `episode_done` (a done flag ended it) and
    `episode_partial` (why the episode is not whole: "" when it is, else
    "gap_before", "gap_after", "corrupt" or several joined by "+"). Steps at or
    past `lengths[b]` are zero padding, not no-op actions. `episode_terminated` and
    `episode_truncated` ((B,) bool) are the flags of each episode's last step (recorded
    with `done` only: terminated is `episode_done`, truncated False; both False where no
    flag ended the episode). `final_states` maps state field names (`obs`, `obs.pos`) to
    (B, ...) arrays: each episode's state after its last step, zeros where no flag ended
    it; empty when no final observation was recorded. `corrupt_chunks` names
    the acknowledged chunks whose frames were found not to decode and read as
    zeros here (at most 64 listed; `num_corrupt_chunks` counts them all).
    """

    def __init__(
        self,
        actions: np.ndarray,
        rewards: np.ndarray,
        states: dict[str, np.ndarray] | None = None,
        *,
        lengths: np.ndarray,
        episode_worker: np.ndarray,
        episode_env: np.ndarray,
        episode_start: np.ndarray,
        episode_done: np.ndarray,
        worker_ids: list[str] | tuple[str, ...] = (),
        corrupt_chunks: list[str] | tuple[str, ...] = (),
        num_corrupt_chunks: int | None = None,
        episode_partial: np.ndarray | None = None,
        episode_terminated: np.ndarray | None = None,
        episode_truncated: np.ndarray | None = None,
        final_states: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.actions = actions
        self.rewards = rewards
        self.states: dict[str, np.ndarray] = dict(states or {})
        for name in self.states:
            if name in RESERVED_NAMES:
                raise ValueError(f"states: {name!r} is a reserved trajectory name")
        self.lengths = lengths
        self.episode_worker = episode_worker
        self.episode_env = episode_env
        self.episode_start = episode_start
        self.episode_done = episode_done
        if episode_partial is None:
            episode_partial = np.full(np.shape(lengths)[0], "", dtype="<U32")
        self.episode_partial = np.asarray(episode_partial, dtype=np.str_)
        if episode_terminated is None:
            episode_terminated = np.asarray(episode_done, dtype=bool).copy()
        if episode_truncated is None:
            episode_truncated = np.zeros(np.shape(lengths)[0], dtype=bool)
        self.episode_terminated = np.asarray(episode_terminated, dtype=bool)
        self.episode_truncated = np.asarray(episode_truncated, dtype=bool)
        self.final_states: dict[str, np.ndarray] = dict(final_states or {})
        self.worker_ids = tuple(worker_ids)
        self.corrupt_chunks = tuple(corrupt_chunks)
        self.num_corrupt_chunks = max(len(self.corrupt_chunks), num_corrupt_chunks or 0)

    def __getattr__(self, name: str) -> np.ndarray:
        states = self.__dict__.get("states", {})
        if name in states:
            return states[name]
        raise AttributeError(
            f"Trajectory has no field {name!r}; recorded state fields: {sorted(states)}"
        )

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.states))

    @property
    def num_episodes(self) -> int:
        return int(self.actions.shape[0])

    @property
    def max_length(self) -> int:
        return int(self.actions.shape[1])

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """Every padded array by trajectory name: actions, rewards, then state fields."""
        return {"actions": self.actions, "rewards": self.rewards, **self.states}

    def mask(self) -> np.ndarray:
        """(B, T_max) bool: True on real steps, False on padding."""
        return np.arange(self.max_length)[None, :] < self.lengths[:, None]

    def to_factoriax(self) -> Any:
        """The same arrays as a `factoriax.analysis.trajectory.Trajectory`.

        Raises ImportError when factoriax is not installed. factoriax accepts only
        its own field names, so other state fields make it raise TypeError.
        """
        try:
            from factoriax.analysis.trajectory import Trajectory as FactoriaxTrajectory
        except ImportError as exc:
            raise ImportError(
                "to_factoriax() needs factoriax.analysis importable (pip install factoriax, "
                f"which brings jax): {exc}"
            ) from exc
        return FactoriaxTrajectory(actions=self.actions, rewards=self.rewards, **self.states)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every array and the per-episode metadata to a compressed .npz."""
        arrays: dict[str, Any] = {"actions": self.actions, "rewards": self.rewards}
        for name, value in self.states.items():
            arrays[f"state__{name}"] = value
        for name, value in self.final_states.items():
            arrays[f"final__{name}"] = value
        for name in _META:
            arrays[name] = getattr(self, name)
        arrays["worker_ids"] = np.asarray(self.worker_ids, dtype=np.str_)
        if (self.episode_partial != "").any():
            arrays["episode_partial"] = self.episode_partial
        if self.num_corrupt_chunks:
            arrays["corrupt_chunks"] = np.asarray(self.corrupt_chunks, dtype=np.str_)
            arrays["num_corrupt_chunks"] = np.int64(self.num_corrupt_chunks)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trajectory:
        with np.load(path, allow_pickle=False) as data:
            states = {k[len("state__") :]: data[k] for k in data.files if k.startswith("state__")}
            finals = {k[len("final__") :]: data[k] for k in data.files if k.startswith("final__")}
            # Files saved before the flags existed read as recorded with done only.
            meta = {name: data[name] for name in _META if name in data.files}
            corrupt = data["corrupt_chunks"] if "corrupt_chunks" in data.files else ()
            return cls(
                data["actions"],
                data["rewards"],
                states,
                worker_ids=[str(w) for w in data["worker_ids"]],
                corrupt_chunks=[str(m) for m in corrupt],
                num_corrupt_chunks=(
                    int(data["num_corrupt_chunks"]) if "num_corrupt_chunks" in data.files else 0
                ),
                episode_partial=(
                    data["episode_partial"] if "episode_partial" in data.files else None
                ),
                final_states=finals,
                **meta,
            )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={tuple(v.shape)}:{v.dtype}" for k, v in self.fields.items())
        return f"Trajectory(B={self.num_episodes}, T_max={self.max_length}, {fields})"
