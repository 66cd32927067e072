import jax
import jax.numpy as jnp

from recorder_client import RolloutRecorder

T, N = 128, 64  # steps per chunk, environments


@jax.jit
def collect(key):  # stands in for factoriax's collect_fn: (T, N, ...) arrays on the device
    k_action, k_done = jax.random.split(key)
    action = jax.random.randint(k_action, (T, N), 0, 8)
    done = jax.random.uniform(k_done, (T, N)) < 0.01
    reward = done.astype(jnp.float32)  # 1 on an episode's last step
    positions = jnp.cumsum(action, axis=0)[..., None]  # (T, N, 1)
    return {"action": action, "reward": reward, "done": done}, {"player_positions": positions}


with RolloutRecorder(record_states=True) as recorder:  # no target: a private local server
    for key in jax.random.split(jax.random.key(0), 20):
        trajectories, env_states = collect(key)
        recorder.record(trajectories, env_states)  # returns at once; copied in the background
    traj = recorder.finish()
print(f"{int(traj.episode_done.sum())} episodes finished, {traj.lengths.sum()} steps")
print(traj)
