"""A Gymnasium loop recorded into a server with a dataset sink: finish(), read_episodes,
DuckDB and a Minari export (loaded with minari.load_dataset) all give back what the envs
returned, step for step: observations (nested Dict / Tuple ones too), actions, rewards,
terminated, truncated and each episode's final observation.

The truth comes from the envs' own returns under Gymnasium's documented next-step autoreset:
the step after an episode ends resets that env (its action is ignored, reward 0, no flag)
and belongs to no episode. The loop records it as is, marked valid=False.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import export
from test_dataset import sink_options, wait_written

from recorder_client import RolloutRecorder
from recorder_client.dataset import read_episodes
from recorder_server import start_server

gym = pytest.importorskip("gymnasium")
minari = pytest.importorskip("minari")
duckdb = pytest.importorskip("duckdb")
from gymnasium import spaces  # noqa: E402

from recorder_server.dataset.export import write_minari  # noqa: E402

T = 16  # steps per record() call


class Rooms(gym.Env):
    """A Dict observation nested two levels, with a Tuple: every leaf dtype Gymnasium's
    spaces give (float32 Box, int64 Discrete, int8 MultiBinary, int16 Box)."""

    observation_space = spaces.Dict(
        {
            "pos": spaces.Box(-10, 10, (2,), np.float32),
            "inner": spaces.Dict({"count": spaces.Discrete(50), "flags": spaces.MultiBinary(3)}),
            "pair": spaces.Tuple((spaces.Box(-100, 100, (2,), np.int16), spaces.Discrete(3))),
        }
    )
    action_space = spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        reward = float(self.np_random.standard_normal()) + int(action)
        return self._obs(), reward, bool(self.np_random.random() < 0.12), False, {}

    def _obs(self) -> dict:
        rng = self.np_random
        return {
            "pos": rng.uniform(-10, 10, 2).astype(np.float32),
            "inner": {"count": self.t, "flags": rng.integers(0, 2, 3).astype(np.int8)},
            "pair": (rng.integers(-100, 100, 2).astype(np.int16), int(rng.integers(0, 3))),
        }


def flat(obs: Any, prefix: str = "obs") -> dict[str, Any]:
    """The contract's names of a nested observation: obs, obs.<key>, obs.<i>."""
    if isinstance(obs, dict):
        return {k: v for key, sub in obs.items() for k, v in flat(sub, f"{prefix}.{key}").items()}
    if isinstance(obs, tuple):
        return {k: v for i, sub in enumerate(obs) for k, v in flat(sub, f"{prefix}.{i}").items()}
    return {prefix: obs}


def stacked(rows: list[Any]) -> Any:
    """Per-step nested observations of (N, ...) arrays as one nested (T, N, ...) structure."""
    if isinstance(rows[0], dict):
        return {k: stacked([r[k] for r in rows]) for k in rows[0]}
    if isinstance(rows[0], tuple):
        return tuple(stacked([r[i] for r in rows]) for i in range(len(rows[0])))
    return np.stack(rows)


@dataclass
class Episode:
    env: int
    obs: dict[str, list] = field(default_factory=dict)  # flat name -> per-step values
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    final: dict[str, Any] = field(default_factory=dict)


def run(envs: Any, rec: RolloutRecorder | None, chunks: int, seed: int, *, pair: bool = True):
    """Step ``envs`` chunks * T times with random actions, recording each T steps (with
    done only when not ``pair``); returns the finished episodes, env by env in time order."""
    n = envs.num_envs
    envs.action_space.seed(seed)
    obs, _ = envs.reset(seed=seed)
    after_done = np.zeros(n, dtype=bool)
    open_ = [Episode(i) for i in range(n)]
    finished: list[Episode] = []
    for _ in range(chunks):
        rows: dict[str, list] = {k: [] for k in ("obs", "final_obs", "action", "reward")}
        rows |= {k: [] for k in ("terminated", "truncated", "valid")}
        for _ in range(T):
            action = envs.action_space.sample()
            nxt, reward, term, trunc, _info = envs.step(action)
            done = term | trunc
            for i in range(n):
                if after_done[i]:  # the autoreset step: no episode's
                    assert reward[i] == 0 and not done[i]
                    continue
                ep = open_[i]
                for name, value in flat(obs).items():
                    ep.obs.setdefault(name, []).append(np.array(value[i]))
                ep.actions.append(action[i])
                ep.rewards.append(reward[i])
                if done[i]:
                    ep.terminated, ep.truncated = bool(term[i]), bool(trunc[i])
                    ep.final = {k: np.array(v[i]) for k, v in flat(nxt).items()}
                    finished.append(ep)
                    open_[i] = Episode(i)
            rows["obs"].append(obs)
            rows["final_obs"].append(nxt)  # read on done rows only
            rows["action"].append(action)
            rows["reward"].append(reward)
            rows["terminated"].append(term)
            rows["truncated"].append(trunc)
            rows["valid"].append(~after_done)
            after_done = done
            obs = nxt
        if rec is not None:
            chunk = {k: stacked(v) for k, v in rows.items()}
            if not pair:
                chunk["done"] = chunk.pop("terminated") | chunk.pop("truncated")
                del chunk["final_obs"]
            rec.record(chunk)
    finished.sort(key=lambda e: e.env)  # stable: time order within an env
    return finished


def mismatches(traj: Any, truth: list[Episode], *, finals: bool = True) -> int:
    """Steps and per-episode values where the Trajectory differs from the envs' returns."""
    bad = 0
    assert traj.num_episodes == len(truth)
    for b, ep in enumerate(truth):
        n = len(ep.actions)
        bad += int(traj.lengths[b]) != n
        bad += int(traj.episode_env[b]) != ep.env
        for name, values in ep.obs.items():
            got = traj.states[name][b, :n]
            want = np.stack(values)
            bad += got.dtype != want.dtype
            bad += int((got != want).reshape(n, -1).any(axis=1).sum())
        bad += int((traj.actions[b, :n] != np.asarray(ep.actions)).sum())
        rewards = np.asarray(ep.rewards, dtype=np.float32)
        bad += int((traj.rewards[b, :n] != rewards).sum())
        bad += bool(traj.episode_terminated[b]) != (ep.terminated if finals else True)
        bad += bool(traj.episode_truncated[b]) != (ep.truncated if finals else False)
        if finals:
            for name, value in ep.final.items():
                final = traj.final_states[name][b]
                bad += final.dtype != value.dtype or not np.array_equal(final, value)
    return bad


def minari_mismatches(dataset: Any, truth: list[Episode], space: Any) -> int:
    """The same, against a Minari dataset: N+1 observations, the last the final one."""
    bad = 0
    assert dataset.total_episodes == len(truth)
    for ep, data in zip(truth, dataset.iterate_episodes()):
        n = len(ep.actions)
        observed = flat(data.observations)
        assert set(observed) == set(ep.obs)
        for name, values in ep.obs.items():
            want = np.concatenate([np.stack(values), ep.final[name][None]])
            got = observed[name]
            bad += got.shape != want.shape or not np.array_equal(got, want)
        bad += not np.array_equal(data.actions, np.asarray(ep.actions))
        bad += not np.array_equal(data.rewards, np.asarray(ep.rewards, dtype=np.float32))
        flags = np.zeros(n, dtype=bool)
        flags[-1] = ep.terminated
        bad += not np.array_equal(data.terminations, flags)
        flags[-1] = ep.truncated
        bad += not np.array_equal(data.truncations, flags)
    bad += dataset.observation_space != space
    return bad


def test_gymnasium_loops_read_back_exact_from_finish_dataset_duckdb_and_minari(
    tmp_path: Path, monkeypatch
):
    uri = str(tmp_path / "dataset")
    server = start_server(sink_options(tmp_path, uri, flush=0.2))
    cases = {
        "cartpole": (
            lambda: gym.make("CartPole-v1", max_episode_steps=12),
            4,
            12,
        ),  # ~22 steps when free: both flags occur
        "rooms": (lambda: gym.wrappers.TimeLimit(Rooms(), max_episode_steps=9), 3, 10),
    }
    try:
        results = {}
        for session, (make, n, chunks) in cases.items():
            envs = gym.vector.SyncVectorEnv([make for _ in range(n)])
            rec = RolloutRecorder(target=server.address, session=session, worker_id="w0")
            truth = run(envs, rec, chunks, seed=11)
            rec.flush()
            finished = rec.finish(pad_incomplete=False)
            rec.close()
            wait_written(uri, session, len(truth))
            from_dataset = read_episodes(uri, session)
            assert any(e.terminated for e in truth) and any(e.truncated for e in truth), session
            results[session] = (envs, truth, finished, from_dataset)
            for source, traj in (("finish", finished), ("read_episodes", from_dataset)):
                assert mismatches(traj, truth) == 0, (session, source)
            print(
                f"{session}: {len(truth)} episodes ({sum(e.terminated for e in truth)} "
                f"terminated, {sum(e.truncated for e in truth)} truncated, "
                f"{sum(len(e.actions) for e in truth)} steps): finish and read_episodes "
                "0 mismatches"
            )

        # DuckDB over the files: the flags on last steps only, a final observation per
        # episode, the rewards' sum.
        truth = results["rooms"][1]
        row = duckdb.sql(
            f"""SELECT count(*) FILTER (WHERE terminated), count(*) FILTER (WHERE truncated),
                       count(*) FILTER ((terminated OR truncated) AND step + 1 <> length),
                       count("final.obs.pos"), count(DISTINCT episode_id), sum(reward)
                FROM (SELECT *, count(*) OVER (PARTITION BY episode_id) AS length
                      FROM read_parquet('{uri}/session=rooms/*.parquet'))"""
        ).fetchall()[0]
        rewards = sum(float(np.sum(np.asarray(e.rewards, np.float32))) for e in truth)
        assert row[:5] == (
            sum(e.terminated for e in truth),
            sum(e.truncated for e in truth),
            0,
            len(truth),
            len(truth),
        )
        assert row[5] == pytest.approx(rewards, rel=1e-5)

        # Minari: exported from the dataset, loaded by minari itself.
        monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
        for session, (envs, truth, _, from_dataset) in results.items():
            given = envs.single_observation_space if session == "rooms" else None
            dataset_id = f"rollout-recorder/{session}-v0"
            write_minari(from_dataset, tmp_path / "minari", dataset_id, observation_space=given)
            loaded = minari.load_dataset(dataset_id)
            space = given or spaces.Box(-np.inf, np.inf, (4,), np.float32)
            assert minari_mismatches(loaded, truth, space) == 0, session
            print(f"{session}: Minari {loaded.total_episodes} episodes, 0 mismatches")

        # The export command, from the live session: the observation's spaces derived (one
        # given by its flattened name), nested as the env's.
        done = export(
            server.address,
            "rooms",
            tmp_path / "minari",
            "--format",
            "minari",
            "--dataset-id",
            "rollout-recorder/rooms-cli-v0",
            "--observation-space",
            "obs.pos=box:-10:10",
        )
        assert done.returncode == 0, done.stderr
        loaded = minari.load_dataset("rollout-recorder/rooms-cli-v0")

        def whole(dtype: Any, shape: tuple = ()) -> Any:
            info = np.iinfo(dtype)
            return spaces.Box(int(info.min), int(info.max), shape, dtype)

        space = spaces.Dict(
            {
                "pos": spaces.Box(-10, 10, (2,), np.float32),
                "inner": spaces.Dict({"count": whole(np.int64), "flags": whole(np.int8, (3,))}),
                "pair": spaces.Tuple((whole(np.int16, (2,)), whole(np.int64))),
            }
        )
        assert minari_mismatches(loaded, results["rooms"][1], space) == 0
        print(f"rooms: export --format minari {loaded.total_episodes} episodes, 0 mismatches")
    finally:
        server.stop(grace=0)


def test_a_done_only_loop_reads_as_terminated_without_finals(tmp_path: Path):
    """Recorded with `done` and no final_obs: every episode terminated, none truncated, no
    final.* column; the valid mask still keeps the autoreset steps out."""
    uri = str(tmp_path / "dataset")
    server = start_server(sink_options(tmp_path, uri, flush=0.2))
    try:
        envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make("CartPole-v1", max_episode_steps=12) for _ in range(3)]
        )
        rec = RolloutRecorder(target=server.address, session="plain", worker_id="w0")
        truth = run(envs, rec, 6, seed=5, pair=False)
        rec.flush()
        rec.close()
        wait_written(uri, "plain", len(truth))
        traj = read_episodes(uri, "plain")
        assert traj.final_states == {}
        assert mismatches(traj, truth, finals=False) == 0
        columns = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{uri}/**/*.parquet')")
        names = [r[0] for r in columns.fetchall()]
        assert "terminated" in names and not any(n.startswith("final.") for n in names)
        print(f"done only: {len(truth)} episodes, 0 mismatches")
    finally:
        server.stop(grace=0)
