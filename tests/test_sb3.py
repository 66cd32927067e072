"""RecorderCallback under SB3's own autoreset: the episodes finish() returns equal, step for
step, what each environment really returned to SB3's DummyVecEnv.

The truth is logged by a wrapper installed on each env (outside its TimeLimit, so it sees
what the VecEnv sees): the observation each action was taken from, the action, the reward,
both flags and the observation after the step, split into episodes where a flag is set. SB3
reports a step that is both terminated and truncated as terminated (its TimeLimit.truncated
info is ``truncated and not terminated``): the truth says so too, and counts such steps.
Under VecEnv wrappers that change the values the algorithm sees (VecNormalize,
VecTransposeImage), the truth is logged around them instead (VecLog).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from recorder_client import RecorderError, RolloutRecorder

gym = pytest.importorskip("gymnasium")
sb3 = pytest.importorskip("stable_baselines3")
from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecEnvWrapper,
    VecNormalize,
    VecTransposeImage,
)
from test_gymnasium import EndsEvery  # noqa: E402

from recorder_client.sb3 import RecorderCallback  # noqa: E402

# Time limits under CartPole's early episode lengths: both flags occur.
PPO_STEPS, DQN_STEPS = 25, 12


class StepLog(gym.Wrapper):
    """Logs every step the env really took: (obs before, action, reward, terminated,
    truncated, obs after)."""

    def __init__(self, env, log: list) -> None:
        super().__init__(env)
        self.log = log
        self.obs = None

    def reset(self, **kwargs):
        self.obs, info = self.env.reset(**kwargs)
        return self.obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.log.append((self.obs, np.asarray(action).copy(), reward, terminated, truncated, obs))
        self.obs = obs
        return obs, reward, terminated, truncated, info


def dict_cartpole(max_steps: int) -> gym.Env:
    """CartPole whose observation is a Dict: {"cart": position and velocity, "pole": angle
    and angular velocity}."""
    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    box = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    space = gym.spaces.Dict({"cart": box, "pole": box})
    return gym.wrappers.TransformObservation(env, lambda o: {"cart": o[:2], "pole": o[2:]}, space)


def logged_envs(
    n: int, max_steps: int, dict_obs: bool = False, env_id: str = "CartPole-v1"
) -> tuple[DummyVecEnv, list[list]]:
    logs: list[list] = [[] for _ in range(n)]

    def make(i: int):
        if dict_obs:
            return lambda: StepLog(dict_cartpole(max_steps), logs[i])
        return lambda: StepLog(gym.make(env_id, max_episode_steps=max_steps), logs[i])

    return DummyVecEnv([make(i) for i in range(n)]), logs


def fields(obs) -> dict[str, np.ndarray]:
    """An observation under the recorder's field names: obs, or obs.<key> for a Dict."""
    if isinstance(obs, dict):
        return {f"obs.{key}": np.asarray(value) for key, value in obs.items()}
    return {"obs": np.asarray(obs)}


def truth_episodes(log: list) -> list[dict]:
    """One env's log cut into episodes where a flag ends one; the last may be unfinished."""
    episodes, current = [], []
    for step in log:
        current.append(step)
        if step[3] or step[4]:
            episodes.append(current)
            current = []
    if current:
        episodes.append(current)
    out = []
    for steps in episodes:
        obs, action, reward, terminated, truncated, after = zip(*steps)
        ended = terminated[-1] or truncated[-1]
        final = fields(after[-1])
        out.append(
            {
                "obs": {k: np.stack([fields(o)[k] for o in obs]) for k in final},
                "action": np.stack(action),
                # SB3's VecEnvs hold rewards as float32: what the callback is given.
                "reward": np.asarray(reward, dtype=np.float32),
                "terminated": bool(terminated[-1]),
                "truncated": bool(truncated[-1] and not terminated[-1]),
                "final": final if ended else {k: np.zeros_like(v) for k, v in final.items()},
            }
        )
    return out


def compare(traj, logs: list[list]) -> dict[str, int]:
    """Mismatches per quantity between finish() and the logs, and the episode counts."""
    counts = {"episodes": 0, "terminated": 0, "truncated": 0, "tails": 0, "both_flags": 0}
    mismatches = dict.fromkeys(("count", "obs", "action", "reward", "flags", "final"), 0)
    for env, log in enumerate(logs):
        counts["both_flags"] += sum(1 for s in log if s[3] and s[4])
        truth = truth_episodes(log)
        ours = np.flatnonzero(traj.episode_env == env)
        ours = ours[np.argsort(traj.episode_start[ours], kind="stable")]
        mismatches["count"] += len(ours) != len(truth)
        for b, want in zip(ours, truth):
            n = int(traj.lengths[b])
            counts["episodes"] += 1
            counts["terminated"] += want["terminated"]
            counts["truncated"] += want["truncated"]
            counts["tails"] += not (want["terminated"] or want["truncated"])
            mismatches["obs"] += any(
                not np.array_equal(traj.states[k][b, :n], v) for k, v in want["obs"].items()
            )
            mismatches["action"] += not np.array_equal(traj.actions[b, :n], want["action"])
            mismatches["reward"] += not np.array_equal(traj.rewards[b, :n], want["reward"])
            mismatches["flags"] += (
                bool(traj.episode_terminated[b]) != want["terminated"]
                or bool(traj.episode_truncated[b]) != want["truncated"]
            )
            mismatches["final"] += any(
                not np.array_equal(traj.final_states[k][b], v) for k, v in want["final"].items()
            )
    print(f"episodes {counts}, mismatches {mismatches}")
    return {**counts, "mismatches": sum(mismatches.values())}


@pytest.mark.parametrize("dict_obs", [False, True], ids=["box", "dict"])
def test_ppo_rollouts_are_recorded_exactly(target, dict_obs):
    envs, logs = logged_envs(8, PPO_STEPS, dict_obs)
    with RolloutRecorder(target=target, session="ppo") as recorder:
        callback = RecorderCallback(recorder, chunk_steps=50)  # chunks cut across rollouts
        policy = "MultiInputPolicy" if dict_obs else "MlpPolicy"
        model = sb3.PPO(policy, envs, n_steps=32, batch_size=128, n_epochs=1, seed=0)
        model.learn(768, callback=callback)
        # A second learn() that continues the open episodes.
        model.learn(256, callback=callback, reset_num_timesteps=False)
        traj = recorder.finish()
    assert sum(len(log) for log in logs) == int(traj.lengths.sum()) == 1024
    assert set(traj.states) == ({"obs.cart", "obs.pole"} if dict_obs else {"obs"})
    result = compare(traj, logs)
    assert result["terminated"] > 10 and result["truncated"] > 10 and result["tails"] > 0
    assert result["mismatches"] == 0


def test_dqn_collection_is_recorded_exactly(target):
    envs, logs = logged_envs(4, DQN_STEPS)
    with RolloutRecorder(target=target, session="dqn") as recorder:
        model = sb3.DQN(
            "MlpPolicy", envs, learning_starts=200, train_freq=4, buffer_size=4000, seed=0
        )
        model.learn(1200, callback=RecorderCallback(recorder, chunk_steps=64))
        traj = recorder.finish()
    assert sum(len(log) for log in logs) == int(traj.lengths.sum()) == 1200
    result = compare(traj, logs)
    assert result["terminated"] > 10 and result["truncated"] > 10 and result["tails"] > 0
    assert result["mismatches"] == 0


@pytest.mark.parametrize("algorithm", ["PPO", "SAC"])
def test_continuous_actions_are_the_ones_the_env_got(target, algorithm):
    """Pendulum's Box actions: PPO's are clipped to the bounds before the env gets them,
    SAC's unscaled from [-1, 1]; the env's log holds what it really got. Pendulum never
    terminates: every finished episode is a truncation."""
    envs, logs = logged_envs(2, 15, env_id="Pendulum-v1")
    with RolloutRecorder(target=target, session=algorithm.lower()) as recorder:
        if algorithm == "PPO":
            model = sb3.PPO("MlpPolicy", envs, n_steps=40, batch_size=80, n_epochs=1, seed=0)
        else:
            model = sb3.SAC("MlpPolicy", envs, learning_starts=60, buffer_size=1000, seed=0)
        model.learn(160, callback=RecorderCallback(recorder, chunk_steps=32))
        traj = recorder.finish()
    assert traj.actions.dtype == np.float32 and traj.actions.shape[2:] == (1,)
    assert sum(len(log) for log in logs) == int(traj.lengths.sum()) == 160
    result = compare(traj, logs)
    assert result["terminated"] == 0 and result["truncated"] >= 8
    assert result["mismatches"] == 0


def test_a_learn_that_resets_open_episodes_is_refused(target):
    envs, _ = logged_envs(2, PPO_STEPS)
    with RolloutRecorder(target=target, session="reset") as recorder:
        callback = RecorderCallback(recorder, chunk_steps=16)
        model = sb3.PPO("MlpPolicy", envs, n_steps=16, batch_size=32, n_epochs=1, seed=0)
        model.learn(32, callback=callback)
        with pytest.raises(RecorderError, match=r"learn\(\) reset the env while episodes"):
            model.learn(32, callback=callback)  # reset_num_timesteps=True resets the env


def test_a_new_callback_continues_open_episodes_only_where_learn_continues_the_env(target):
    """A callback made for each learn(): the recorder remembers what the last one left open.
    Continuing the env (reset_num_timesteps=False) continues its episodes exactly; a learn()
    that resets the env is refused before its first step, as with one callback."""
    envs, logs = logged_envs(2, PPO_STEPS)
    with RolloutRecorder(target=target, session="new-callbacks") as recorder:
        model = sb3.PPO("MlpPolicy", envs, n_steps=16, batch_size=32, n_epochs=1, seed=0)
        model.learn(96, callback=RecorderCallback(recorder, chunk_steps=20))
        model.learn(64, callback=RecorderCallback(recorder), reset_num_timesteps=False)
        steps = sum(len(log) for log in logs)
        with pytest.raises(
            RecorderError,
            match=r"^RecorderCallback: recorder: expected no episodes left open by the "
            r"RecorderCallback that recorded into it before .* got envs \[0, 1\]",
        ):
            model.learn(32, callback=RecorderCallback(recorder))  # resets the env
        assert sum(len(log) for log in logs) == steps  # refused before any step
        traj = recorder.finish()
    assert int(traj.lengths.sum()) == steps == 160
    result = compare(traj, logs)
    assert result["episodes"] >= 6 and result["tails"] == 2
    assert result["mismatches"] == 0


def test_a_box_action_of_two_dimensions_is_recorded_flattened(target):
    logs: list[list] = [[], []]
    square = gym.spaces.Box(-1, 1, (2, 2), np.float32)
    envs = DummyVecEnv([lambda i=i: StepLog(EndsEvery(7, square), logs[i]) for i in range(2)])
    with RolloutRecorder(target=target, session="square-action") as recorder:
        model = sb3.PPO("MlpPolicy", envs, n_steps=16, batch_size=32, n_epochs=1, seed=0)
        model.learn(64, callback=RecorderCallback(recorder, chunk_steps=10))
        traj = recorder.finish()
    assert traj.actions.shape[2:] == (4,)
    for env, log in enumerate(logs):
        ours = np.flatnonzero(traj.episode_env == env)
        ours = ours[np.argsort(traj.episode_start[ours], kind="stable")]
        got = np.concatenate([traj.actions[b, : int(traj.lengths[b])] for b in ours])
        want = np.stack([step[1].reshape(4) for step in log])
        assert got.tobytes() == want.astype(np.float32).tobytes()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"^chunk_steps: expected a positive integer, got 0"):
        RecorderCallback(object(), chunk_steps=0)


def test_a_recorder_the_callback_makes_streams_from_a_process(target):
    made = RecorderCallback(target=target, session="sb3-made")
    threads = RecorderCallback(target=target, session="sb3-made-max", max_episodes=5)
    try:
        assert (made.recorder.sender, threads.recorder.sender) == ("process", "thread")
    finally:
        made.close()
        threads.close()


def test_a_callback_recorder_without_a_target_warns_only_of_unread_steps(monkeypatch, caplog):
    """No recorder and no target: a private server that ends with close(). After learn(),
    `callback.recorder.finish()` reads every step, and close() says nothing; a callback
    closed unread warns that its steps go with the server."""
    monkeypatch.delenv("ROLLOUT_RECORDER_TARGET", raising=False)
    caplog.set_level(logging.WARNING, logger="recorder_client")
    callbacks = []
    for _ in range(2):
        envs, _ = logged_envs(2, PPO_STEPS)
        callback = RecorderCallback(chunk_steps=8)
        sb3.PPO("MlpPolicy", envs, n_steps=16, batch_size=32, n_epochs=1, seed=0).learn(
            32, callback=callback
        )
        callbacks.append(callback)
    read, unread = callbacks
    assert read.recorder.target.startswith("unix:")
    assert read.recorder.finish().lengths.sum() == 32  # learn()'s 32 steps, 16 per env
    read.close()
    assert caplog.records == []
    unread.close()
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "RecorderCallback.close(): the recorder it made had no target, and its private server"
    )


def test_a_done_step_without_its_terminal_observation_is_refused(target):
    """Zeros would pass for the final observation: a VecEnv that drops it is named."""

    class DropFinal(VecEnvWrapper):
        def reset(self):
            return self.venv.reset()

        def step_wait(self):
            obs, rewards, dones, infos = self.venv.step_wait()
            for info in infos:
                info.pop("terminal_observation", None)
            return obs, rewards, dones, infos

    envs, _ = logged_envs(2, PPO_STEPS)
    message = r"infos\[\d\]\['terminal_observation'\]: expected the final observation of env \d"
    with RolloutRecorder(target=target, session="drop") as recorder:
        model = sb3.PPO("MlpPolicy", DropFinal(envs), n_steps=32, batch_size=64, n_epochs=1)
        with pytest.raises(RecorderError, match=message):
            model.learn(64, callback=RecorderCallback(recorder, chunk_steps=16))


class VecLog(VecEnvWrapper):
    """What a VecEnv (VecNormalize, VecTransposeImage ...) returned to the algorithm, per env,
    in StepLog's form: logged by a VecEnvWrapper around it."""

    def __init__(self, venv) -> None:
        super().__init__(venv)
        self.logs: list[list] = [[] for _ in range(venv.num_envs)]

    def reset(self):
        self.obs = self.venv.reset()
        return self.obs

    def step_async(self, actions) -> None:
        self.actions = np.array(actions)
        self.venv.step_async(actions)

    def step_wait(self):
        obs, rewards, dones, infos = self.venv.step_wait()
        for i, log in enumerate(self.logs):
            cut = bool(infos[i].get("TimeLimit.truncated", False))
            after = infos[i]["terminal_observation"] if dones[i] else obs[i]
            log.append(
                (self.obs[i].copy(), self.actions[i], rewards[i], dones[i] and not cut, cut, after)
            )
        self.obs = obs
        return obs, rewards, dones, infos


class Pictures(gym.Env):
    """Random (36, 36, 3) uint8 images, the smallest SB3's CnnPolicy takes."""

    observation_space = gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.integers(0, 256, (36, 36, 3), dtype=np.uint8), {}

    def step(self, action):
        obs, _ = self.reset()
        return obs, float(action), bool(self.np_random.random() < 0.1), False, {}


@pytest.mark.parametrize("wrapper", ["VecNormalize", "VecTransposeImage"])
def test_values_are_the_ones_the_algorithm_saw_through_vec_wrappers(target, wrapper):
    """Under VecNormalize the recorded observations and rewards are the normalized ones; an
    image env gets SB3's VecTransposeImage: channel-first images. The truth is logged
    around those wrappers; the env's own returns (StepLog) differ from it."""
    if wrapper == "VecNormalize":
        envs, raw = logged_envs(4, PPO_STEPS)
        envs, policy = VecLog(VecNormalize(envs)), "MlpPolicy"
    else:
        raw = [[] for _ in range(2)]
        make = lambda i: lambda: StepLog(gym.wrappers.TimeLimit(Pictures(), 15), raw[i])  # noqa: E731
        envs, policy = VecLog(VecTransposeImage(DummyVecEnv([make(0), make(1)]))), "CnnPolicy"
    with RolloutRecorder(target=target, session=wrapper) as recorder:
        model = sb3.PPO(policy, envs, n_steps=32, batch_size=64, n_epochs=1, seed=0)
        model.learn(256, callback=RecorderCallback(recorder, chunk_steps=24))
        traj = recorder.finish()
    result = compare(traj, envs.logs)
    assert result["terminated"] > 3 and result["episodes"] > 10
    assert result["mismatches"] == 0
    assert compare(traj, raw)["mismatches"] > 0  # the env's own values are not what SB3 saw
