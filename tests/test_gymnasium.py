"""recorder_client.gymnasium records exactly what the environments produced.

The truth is computed here from the environments themselves, never from the wrapper: the
same seeds and actions are replayed on single, un-vectorised environments, which are reset
by Gymnasium's documented autoreset rules (next-step: the step after a done only resets and
ignores its action; same-step: the done step resets; disabled: the caller resets), and the
episodes are cut where the environments said so. A reset() before an episode ended cuts it:
the wrapper documents that as truncated, with the observation the environment was left in as
the final one (what Minari's DataCollector does).

Then every episode the wrapper recorded is compared with the truth, step for step: the
observations (every leaf of a nested Dict/Tuple, with its dtype), actions, rewards, both
flags and the final observation.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv  # noqa: E402

from recorder_client import RecorderError, RolloutRecorder  # noqa: E402
from recorder_client.gymnasium import RecordEpisodes, RecordRollouts  # noqa: E402

NEXT, SAME, DISABLED = AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED
MAX_STEPS = 12  # the mixed env's time limit


class MixedEnv(gym.Env):
    """A small env with a nested Dict/Tuple observation of several dtypes. It terminates at
    random, and more often on its last step, so that the time limit around it sometimes
    truncates the step that terminated: both flags True."""

    observation_space = spaces.Dict(
        {
            "pos": spaces.Box(-10, 10, (2,), np.float32),
            "grid": spaces.Box(0, 255, (3, 3), np.uint8),
            "inner": spaces.Tuple(
                (
                    spaces.Discrete(5),
                    spaces.MultiBinary(4),
                    spaces.Dict({"count": spaces.Box(0, 1000, (), np.int32)}),
                )
            ),
            "mode": spaces.MultiDiscrete([3, 2]),
        }
    )
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    def _obs(self):
        rng = self.np_random
        return {
            "pos": self.pos.copy(),
            "grid": rng.integers(0, 256, (3, 3), dtype=np.uint8),
            "inner": (
                int(rng.integers(5)),
                rng.integers(0, 2, 4, dtype=np.int8),
                {"count": np.int32(self.count)},
            ),
            "mode": rng.integers(0, [3, 2]).astype(np.int64),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self.count = 0
        return self._obs(), {}

    def step(self, action):
        self.count += 1
        self.pos = np.clip(self.pos + np.asarray(action, np.float32), -10, 10)
        reward = float(self.np_random.standard_normal())
        terminated = bool(self.np_random.random() < (0.5 if self.count == MAX_STEPS else 0.08))
        return self._obs(), reward, terminated, False, {}


def make_mixed():
    return gym.wrappers.TimeLimit(MixedEnv(), MAX_STEPS)


def make_cartpole():
    return gym.make("CartPole-v1")


# -- the truth, from single environments ------------------------------------------------


def leaves(obs, prefix="obs"):
    """{field name: value} of a (single env's) observation, named as the recorder names
    them: obs, obs.<key>, obs.<i>, joined by dots."""
    if isinstance(obs, dict):
        return {k: v for key, sub in obs.items() for k, v in leaves(sub, f"{prefix}.{key}").items()}
    if isinstance(obs, tuple):
        return {k: v for i, sub in enumerate(obs) for k, v in leaves(sub, f"{prefix}.{i}").items()}
    return {prefix: np.asarray(obs)}


class Episode:
    def __init__(self):
        self.obs, self.actions, self.rewards = [], [], []
        self.terminated = self.truncated = False
        self.final = None  # leaves of the final observation; None: no flag ended it
        self.cut = False  # a reset() ended it

    def close(self, terminated, truncated, final):
        self.terminated, self.truncated, self.final = bool(terminated), bool(truncated), final


def truth(
    make_env, seed, actions, mode, interrupts=None, reset_cancels_autoreset=True, autoresets=None
):
    """Per environment, its episodes in time order: `actions` (K, N, ...) replayed on N
    single environments seeded seed + i as a vector env seeds them. `interrupts`: step ->
    reset mask (None: all) of a reset() called before that step. `reset_cancels_autoreset`
    False: a reset() leaves a pending next-step autoreset pending (what Gymnasium 1.x's
    AsyncVectorEnv does without shared memory). `autoresets`, a dict: filled with each env's
    next-step autoreset steps."""
    interrupts = interrupts or {}
    out = []
    for i in range(actions.shape[1]):
        env = make_env()
        obs, _ = env.reset(seed=seed + i)
        episodes, cur, pending = [], Episode(), False
        for k in range(actions.shape[0]):
            if k in interrupts and (interrupts[k] is None or interrupts[k][i]):
                if cur.actions:  # cut while under way: truncated, left in `obs`
                    cur.close(False, True, leaves(obs))
                    cur.cut = True
                    episodes.append(cur)
                    cur = Episode()
                obs, _ = env.reset()
                pending = pending and not reset_cancels_autoreset
            if mode == NEXT and pending:  # the autoreset step: the action is ignored
                if autoresets is not None:
                    autoresets.setdefault(i, set()).add(k)
                obs, _ = env.reset()
                pending = False
                continue
            after, reward, terminated, truncated, _ = env.step(actions[k, i])
            cur.obs.append(leaves(obs))
            cur.actions.append(actions[k, i])
            cur.rewards.append(reward)
            if terminated or truncated:
                cur.close(terminated, truncated, leaves(after))
                episodes.append(cur)
                cur = Episode()
                if mode == NEXT:
                    pending, obs = True, after
                else:  # SAME_STEP resets now; under DISABLED the caller does (drive())
                    obs, _ = env.reset()
            else:
                obs = after
        if cur.actions:
            episodes.append(cur)  # a tail: no flag ended it
        env.close()
        out.append(episodes)
    return out


def drive(envs, seed, actions, interrupts=None):
    """Run the vector env through its wrapper: reset(seed), the actions, the interrupting
    resets, and under DISABLED autoreset the caller's reset of every finished env."""
    interrupts = interrupts or {}
    disabled = envs.metadata["autoreset_mode"] == DISABLED
    envs.reset(seed=seed)
    for k, action in enumerate(actions):
        if k in interrupts:
            mask = interrupts[k]
            envs.reset(options=None if mask is None else {"reset_mask": mask.copy()})
        _, _, terminated, truncated, _ = envs.step(action)
        if disabled and (terminated | truncated).any():
            envs.reset(options={"reset_mask": terminated | truncated})


def sample_actions(space, steps, num_envs, seed=1):
    space.seed(seed)
    return np.stack([space.sample() for _ in range(steps * num_envs)]).reshape(
        steps, num_envs, *space.shape
    )


# -- the comparison ------------------------------------------------------------------


def mismatches(traj, expected):
    """Every (episode, field) where the recorded episodes differ from the truth."""
    flat = [ep for env_eps in expected for ep in env_eps]
    bad = []
    if traj.num_episodes != len(flat):
        return [f"episodes: expected {len(flat)}, got {traj.num_episodes}"]
    envs = np.repeat(np.arange(len(expected)), [len(e) for e in expected])
    if not (traj.episode_env == envs).all():
        bad.append("episode_env")
    for b, ep in enumerate(flat):
        n = len(ep.actions)
        if traj.lengths[b] != n:
            bad.append(f"episode {b}: length {traj.lengths[b]} != {n}")
            continue
        got_a = traj.actions[b, :n]
        want_a = np.asarray(ep.actions, got_a.dtype).reshape(n, *got_a.shape[1:])  # (T, P)
        if not np.array_equal(got_a, want_a):
            bad.append(f"episode {b}: actions")
        if not np.array_equal(traj.rewards[b, :n], np.asarray(ep.rewards, np.float32)):
            bad.append(f"episode {b}: rewards")
        for name in ep.obs[0]:
            want = np.stack([o[name] for o in ep.obs])
            got = traj.states[name][b, :n]
            if got.dtype != want.dtype or not np.array_equal(got, want):
                bad.append(f"episode {b}: {name} ({got.dtype} vs {want.dtype})")
        flags = (bool(traj.episode_terminated[b]), bool(traj.episode_truncated[b]))
        if flags != (ep.terminated, ep.truncated):
            bad.append(f"episode {b}: flags {flags} != {(ep.terminated, ep.truncated)}")
        if bool(traj.episode_done[b]) != (ep.final is not None):
            bad.append(f"episode {b}: episode_done")
        for name, value in traj.final_states.items():
            want = ep.final[name] if ep.final is not None else np.zeros_like(value[b])
            if not np.array_equal(value[b], want):
                bad.append(f"episode {b}: final {name}")
    return bad


def check(traj, expected, label):
    bad = mismatches(traj, expected)
    eps = [ep for env_eps in expected for ep in env_eps]
    both = sum(ep.terminated and ep.truncated for ep in eps)
    print(
        f"{label}: {len(eps)} episodes ({sum(e.terminated for e in eps)} terminated, "
        f"{sum(e.truncated for e in eps)} truncated, {both} both, "
        f"{sum(e.final is None for e in eps)} tails, {sum(e.cut for e in eps)} cut by reset()), "
        f"{len(bad)} mismatches"
    )
    assert bad == [], bad[:10]
    return eps


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    from conftest import ServerProcess

    proc = ServerProcess(tmp_path_factory.mktemp("gym") / "data")
    try:
        yield proc.address
    finally:
        proc.stop()


def recorded(address, session, envs, drive_it, chunk_steps=64, sender="thread"):
    """Drive `envs` wrapped in RecordRollouts into a fresh session; finish()."""
    with RolloutRecorder(target=address, session=session, sender=sender) as recorder:
        wrapped = RecordRollouts(envs, recorder, chunk_steps=chunk_steps)
        drive_it(wrapped)
        wrapped.close()
        return recorder.finish()


def vector(kind, make_env, n, mode, **kwargs):
    cls = SyncVectorEnv if kind == "sync" else AsyncVectorEnv
    return cls([make_env] * n, autoreset_mode=mode, **kwargs)


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("sender", ["thread", "process"])
@pytest.mark.parametrize("mode", [NEXT, SAME])
def test_cartpole_sync_8_envs_exact(address, mode, sender):
    n, steps = 8, 1500
    actions = sample_actions(gym.spaces.Discrete(2), steps, n)
    envs = vector("sync", make_cartpole, n, mode)
    session = f"cartpole-{mode.value}-{sender}"
    traj = recorded(address, session, envs, lambda e: drive(e, 3, actions), sender=sender)
    eps = check(traj, truth(make_cartpole, 3, actions, mode), f"CartPole sync {mode.value}")
    assert len(eps) > 400


@pytest.mark.parametrize("mode", [NEXT, SAME])
def test_dict_env_async_8_processes_exact(address, mode):
    n, steps = 8, 600
    actions = sample_actions(MixedEnv.action_space, steps, n)
    envs = vector("async", make_mixed, n, mode)  # the processes fork before any recorder
    traj = recorded(address, f"mixed-async-{mode.value}", envs, lambda e: drive(e, 5, actions))
    eps = check(traj, truth(make_mixed, 5, actions, mode), f"Dict env async {mode.value}")
    assert any(e.terminated and e.truncated for e in eps)
    assert any(e.truncated and not e.terminated for e in eps)
    assert traj.states["obs.grid"].dtype == np.uint8
    assert traj.states["obs.inner.2.count"].dtype == np.int32


@pytest.mark.parametrize("mode", [NEXT, SAME, DISABLED])
def test_resets_mid_run_cut_episodes_as_truncated(address, mode):
    """reset() with a reset_mask, a full reset(), one at a chunk boundary (step 32 with
    chunk_steps=16), and (DISABLED) the caller's resets of finished environments."""
    n, steps = 4, 120
    actions = sample_actions(MixedEnv.action_space, steps, n, seed=2)
    rng = np.random.default_rng(7)
    interrupts = {k: rng.random(n) < 0.5 for k in (5, 17, 40, 41, 77)}
    for k, mask in interrupts.items():
        mask[k % n] = True  # reset() needs one env at least
    interrupts.update({32: None, 90: None})
    envs = vector("sync", make_mixed, n, mode)
    traj = recorded(
        address,
        f"mixed-resets-{mode.value}",
        envs,
        lambda e: drive(e, 9, actions, interrupts),
        chunk_steps=16,
    )
    expected = truth(make_mixed, 9, actions, mode, interrupts)
    eps = check(traj, expected, f"Dict env sync {mode.value}, resets mid-run")
    assert sum(e.cut for e in eps) >= 5


def test_async_without_shared_memory_keeps_autoreset_pending_across_reset(address):
    """Gymnasium 1.x's AsyncVectorEnv(shared_memory=False) does not clear a worker's pending
    next-step autoreset on reset(): the step after only resets again. The wrapper records
    what the env did: that row is no step of any episode."""
    n, steps = 4, 150
    actions = sample_actions(MixedEnv.action_space, steps, n, seed=3)
    # Reset envs whose next step is an autoreset step (and others) at a few steps.
    interrupts, hits = {}, 0
    for k in (20, 45, 70, 101):
        pending = {}
        truth(make_mixed, 13, actions, NEXT, interrupts, False, autoresets=pending)
        mask = np.array([k in pending.get(i, ()) for i in range(n)])
        hits += int(mask.sum())
        mask[k % n] = True
        interrupts[k] = mask
    envs = vector("async", make_mixed, n, NEXT, shared_memory=False)
    traj = recorded(
        address, "async-no-shm", envs, lambda e: drive(e, 13, actions, interrupts), chunk_steps=32
    )
    expected = truth(make_mixed, 13, actions, NEXT, interrupts, reset_cancels_autoreset=False)
    check(traj, expected, "Dict env async (no shared memory) NextStep, resets mid-run")
    assert hits >= 2


def test_record_episodes_single_env_exact(address):
    actions = sample_actions(MixedEnv.action_space, 200, 1, seed=4)
    with RolloutRecorder(target=address, session="single") as recorder:
        env = RecordEpisodes(make_mixed(), recorder, chunk_steps=32)
        env.reset(seed=11)
        for k, action in enumerate(actions[:, 0]):
            if k in (53, 125):
                env.reset()  # cuts the episode under way
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()
        env.close()
        traj = recorder.finish()
    expected = truth(make_mixed, 11, actions, DISABLED, {53: None, 125: None})
    eps = check(traj, expected, "RecordEpisodes")
    assert any(e.cut for e in eps)


def test_box_actions_of_two_dimensions_are_recorded_flattened(address):
    class Grid(MixedEnv):
        action_space = spaces.Box(-1, 1, (2, 3), np.float32)

        def step(self, action):
            return super().step(np.asarray(action).sum(axis=1))

    actions = sample_actions(Grid.action_space, 40, 1, seed=8)
    with RolloutRecorder(target=address, session="grid") as recorder:
        env = RecordEpisodes(gym.wrappers.TimeLimit(Grid(), MAX_STEPS), recorder)
        env.reset(seed=2)
        for action in actions[:, 0]:
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()
        env.close()
        traj = recorder.finish()
    assert traj.actions.shape[2:] == (6,)
    make = lambda: gym.wrappers.TimeLimit(Grid(), MAX_STEPS)  # noqa: E731
    check(traj, truth(make, 2, actions, DISABLED), "Box (2, 3) actions")


@pytest.mark.parametrize(
    "kwargs, sender",
    [
        ({}, "process"),
        ({"sender": "thread"}, "thread"),
        ({"max_episodes": 10}, "thread"),
        ({"on_error": print}, "thread"),
        ({"on_backpressure": "drop"}, "thread"),
    ],
)
def test_a_recorder_made_from_kwargs_streams_from_a_process_unless_told_otherwise(
    address, kwargs, sender
):
    session = "sender-" + "-".join(k.replace("_", "-") for k in kwargs)  # one config each
    envs = RecordRollouts(
        vector("sync", make_cartpole, 2, SAME), target=address, session=session, **kwargs
    )
    try:
        assert envs.recorder.sender == sender
    finally:
        envs.close()


def test_recorder_made_from_kwargs_is_closed_and_chunks_are_chunk_steps(address):
    """recorder=None: the wrapper makes RolloutRecorder(**kwargs) and closes it on close();
    every record() but the last carries chunk_steps steps. Another client reads it all."""
    n, steps = 3, 50
    actions = sample_actions(gym.spaces.Discrete(2), steps, n, seed=6)
    envs = RecordRollouts(
        vector("sync", make_cartpole, n, SAME),
        chunk_steps=16,
        target=address,
        session="owned",
        worker_id="w0",
    )
    drive(envs, 1, actions)
    recorder = envs.recorder
    assert recorder.sender == "process"  # the loop's thread keeps its speed
    envs.close()
    assert recorder._closed and envs.closed
    assert recorder.stats.chunks_acked == 4  # 16 + 16 + 16 + 2 steps
    with RolloutRecorder(target=address, session="owned") as reader:
        traj = reader.finish()
    check(traj, truth(make_cartpole, 1, actions, SAME), "recorder from kwargs")
    envs.close()  # twice: nothing more


def test_a_wrapper_recorder_without_a_target_warns_of_steps_its_close_loses(monkeypatch, caplog):
    """recorder=None and no target: a private server, which ends with close(). Steps no
    finish() has read are gone with it, and close() says so; with none, it says nothing.
    (A wrapper holds its last rows until close(): a finish() before it does not read them.)"""
    monkeypatch.delenv("ROLLOUT_RECORDER_TARGET", raising=False)
    n, steps = 2, 40
    actions = sample_actions(gym.spaces.Discrete(2), steps, n, seed=8)
    idle = RecordRollouts(vector("sync", make_cartpole, n, NEXT), chunk_steps=16)
    stepped = RecordRollouts(vector("sync", make_cartpole, n, NEXT), chunk_steps=16)
    assert stepped.recorder.target.startswith("unix:")  # the private server
    idle.reset(seed=3)
    drive(stepped, 3, actions)
    assert 0 < stepped.recorder.finish().lengths.sum() <= n * 32  # two chunks; 8 rows held
    caplog.set_level(logging.WARNING, logger="recorder_client")
    idle.close()
    assert caplog.records == []
    stepped.close()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "RecordRollouts.close(): the recorder it made had no target, and its private server "
        "ends with it, taking the steps recorded since the last finish()."
    )


def test_bad_use_is_refused_with_a_clear_error(address):
    envs = vector("sync", make_cartpole, 2, NEXT)
    with RolloutRecorder(target=address, session="bad") as recorder:
        wrapped = RecordRollouts(envs, recorder)
        with pytest.raises(RuntimeError, match=r"expected reset\(\) through the wrapper first"):
            wrapped.step(np.zeros(2, np.int64))
        with pytest.raises(TypeError, match=r"recorder_kwargs: expected none .* got \['session'\]"):
            RecordRollouts(envs, recorder, session="x")
        with pytest.raises(ValueError, match=r"chunk_steps: expected an integer >= 1, got 0"):
            RecordRollouts(envs, recorder, chunk_steps=0)
        envs.metadata = {**envs.metadata, "autoreset_mode": "sometimes"}
        with pytest.raises(ValueError, match=r"autoreset_mode'\]: expected one of .* 'sometimes'"):
            RecordRollouts(envs, recorder)
    envs.close()

    class Dotted(MixedEnv):
        observation_space = spaces.Dict({"a": spaces.Dict({"b.c": spaces.Discrete(3)})})

    with pytest.raises(ValueError, match=r"obs\.a: expected Dict keys .* got 'b\.c'"):
        RecordEpisodes(Dotted(), recorder)

    class Texty(MixedEnv):
        observation_space = spaces.Tuple((spaces.Discrete(2), spaces.Text(5)))

    with pytest.raises(TypeError, match=r"obs\.1: expected a space of kind Box, .* got Text"):
        RecordEpisodes(Texty(), recorder)

    class DictAction(MixedEnv):
        action_space = spaces.Dict({"a": spaces.Discrete(2)})

    with pytest.raises(TypeError, match=r"env\.action_space: expected Box, Discrete, .* got Dict"):
        RecordEpisodes(DictAction(), recorder)


@pytest.mark.parametrize(
    ("env_id", "mode", "kind"),
    [("FrozenLake-v1", NEXT, "sync"), ("Blackjack-v1", SAME, "async")],
)
def test_integer_and_tuple_observations_exact(address, env_id, mode, kind):
    """Gymnasium's toy-text envs: a Discrete observation (FrozenLake returns a Python int)
    and a Tuple of three Discrete ones (Blackjack), kept as int64."""
    make = lambda: gym.make(env_id)  # noqa: E731
    n, steps = 4, 200
    actions = sample_actions(make().action_space, steps, n, seed=5)
    envs = vector(kind, make, n, mode)
    traj = recorded(address, f"{env_id}-{mode.value}", envs, lambda e: drive(e, 2, actions))
    eps = check(traj, truth(make, 2, actions, mode), f"{env_id} {kind} {mode.value}")
    assert len(eps) > 40
    names = ["obs"] if env_id == "FrozenLake-v1" else ["obs.0", "obs.1", "obs.2"]
    assert sorted(traj.states) == names
    assert all(traj.states[name].dtype == np.int64 for name in names)


def test_same_step_final_obs_from_per_env_info_dicts(address):
    """Under DictInfoToList the infos are one dict per environment: a done environment's
    final observation is in its own dict."""
    n, steps = 4, 150
    actions = sample_actions(MixedEnv.action_space, steps, n, seed=6)
    envs = gym.wrappers.vector.DictInfoToList(vector("sync", make_mixed, n, SAME))
    traj = recorded(address, "list-infos", envs, lambda e: drive(e, 3, actions), chunk_steps=16)
    eps = check(traj, truth(make_mixed, 3, actions, SAME), "Dict env sync SameStep, list infos")
    assert sum(e.final is not None for e in eps) > 50


def test_an_observation_that_does_not_fit_its_space_is_refused_naming_the_leaf(address):
    """A single env's observation is checked against its space (a vector env's batching
    does that for RecordRollouts): no silent broadcast, no bare KeyError."""

    class Misfit(MixedEnv):
        def __init__(self, change):
            self.change = change

        def _obs(self):  # the reset observation fits; the first step's does not
            obs = super()._obs()
            return self.change(obs) if self.count else obs

    cases = [
        (
            lambda o: {**o, "pos": np.zeros(3, np.float32)},
            r"obs\.pos: expected shape \(2,\) castable to float32 \(same_kind; "
            r"env\.observation_space\), got shape \(3,\) float32",
        ),
        (
            lambda o: {**o, "pos": np.float32(1)},
            r"obs\.pos: expected shape \(2,\) .* got shape \(\)",
        ),
        (
            lambda o: {k: v for k, v in o.items() if k != "mode"},
            r"obs\.mode: expected shape \(2,\) castable to int64 .* got an observation without it",
        ),
        (
            lambda o: {**o, "inner": (*o["inner"][:2], {"count": "many"})},
            r"obs\.inner\.2\.count: expected shape \(\) castable to int32 .* got shape \(\) <U4",
        ),
        (  # numpy would wrap 300 round to 44 in a uint8 buffer; a vector env refuses it
            lambda o: {**o, "grid": np.full((3, 3), 300, np.int64)},
            r"obs\.grid: expected shape \(3, 3\) castable to uint8 .* got shape \(3, 3\) int64",
        ),
    ]
    with RolloutRecorder(target=address, session="misfit") as recorder:
        for change, message in cases:
            env = RecordEpisodes(Misfit(change), recorder)
            env.reset(seed=0)
            with pytest.raises(ValueError, match=message):
                env.step(np.zeros(2, np.float32))
            env.close()  # nothing recorded: the next wrapper may take the recorder


def test_a_batched_observation_of_another_shape_is_refused_naming_the_space(address):
    """A vector env (here a wrapper that cuts each observation short) whose batch does
    not fit the single observation space: a ValueError naming it, not a broadcast."""

    class Cut(gym.vector.VectorWrapper):
        def step(self, actions):
            obs, reward, terminated, truncated, info = self.env.step(actions)
            return obs[:, :2], reward, terminated, truncated, info

    with RolloutRecorder(target=address, session="batched-misfit") as recorder:
        envs = RecordRollouts(Cut(gym.make_vec("CartPole-v1", num_envs=3)), recorder)
        envs.reset(seed=0)
        with pytest.raises(
            ValueError,
            match=r"obs: expected shape \(3, 4\) castable to float32 \(same_kind; "
            r"envs\.single_observation_space\), got shape \(3, 2\) float32",
        ):
            envs.step(np.zeros(3, np.int64))
        envs.close()


def test_a_same_step_final_observation_that_does_not_fit_is_refused(address):
    """Under same-step autoreset the final observation reaches the wrapper unbatched (the
    vector env only batches the reset one): it is checked against the space too."""

    class BadFinal(MixedEnv):
        bad = {"pos": np.zeros(3, np.float32)}

        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            if terminated:
                obs = {**obs, **self.bad}
            return obs, reward, terminated, truncated, info

    class WrappingFinal(BadFinal):
        bad = {"grid": np.full((3, 3), 256, np.int64)}  # 0 once wrapped round into uint8

    cases = [
        (
            BadFinal,
            r"infos\['final_obs'\]\[\d\]: obs\.pos: expected shape \(2,\) castable to "
            r"float32 \(same_kind; envs\.single_observation_space\), got shape \(3,\) float32",
        ),
        (
            WrappingFinal,
            r"infos\['final_obs'\]\[\d\]: obs\.grid: expected shape \(3, 3\) castable to "
            r"uint8 .* got shape \(3, 3\) int64",
        ),
    ]
    for i, (env_class, message) in enumerate(cases):
        make = lambda env_class=env_class: gym.wrappers.TimeLimit(env_class(), MAX_STEPS)  # noqa: E731
        with RolloutRecorder(target=address, session=f"bad-final-{i}") as recorder:
            envs = RecordRollouts(vector("sync", make, 2, SAME), recorder)
            envs.reset(seed=0)
            with pytest.raises(ValueError, match=message):
                for _ in range(200):
                    envs.step(np.zeros((2, 2), np.float32))
            envs.env.close()


class EndsEvery(gym.Env):
    """Observes its step count; every episode terminates after `length` steps. Takes any
    action of `action_space`."""

    observation_space = spaces.Box(0, 100, (1,), np.float32)

    def __init__(self, length: int, action_space: spaces.Space | None = None) -> None:
        self.length = length
        self.action_space = action_space or spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(1, self.t, np.float32), 1.0, self.t == self.length, False, {}


def test_one_wrapper_at_a_time_and_none_continues_what_another_left_open(address):
    """Wrappers number their envs from 0: two on one recorder at once, or a new one after a
    closed one left episodes under way, would join episodes of different envs."""
    make = lambda: EndsEvery(4)  # noqa: E731
    with RolloutRecorder(target=address, session="one-producer") as recorder:
        first = RecordRollouts(SyncVectorEnv([make] * 2), recorder, chunk_steps=3)
        busy = r"expected a recorder that no other wrapper or callback records into .* got one "
        with pytest.raises(ValueError, match=r"^RecordRollouts: recorder: " + busy):
            RecordRollouts(SyncVectorEnv([make] * 2), recorder)
        with pytest.raises(ValueError, match=r"^RecordEpisodes: recorder: " + busy):
            RecordEpisodes(make(), recorder)
        first.reset(seed=0)
        for _ in range(4):  # every episode ends on the last step: none left open
            first.step(np.zeros(2, np.int64))
        first.close()
        with pytest.raises(RuntimeError, match=r"^RecordRollouts.step: expected an open wrapper"):
            first.step(np.zeros(2, np.int64))

        second = RecordRollouts(SyncVectorEnv([make] * 2), recorder, chunk_steps=3)
        second.reset(seed=1)
        for _ in range(6):  # 4 steps, the next-step autoreset row, 1 step under way
            second.step(np.ones(2, np.int64))
        second.close()
        with pytest.raises(
            RecorderError,
            match=r"^RecordEpisodes: recorder: expected no episodes left open by the "
            r"RecordRollouts that recorded into it before .* got envs \[0, 1\]",
        ):
            RecordEpisodes(make(), recorder)
        traj = recorder.finish()
    # The truth from the env's rule: 4-step episodes, next-step autoreset rows left out.
    assert sorted(traj.lengths.tolist()) == [1, 1, 4, 4, 4, 4]
    assert int(traj.episode_done.sum()) == 4
    for b in np.flatnonzero(traj.episode_done):
        assert traj.states["obs"][b, :4, 0].tolist() == [0, 1, 2, 3]
        assert traj.final_states["obs"][b].tolist() == [4]


def test_an_observation_key_too_long_for_a_field_name_is_refused_at_once(address):
    key = "k" * 130  # obs.<key> is over the recorder's 128 characters

    class LongKey(gym.Env):
        observation_space = spaces.Dict({key: spaces.Discrete(3)})
        action_space = spaces.Discrete(2)

    with RolloutRecorder(target=address, session="long-key") as recorder:
        with pytest.raises(
            ValueError, match=r"^env\.observation_space: expected observation fields .* at most 128"
        ):
            RecordEpisodes(LongKey(), recorder)
        with pytest.raises(ValueError, match=r"^envs\.single_observation_space: expected"):
            RecordRollouts(SyncVectorEnv([LongKey] * 2), recorder)
