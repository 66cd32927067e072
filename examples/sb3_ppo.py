"""Stable-Baselines3's PPO on CartPole (8 envs), recorded by RecorderCallback.

Usage: python examples/sb3_ppo.py [total_timesteps] (default 100000). Without a target
(ROLLOUT_RECORDER_TARGET) the recorder starts a private local server.
"""

import sys

import numpy as np
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env

from recorder_client.sb3 import RecorderCallback

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
callback = RecorderCallback(session="sb3-ppo", sender="process")
model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8, seed=0), n_steps=128, seed=0)
model.learn(total_timesteps=steps, callback=callback)

traj = callback.recorder.finish()
callback.close()
# What the envs' own Monitor wrappers counted, beside what was recorded.
monitored = np.concatenate(model.get_env().env_method("get_episode_rewards"))
recorded = traj.rewards.sum(axis=1)[traj.episode_done]
print(f"env: {len(monitored)} episodes, mean return {monitored.mean():.2f}")
print(f"recorded: {len(recorded)} episodes, mean return {recorded.mean():.2f}")
print(
    f"recorded {traj.lengths.sum()} steps; episodes terminated "
    f"{traj.episode_terminated.sum()}, truncated {traj.episode_truncated.sum()}"
)
