"""Record Gymnasium rollouts: `RecordRollouts` wraps a vector environment, `RecordEpisodes`
a single one.

Each step becomes one row of preallocated `(T, N, ...)` buffers: the observation the action
was taken from (`obs`), `action`, `reward`, `terminated`, `truncated`, and on the rows that
end an episode the observation after the step (`final_obs`). Every `chunk_steps` steps the
rows go to `RolloutRecorder.record()`; `close()` sends the rest. Observations and actions
are kept in their spaces' shapes and dtypes (what a vector env's batching gives them): an
observation that does not fit its space is a ValueError naming the leaf (`obs.pos`).

Autoreset (`envs.metadata["autoreset_mode"]`), by Gymnasium's documented rules:

- `NEXT_STEP` (the default): the step after a done ignores its action and returns the next
  episode's first observation with reward 0. That row is recorded with `valid` False: it
  belongs to no episode. The final observation is the one the done step returned.
- `SAME_STEP`: a done step returns the next episode's first observation; the final one is in
  `infos["final_obs"]` (or each environment's info, under `DictInfoToList`).
- `DISABLED`: the caller resets finished environments (`reset(options={"reset_mask": ...})`);
  the final observation is the one the done step returned.

A `reset()` cancels a pending next-step autoreset, except in Gymnasium 1.x's `AsyncVectorEnv`
without shared memory, whose workers reset again on the next step: recorded as it happens.

A `reset()` of an environment whose episode is under way (no flag ended it) ends that episode
as **truncated** on its last recorded step, with the observation the environment was left in
as its final one: the episode was cut from outside the MDP, which is what `truncated` means
(Minari's `DataCollector` does the same). Rows are sent one step late (when the next step
begins), so that the last step can still be marked.

A recorder takes one wrapper (or SB3 callback) at a time, and a new one refuses a recorder
whose episodes an earlier one left under way: either would join episodes of different envs.

Imports gymnasium (the `[gymnasium]` extra); `import recorder_client` does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from ._producer import claim, close_own, own_recorder
from ._wire import obs_names_error
from .recorder import RolloutRecorder

_LEAF_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_KINDS = "Box, Discrete, MultiDiscrete, MultiBinary, or a Dict/Tuple of them"


def _leaves(space: spaces.Space, where: str, path: tuple = ()) -> list[tuple[tuple, spaces.Space]]:
    """Every array of an observation space with the keys that reach it, in the order Dict
    and Tuple spaces keep."""
    name = ".".join([where, *map(str, path)])
    if isinstance(space, spaces.Dict):
        out = []
        for key, sub in space.spaces.items():
            if not isinstance(key, str) or not key or "." in key:
                raise ValueError(
                    f"{name}: expected Dict keys that are non-empty strings without '.' "
                    f"(they name the recorded fields {name}.<key>), got {key!r}"
                )
            out += _leaves(sub, where, (*path, key))
        return out
    if isinstance(space, spaces.Tuple):
        return [
            leaf for i, sub in enumerate(space.spaces) for leaf in _leaves(sub, where, (*path, i))
        ]
    if isinstance(space, _LEAF_SPACES):
        return [(path, space)]
    raise TypeError(f"{name}: expected a space of kind {_KINDS}, got {space}")


def _getter(path: tuple) -> Callable[[Any], Any]:
    def get(value: Any) -> Any:
        for key in path:
            value = value[key]
        return value

    return get


def _autoreset_mode(envs: VectorEnv) -> AutoresetMode:
    mode = envs.metadata.get("autoreset_mode")
    try:
        return mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)
    except ValueError:
        raise ValueError(
            f"envs.metadata['autoreset_mode']: expected one of "
            f"{[m.value for m in AutoresetMode]} (which step a finished environment is reset "
            f"on decides which rows are real steps), got {mode!r}"
        ) from None


# How an observation a single env returned is cast to its space's dtype: as a vector env's
# batching casts it (int64 into a uint8 Box is refused, not wrapped round).
_CASTING = "same_kind"
# What numpy raises for an observation that does not fit its buffer (`_misfit` says why).
_MISFITS = (KeyError, IndexError, TypeError, ValueError, OverflowError)


def _fitted(value: Any, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """One env's observation leaf as an array of its space's shape, castable to ``dtype``
    (TypeError or ValueError otherwise: numpy would broadcast or wrap it round)."""
    value = np.asarray(value)
    if value.shape != shape:
        raise ValueError("shape")
    if not np.can_cast(value.dtype, dtype, _CASTING):
        raise TypeError("dtype")
    return value


class _Rows:
    """The chunk being filled: row `t` is step `t`; `obs` has one row more, the observation
    the next step starts from (row 0 of the next chunk)."""

    def __init__(
        self,
        recorder: RolloutRecorder,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        num_envs: int,
        chunk_steps: int,
        mode: AutoresetMode,
        where: str,
    ) -> None:
        if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
            raise ValueError(f"chunk_steps: expected an integer >= 1, got {chunk_steps!r}")
        if not isinstance(action_space, _LEAF_SPACES):
            raise TypeError(
                f"{where}.action_space: expected Box, Discrete, MultiDiscrete or MultiBinary "
                f"(record() takes one (T, N, ...) action array), got {action_space}"
            )
        self.recorder = recorder
        self.space = observation_space
        leaves = _leaves(observation_space, "obs")
        self.where = where
        self.single = where == "env"  # RecordEpisodes: one env's observation, not a batch
        self.names = [".".join(["obs", *map(str, path)]) for path, _ in leaves]
        problem = obs_names_error(self.names)  # record() would refuse the first chunk
        if problem:
            space = "observation_space" if where == "env" else "single_observation_space"
            raise ValueError(f"{where}.{space}: {problem}")
        self.leaf_specs = [(space.shape, space.dtype) for _, space in leaves]
        self.getters = [_getter(path) for path, _ in leaves]
        # One array, no Dict/Tuple around it, as a vector env batched it.
        self.batched = leaves[0][0] == () and not self.single
        self.action_spec = (action_space.shape, action_space.dtype)
        self.T, self.n, self.mode = chunk_steps, num_envs, mode
        self.reset_cancels_autoreset = True
        self.started = False
        self.sent_steps = 0
        self.open_after: np.ndarray | None = None  # envs the last sent row left mid-episode
        # NEXT_STEP: which environments' row 0 is an autoreset row, and resets that cancelled
        # a pending autoreset, as (row, mask): both decide `valid`.
        self.pending0 = np.zeros(num_envs, dtype=bool)
        self.unpend: list[tuple[int, np.ndarray]] = []
        self.obs = [np.empty((self.T + 1, num_envs, *s), d) for s, d in self.leaf_specs]
        self._new_chunk()

    def _new_chunk(self) -> None:
        T, n = self.T, self.n
        shape, dtype = self.action_spec
        self.action = np.empty((T, n, *shape), dtype)
        self.reward = np.empty((T, n), np.float32)  # the dtype the recorder returns
        self.terminated = np.empty((T, n), bool)
        self.truncated = np.empty((T, n), bool)
        self.final: list[np.ndarray] | None = None  # made when a final observation arrives
        self.final_set: np.ndarray | None = None
        self.cut: np.ndarray | None = None  # rows whose truncated flag a reset() set
        self.t = 0

    def _finals(self) -> list[np.ndarray]:
        if self.final is None:
            self.final = [np.zeros((self.T, self.n, *s), d) for s, d in self.leaf_specs]
            self.final_set = np.zeros((self.T, self.n), dtype=bool)
            self.cut = np.zeros((self.T, self.n), dtype=bool)
        return self.final

    def add(self, action: Any, obs: Any, reward: Any, terminated: Any, truncated: Any) -> None:
        t = self.t
        if t == self.T:
            self.send()
            t = 0
        self.action[t] = action
        self.reward[t] = reward
        self.terminated[t] = terminated
        self.truncated[t] = truncated
        if self.batched:  # _write's first case, without the call (a step's every ns counts)
            try:
                self.obs[0][t + 1] = obs
            except _MISFITS as exc:
                raise ValueError(self._misfit(obs, exc)) from None
        else:
            self._write(t + 1, obs, None)
        self.t = t + 1

    def _write(self, row: int, obs: Any, mask: np.ndarray | None) -> None:
        """Row `row` of the observation buffers from `obs` (only the environments in `mask`,
        when given), cast to the observation space's dtypes."""
        try:
            if self.batched and mask is None:
                self.obs[0][row] = obs  # a vector env's batching gave it the space's shape
                return
            for get, buf, (shape, _) in zip(self.getters, self.obs, self.leaf_specs):
                value = get(obs)
                if self.single:  # no vector env batched it: shape and cast checked here
                    value = _fitted(value, shape, buf.dtype)
                if mask is None:
                    buf[row] = value
                else:
                    buf[row][mask] = np.asarray(value)[mask]
        except _MISFITS as exc:
            raise ValueError(self._misfit(obs, exc)) from None

    def _misfit(self, obs: Any, exc: Exception, single: bool = False) -> str:
        """Which leaf of an observation (one env's when `single`) does not fit its space."""
        batch = () if single or self.single else (self.n,)
        space = "env.observation_space" if self.single else "envs.single_observation_space"
        for name, get, (shape, dtype) in zip(self.names, self.getters, self.leaf_specs):
            want = f"shape {(*batch, *shape)} castable to {dtype} ({_CASTING}; {space})"
            try:
                value = np.asarray(get(obs))
            except (KeyError, IndexError, TypeError, ValueError):
                return f"{name}: expected {want}, got an observation without it: {obs!r:.200}"
            if value.shape != (*batch, *shape) or not np.can_cast(value.dtype, dtype, _CASTING):
                return f"{name}: expected {want}, got shape {value.shape} {value.dtype}"
            try:
                value.astype(dtype)
            except (TypeError, ValueError, OverflowError):
                return f"{name}: expected {want}, got {value!r:.200}"
        return f"obs: expected an observation of {self.space}, got {obs!r:.200} ({exc})"

    def add_finals(self, final_obs: np.ndarray, has: np.ndarray) -> None:
        """SAME_STEP: the final observations of the last step, from `infos["final_obs"]`
        (one object per environment, None where there is none)."""
        r = self.t - 1
        finals = self._finals()
        for i in np.flatnonzero(has):
            obs = final_obs[i]  # one env's, unbatched: no vector env checked it
            try:
                for get, buf, (shape, _) in zip(self.getters, finals, self.leaf_specs):
                    buf[r, i] = _fitted(get(obs), shape, buf.dtype)
            except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
                where = f"infos['final_obs'][{i}]: "
                raise ValueError(where + self._misfit(obs, exc, single=True)) from None
        self.final_set[r] |= has

    def _pending(self, r: int) -> np.ndarray:
        """NEXT_STEP: the environments whose row `r` is an autoreset row."""
        p = self.pending0 if r == 0 else self.terminated[r - 1] | self.truncated[r - 1]
        for row, mask in self.unpend:
            if row == r:
                p = p & ~mask
        return p

    def restart(self, obs: Any, mask: np.ndarray | None) -> None:
        """A reset() of the environments in `mask` (all when None) returned `obs`."""
        t = self.t
        m = np.ones(self.n, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        env_pending = np.zeros(self.n, dtype=bool)  # the env's own autoreset flag
        if self.started and t > 0:
            r = t - 1
            ended = self.terminated[r] | self.truncated[r]
            finals = self._finals()
            env_pending = ended & ~self.cut[r]  # the flags the env returned
            cut = m & ~ended  # episodes under way: cut here
            if self.mode == AutoresetMode.NEXT_STEP:
                cut &= ~self._pending(r)
            save = cut | (m & ended & ~self.final_set[r])  # before obs[t] is overwritten
            for buf, final in zip(self.obs, finals):
                final[r][save] = buf[t][save]
            self.final_set[r] |= save
            self.truncated[r] |= cut
            self.cut[r] |= cut
        if self.mode == AutoresetMode.NEXT_STEP:
            self.unpend.append((t, m if self.reset_cancels_autoreset else m & ~env_pending))
        self._write(t, obs, None if mask is None else m)
        self.started = True

    def send(self) -> None:
        """record() the rows so far; the observation after the last one starts the next chunk."""
        T = self.t
        if T == 0:
            return
        terminated, truncated = self.terminated[:T], self.truncated[:T]
        done = terminated | truncated
        finals = [f[:T] for f in self._finals()]
        missing = done & ~self.final_set[:T]
        if self.mode == AutoresetMode.SAME_STEP:
            if missing.any():
                r, i = (int(x[0]) for x in np.nonzero(missing))
                raise RuntimeError(
                    f"infos['final_obs']: expected the final observation of environment {i}, "
                    f"which ended an episode (step {self.sent_steps + r} of this wrapper), got "
                    f"none (does a wrapper between this one and the vector env drop infos?)"
                )
        else:  # the observation a done step returned is its final one
            for buf, final in zip(self.obs, finals):
                where = missing.reshape(missing.shape + (1,) * (final.ndim - 2))
                np.copyto(final, buf[1 : T + 1], where=where)
        action = self.action[:T]
        if action.ndim > 3:  # record() takes (T, N, P): a Box of more dimensions, flattened
            action = action.reshape(T, self.n, -1)
        # Under the names record() gives the contract's fields, in its order.
        chunk = {
            "action": action,
            "reward": self.reward[:T],
            "done": done,
            "terminated": terminated,
            "truncated": truncated,
        }
        if self.mode == AutoresetMode.NEXT_STEP:
            valid = np.empty((T, self.n), dtype=bool)
            valid[0] = ~self.pending0
            valid[1:] = ~done[:-1]
            pending = done[-1].copy()
            for row, mask in self.unpend:
                if row < T:
                    valid[row] |= mask
                else:
                    pending &= ~mask
            chunk["valid"] = valid
            self.pending0, self.unpend = pending, []
            self.open_after = valid[-1] & ~done[-1]
        else:
            self.open_after = ~done[-1]
        for name, buf in zip(self.names, self.obs):
            chunk[f"state:{name}"] = buf[:T]
        for name, final in zip(self.names, finals):
            chunk[f"final:{name}"] = final
        self.sent_steps += T
        # record() keeps references: the next chunk gets buffers of its own. They are in
        # place before it is called: an error it raises (a refusal of an earlier chunk, say)
        # must not leave these rows to be sent twice.
        carry = [buf[T] for buf in self.obs]
        self.obs = [np.empty_like(buf) for buf in self.obs]
        for buf, row in zip(self.obs, carry):
            buf[0] = row
        self._new_chunk()
        self.recorder._record_built(chunk)


def _final_obs(infos: Any) -> tuple[Any, Any]:
    """SAME_STEP: the final observations a step's infos hold and which environments have
    one: `infos["final_obs"]` and `infos["_final_obs"]`, or, from a list of per-environment
    info dicts (`DictInfoToList`), each one's `"final_obs"`. (None, None) when none."""
    if isinstance(infos, Mapping):
        final = infos.get("final_obs")
        return (None, None) if final is None else (final, infos["_final_obs"])
    has = np.array([isinstance(info, Mapping) and "final_obs" in info for info in infos])
    if not has.any():
        return None, None
    return [info["final_obs"] if h else None for info, h in zip(infos, has)], has


def _recorder(recorder: RolloutRecorder | None, kwargs: dict[str, Any]) -> tuple[Any, bool]:
    if recorder is None:
        return own_recorder(kwargs), True
    if kwargs:
        raise TypeError(
            f"recorder_kwargs: expected none with a recorder given (they configure the "
            f"recorder made when recorder is None), got {sorted(kwargs)}"
        )
    return recorder, False


class RecordRollouts(gymnasium.vector.VectorWrapper):
    """Records every step of a Gymnasium vector environment (sync or async) into a recorder.

    `recorder=None` makes `RolloutRecorder(**recorder_kwargs)` (with no `target`, a private
    server, which ends with `close()`: a warning says so when it held unread steps; with
    `sender="process"` unless the kwargs pick a sender or use `max_episodes`, `on_error` or
    `on_backpressure="drop"`, which only the thread sender has) and closes it on `close()`;
    a recorder given is flushed on `close()`, not closed, so that `recorder.finish()` can
    follow. Every `chunk_steps` steps one `record()` call sends `obs`, `action`, `reward`,
    `terminated`, `truncated`, `final_obs` and, under next-step autoreset, `valid`. Call
    `reset()` through the wrapper: the first observation is recorded. A Box action of more
    than one dimension is recorded flattened, `(T, N, P)`.
    """

    def __init__(
        self,
        envs: VectorEnv,
        recorder: RolloutRecorder | None = None,
        *,
        chunk_steps: int = 128,
        **recorder_kwargs: Any,
    ) -> None:
        super().__init__(envs)
        mode = _autoreset_mode(envs)
        rows = _Rows(
            None,
            envs.single_observation_space,
            envs.single_action_space,
            envs.num_envs,
            chunk_steps,
            mode,
            "envs",
        )
        self.recorder, self._owned = _recorder(recorder, recorder_kwargs)
        self._claim = claim(self.recorder, self, "RecordRollouts")
        rows.recorder = self.recorder
        # Gymnasium 1.x's AsyncVectorEnv without shared memory keeps a worker's pending
        # next-step autoreset across reset(): the step after it only resets again.
        unwrapped = envs.unwrapped
        rows.reset_cancels_autoreset = not (
            isinstance(unwrapped, gymnasium.vector.AsyncVectorEnv) and not unwrapped.shared_memory
        )
        self._rows = rows
        self._same_step = mode == AutoresetMode.SAME_STEP
        self._done = False

    def reset(
        self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        mask = None if options is None else options.get("reset_mask")  # the env pops it
        obs, infos = self.env.reset(seed=seed, options=options)
        self._rows.restart(obs, mask)
        return obs, infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        rows = self._rows
        if self._done:
            raise RuntimeError(_CLOSED.format(what="RecordRollouts.step"))
        if not rows.started:
            raise RuntimeError(
                "RecordRollouts.step: expected reset() through the wrapper first (the first "
                "observation is recorded), got step() before any"
            )
        obs, reward, terminated, truncated, infos = self.env.step(actions)
        rows.add(actions, obs, reward, terminated, truncated)
        if self._same_step:
            final, has = _final_obs(infos)
            if final is not None:
                rows.add_finals(final, has)
        return obs, reward, terminated, truncated, infos

    def close(self, **kwargs: Any) -> None:
        """Send the rows not yet recorded, flush (or close, when made here) the recorder,
        then close the environments."""
        if not self._done:
            self._done = True
            try:
                _finish(self._rows, self.recorder, self._owned, self._claim)
            finally:
                self.env.close(**kwargs)


_CLOSED = "{what}: expected an open wrapper, got a step after close() (it would not be recorded)"


def _finish(rows: _Rows, recorder: RolloutRecorder, owned: bool, taken: Any) -> None:
    try:
        rows.send()
    finally:
        if rows.open_after is not None:
            taken.left(rows.open_after)
        taken.closed = True
        if owned:
            close_own(recorder, taken.name)
        else:
            recorder.flush()


class RecordEpisodes(gymnasium.Wrapper):
    """Records every step of a single Gymnasium environment (N = 1) into a recorder.

    The same as `RecordRollouts` for a `gymnasium.Env`: the caller resets after a done; a
    reset before one ends the episode as truncated.
    """

    def __init__(
        self,
        env: gymnasium.Env,
        recorder: RolloutRecorder | None = None,
        *,
        chunk_steps: int = 128,
        **recorder_kwargs: Any,
    ) -> None:
        super().__init__(env)
        rows = _Rows(
            None,
            env.observation_space,
            env.action_space,
            1,
            chunk_steps,
            AutoresetMode.DISABLED,
            "env",
        )
        self.recorder, self._owned = _recorder(recorder, recorder_kwargs)
        self._claim = claim(self.recorder, self, "RecordEpisodes")
        rows.recorder = self.recorder
        self._rows = rows
        self._done = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._rows.restart(obs, None)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError(_CLOSED.format(what="RecordEpisodes.step"))
        if not self._rows.started:
            raise RuntimeError(
                "RecordEpisodes.step: expected reset() through the wrapper first (the first "
                "observation is recorded), got step() before any"
            )
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._rows.add(action, obs, reward, terminated, truncated)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """Send the rows not yet recorded, flush (or close, when made here) the recorder,
        then close the environment."""
        if not self._done:
            self._done = True
            try:
                _finish(self._rows, self.recorder, self._owned, self._claim)
            finally:
                self.env.close()


__all__ = ["RecordEpisodes", "RecordRollouts"]
