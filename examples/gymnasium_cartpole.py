import gymnasium as gym
import numpy as np

from recorder_client import RolloutRecorder

T, N = 64, 8  # steps per chunk, environments
same_step = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}  # no fake reset steps
envs = gym.make_vec("CartPole-v1", N, vectorization_mode="sync", vector_kwargs=same_step)
obs, _ = envs.reset(seed=0)
envs.action_space.seed(0)
with RolloutRecorder(record_states=True, state_fields=["obs"]) as recorder:
    for _ in range(10):  # 10 chunks of T steps of N environments
        chunk = []
        for _ in range(T):
            action = envs.action_space.sample()
            next_obs, reward, terminated, truncated, _ = envs.step(action)
            chunk.append((obs, action, reward, terminated | truncated))
            obs = next_obs  # after a done: the next episode's first observation
        o, a, r, d = (np.stack(x) for x in zip(*chunk))  # each (T, N, ...)
        recorder.record({"action": a, "reward": r, "done": d}, {"obs": o})
    traj = recorder.finish()  # padded episodes, unfinished tails included
returns = traj.rewards.sum(axis=1)[traj.episode_done]
print(f"{len(returns)} episodes finished, mean return {returns.mean():.2f}")
