"""Stable-Baselines3: RecorderCallback records what an algorithm collects from its VecEnv.

    from recorder_client.sb3 import RecorderCallback
    model.learn(100_000, callback=RecorderCallback(recorder))

On-policy (PPO, A2C) and off-policy (DQN, SAC, TD3) collection alike: each step of the
training VecEnv is a row of ``(T, N)`` arrays recorded per the producer contract:

- ``obs``: the observation the action was taken from (the algorithm's ``_last_obs``; a Dict
  observation gives ``obs.<key>``);
- ``action``: what the VecEnv was given (on-policy: after clipping to a Box's bounds); a Box
  of more than one dimension flattened, ``(T, N, P)``;
- ``reward``: the VecEnv's reward, before the value bootstrap PPO adds to truncated steps;
- ``terminated`` / ``truncated``: from ``dones`` and the ``TimeLimit.truncated`` info SB3's
  VecEnvs set (True when the time limit cut an episode that did not also terminate: a step
  Gymnasium reports as both is recorded as terminated, which is all SB3 says of it);
- ``final_obs``: the ``terminal_observation`` info of each done step (a done step without
  one raises ``RecorderError``: zeros would pass for the final observation).

SB3's VecEnvs reset a finished env within the same step (the done step returns the next
episode's first observation, the last one is in the info), so every row belongs to an episode
and no ``valid`` mask is needed. The values are the training VecEnv's, as the algorithm saw
them: under VecNormalize, normalized observations and rewards; under the VecTransposeImage
SB3 adds for image observations, channel-first images; under VecFrameStack, stacked frames.

Steps are buffered ``chunk_steps`` at a time; the rest is recorded, and acknowledged, when
training ends. Open episodes stay open across ``learn()`` calls that continue them
(``reset_num_timesteps=False``), with this callback or a new one on the same recorder; a
``learn()`` that resets the env while the recorder holds open episodes raises, since their
steps and the new episodes' would be joined. A recorder takes one callback or wrapper at a
time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

try:
    from stable_baselines3.common.callbacks import BaseCallback
except ImportError as exc:  # the client alone does not need SB3
    raise ImportError(
        f"recorder_client.sb3 needs stable-baselines3: pip install 'rollout-recorder[sb3]' ({exc})"
    ) from exc

from ._producer import claim, close_own, own_recorder
from .errors import RecorderError
from .recorder import RolloutRecorder


def _rows(value: Any, steps: int) -> Any:
    """Zeroed (steps, N, ...) buffers shaped like one step's (N, ...) value (a dict: per key)."""
    if isinstance(value, Mapping):
        return {key: _rows(item, steps) for key, item in value.items()}
    value = np.asarray(value)
    return np.zeros((steps, *value.shape), dtype=value.dtype)


def _put(buffer: Any, row: Any, value: Any) -> None:
    """Write ``value`` at ``buffer[row]`` (``row`` may be a (t, env) pair), key by key."""
    if isinstance(buffer, dict):
        if not isinstance(value, Mapping) or value.keys() != buffer.keys():
            got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise RecorderError(
                f"RecorderCallback: obs: expected the keys {sorted(buffer)} of the first step, "
                f"got {got}"
            )
        for key, item in buffer.items():
            _put(item, row, value[key])
        return
    buffer[row] = value


def _head(buffer: Any, steps: int) -> Any:
    if isinstance(buffer, dict):
        return {key: _head(item, steps) for key, item in buffer.items()}
    return buffer[:steps]


class RecorderCallback(BaseCallback):
    """Records every step an SB3 algorithm collects into ``recorder`` (or, without one, into
    a ``RolloutRecorder(**recorder_kwargs)`` this callback makes: ``callback.recorder``, with
    ``sender="process"`` unless the kwargs pick a sender or need the thread sender).

    ``chunk_steps``: VecEnv steps per ``record()`` call.
    """

    def __init__(
        self,
        recorder: RolloutRecorder | None = None,
        *,
        chunk_steps: int = 128,
        verbose: int = 0,
        **recorder_kwargs: Any,
    ) -> None:
        super().__init__(verbose)
        if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
            raise ValueError(f"chunk_steps: expected a positive integer, got {chunk_steps!r}")
        if recorder is not None and recorder_kwargs:
            raise ValueError(
                f"recorder_kwargs: expected none with a recorder given, got {sorted(recorder_kwargs)}"
            )
        self._owned = recorder is None
        self.recorder = recorder if recorder is not None else own_recorder(recorder_kwargs)
        self.chunk_steps = chunk_steps
        self._buffers: dict[str, Any] | None = None
        self._row = 0
        # What the env holds after the last recorded step, to tell a continued run from a
        # reset one; and which envs have an episode open.
        self._last_new_obs: Any = None
        self._last_dones: Any = None

    def _on_training_start(self) -> None:
        # Another callback (or wrapper) that recorded into this recorder, and left episodes
        # open, is refused here unless this learn() continues its env (claim's `resume`).
        self._claim = claim(self.recorder, self, "RecorderCallback", resume=self.model._last_obs)
        if self._last_dones is None:
            return
        open_envs = ~np.asarray(self._last_dones, dtype=bool)
        if open_envs.any() and self.model._last_obs is not self._last_new_obs:
            envs = np.flatnonzero(open_envs).tolist()
            raise RecorderError(
                "RecorderCallback: learn() reset the env while episodes recorded by this "
                f"callback were open (envs {envs}); their steps would be joined to the new "
                "episodes. Continue them with learn(..., reset_num_timesteps=False), or record "
                "the new run with a new recorder (another worker_id)."
            )

    def _allocate(self, obs: Any, action: np.ndarray, reward: np.ndarray) -> dict[str, Any]:
        steps = self.chunk_steps
        n = reward.shape[0]
        return {
            "obs": _rows(obs, steps),
            "action": _rows(action, steps),
            "reward": _rows(reward, steps),
            "terminated": np.zeros((steps, n), dtype=bool),
            "truncated": np.zeros((steps, n), dtype=bool),
            "final_obs": _rows(obs, steps),
        }

    def _on_step(self) -> bool:
        local = self.locals
        # On-policy algorithms step the env with the clipped actions; off-policy ones with
        # `actions` (already unscaled to the action space).
        action = local.get("clipped_actions")
        if action is None:
            action = local["actions"]
        obs, dones = self.model._last_obs, local["dones"]
        buffers, row = self._buffers, self._row
        if buffers is None:
            reward = np.asarray(local["rewards"])
            buffers = self._buffers = self._allocate(obs, np.asarray(action), reward)
        observations = buffers["obs"]
        if type(observations) is np.ndarray:  # not a Dict space's buffers: no call (cold)
            observations[row] = obs
        else:
            _put(observations, row, obs)
        buffers["action"][row] = action
        buffers["reward"][row] = local["rewards"]  # a copy: PPO bootstraps `rewards` later
        # Rows start all False: only the envs a step ended are written (most steps end none,
        # and finding which costs the training loop ~4 us a step).
        if np.count_nonzero(dones):
            self._ended(buffers, row, dones, local["infos"])
        self._last_dones = dones
        self._last_new_obs = local.get("new_obs")
        self._row = row + 1
        if self._row == self.chunk_steps:
            self._record(self._row)
        return True

    @staticmethod
    def _ended(buffers: dict[str, Any], row: int, dones: np.ndarray, infos: list) -> None:
        terminated, truncated = buffers["terminated"][row], buffers["truncated"][row]
        terminated[:] = dones  # then each cut by the time limit moves to truncated
        for env in np.flatnonzero(dones).tolist():
            info = infos[env]
            if info.get("TimeLimit.truncated", False):
                truncated[env], terminated[env] = True, False
            final = info.get("terminal_observation")
            if final is None:  # zeros would pass for the final observation
                raise RecorderError(
                    f"RecorderCallback: infos[{env}]['terminal_observation']: expected the final "
                    f"observation of env {env}, whose episode ended (SB3's VecEnvs set it), got "
                    "none (does a VecEnv wrapper drop it?)"
                )
            _put(buffers["final_obs"], (row, env), final)

    def _record(self, steps: int) -> None:
        buffers = self._buffers
        # record() keeps references: the next rows go to fresh buffers.
        self._buffers, self._row = None, 0
        if buffers is not None and steps:
            chunk = {name: _head(value, steps) for name, value in buffers.items()}
            action = chunk["action"]
            if action.ndim > 3:  # record() takes (T, N, P): a Box of more dimensions, flattened
                chunk["action"] = action.reshape(steps, action.shape[1], -1)
            self.recorder.record(chunk)

    def _on_training_end(self) -> None:
        self._record(self._row)
        if self._last_dones is not None:
            self._claim.left(~np.asarray(self._last_dones, dtype=bool), self._last_new_obs)
        self._claim.closed = True
        self.recorder.flush()

    def close(self) -> None:
        """Close the recorder this callback made (one given to it is the caller's to close)."""
        if self._owned:
            close_own(self.recorder, "RecorderCallback")
