import gymnasium as gym

from recorder_client import RolloutRecorder
from recorder_client.gymnasium import RecordRollouts

with RolloutRecorder(sender="process") as recorder:  # no target: a private local server
    envs = RecordRollouts(gym.make_vec("CartPole-v1", 8, vectorization_mode="sync"), recorder)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    for _ in range(640):
        envs.step(envs.action_space.sample())
    envs.close()  # records the last steps; a recorder given stays open
    traj = recorder.finish()  # padded episodes, unfinished tails included
returns = traj.rewards.sum(axis=1)[traj.episode_done]
print(f"{len(returns)} episodes finished, mean return {returns.mean():.2f}")
print(f"observations {traj.obs.shape}, {traj.episode_truncated.sum()} truncated")
