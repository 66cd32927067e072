"""`rollout-recorder export`: a live session's episodes, written as Parquet (read back equal to
finish()) and as a Minari dataset (loaded back step for step), through the real CLI."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import export
from test_remote_basic import make_chunk

from recorder_client import RolloutRecorder, Trajectory, fetch_episodes
from recorder_client.dataset import (
    columns_file,
    episode_files,
    file_schema,
    filesystem,
    read_episodes,
)
from recorder_server.dataset.export import write_minari, write_parquet

minari = pytest.importorskip("minari")
spaces = pytest.importorskip("gymnasium.spaces")


def record(target: str, session: str, workers: int, *, P: int | None, seed: int) -> Trajectory:
    """Chunks from several workers, each ending every environment's episode at its last
    step (so that every worker has finished episodes); returns finish(pad_incomplete=False)."""
    rng = np.random.default_rng(seed)
    recorders = [
        RolloutRecorder(record_states=True, target=target, session=session, worker_id=f"w{i}")
        for i in range(workers)
    ]
    try:
        for i in range(3):
            for rec in recorders:
                traj, states = make_chunk(rng, T=8, N=3, P=P, done_p=0.2)
                if i == 2:
                    traj.done[-1] = True
                rec.record(traj, states)
        for rec in recorders:
            rec.flush()
        return recorders[0].finish(pad_incomplete=False)
    finally:
        for rec in recorders:
            rec.close()


def assert_identical(a: Trajectory, b: Trajectory) -> None:
    """Every array bit for bit (dtype and shape too), and the worker ids."""
    named = {**a.fields, **{k: getattr(a, k) for k in _META}}
    for name, x in named.items():
        y = b.fields[name] if name in b.fields else getattr(b, name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.tobytes() == y.tobytes(), name
    assert a.fields.keys() == b.fields.keys()
    assert a.worker_ids == b.worker_ids


_META = ("lengths", "episode_worker", "episode_env", "episode_start", "episode_done")


def test_parquet_export_reads_back_as_finish(target, tmp_path):
    out = record(target, "pq", 3, P=3, seed=1)
    assert out.num_episodes > 3 and len(set(out.episode_worker.tolist())) == 3
    done = export(target, "pq", tmp_path / "ds")
    assert done.returncode == 0, done.stderr
    assert f"exported {out.num_episodes} episodes" in done.stdout
    assert f"{out.num_episodes}/{out.num_episodes} episodes" in done.stderr  # progress
    assert_identical(out, read_episodes(str(tmp_path / "ds"), "pq"))

    # Exporting over it again would duplicate episodes: refused, nothing written.
    again = export(target, "pq", tmp_path / "ds")
    assert again.returncode == 2 and "already has episode files" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1

    # Small files: the same episodes, several whole files, progress after each.
    seen: list[tuple[int, int]] = []
    summary = write_parquet(
        fetch_episodes(target, "pq"),
        str(tmp_path / "small"),
        session="pq",
        file_bytes=4 << 10,
        progress=lambda e, b: seen.append((e, b)),
    )
    assert summary["files"] > 1 and len(seen) == summary["files"]
    assert seen[-1] == (out.num_episodes, summary["bytes"])
    assert_identical(out, read_episodes(str(tmp_path / "small"), "pq"))
    # The export lists its files' columns as the sink does (readers need no footers).
    fs, root = filesystem(str(tmp_path / "small"))
    footers = [file_schema(fs, p) for p in episode_files(fs, root)]
    assert columns_file(fs, root, "pq", "export") == footers[0] == footers[-1]


def test_minari_export_loads_back_step_for_step(target, tmp_path, monkeypatch):
    out = record(target, "mn", 2, P=None, seed=2)
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    done = export(target, "mn", root, "--format", "minari")
    assert done.returncode == 0, done.stderr

    dataset = minari.load_dataset("rollout-recorder/mn-v0")
    assert dataset.total_episodes == out.num_episodes
    assert dataset.action_space == spaces.Discrete(int(out.actions[out.mask()].max()) + 1)
    assert dataset.observation_space == spaces.Dict(
        {
            "positions": spaces.Box(-(2**31), 2**31 - 1, (1, 2), dtype=np.int32),
            "player_inventory": spaces.Box(-(2**15), 2**15 - 1, (1, 4), dtype=np.int16),
        }
    )
    for b, episode in enumerate(dataset.iterate_episodes()):
        n = int(out.lengths[b])
        assert np.array_equal(episode.actions, out.actions[b, :n])
        assert episode.rewards.dtype == np.float32
        assert episode.rewards.tobytes() == out.rewards[b, :n].tobytes()
        for name in ("positions", "player_inventory"):
            observed = episode.observations[name]
            assert observed.shape[0] == n + 1 and observed.dtype == out.states[name].dtype
            assert np.array_equal(observed[:n], out.states[name][b, :n])
            assert np.array_equal(observed[n], observed[n - 1])  # the last state, repeated
        want = np.zeros(n, dtype=bool)
        want[-1] = True
        assert np.array_equal(episode.terminations, want)
        assert not episode.truncations.any()

    over = export(
        target,
        "mn",
        root,
        "--format",
        "minari",
        "--dataset-id",
        "rollout-recorder/mn-box-v0",
        "--action-space",
        "box:0:20",
        "--observation-space",
        "positions=box:0:63",
    )
    assert over.returncode == 0, over.stderr
    boxed = minari.load_dataset("rollout-recorder/mn-box-v0")
    assert boxed.action_space == spaces.Box(0, 20, (), dtype=np.int32)
    assert boxed.observation_space["positions"] == spaces.Box(0, 63, (1, 2), dtype=np.int32)
    first = next(boxed.iterate_episodes())
    assert np.array_equal(first.actions, out.actions[0, : out.lengths[0]])


def test_minari_without_states_observes_the_step_index(target, tmp_path, monkeypatch):
    """P-dimensional actions, no state field: a Box action space; observations 0..T."""
    out = record(target, "plain", 2, P=2, seed=3)
    bare = Trajectory(
        out.actions,
        out.rewards,
        {},
        worker_ids=out.worker_ids,
        **{k: getattr(out, k) for k in _META},
    )
    write_minari(bare, tmp_path / "m", "plain-v0")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "m"))
    dataset = minari.load_dataset("plain-v0")
    assert dataset.action_space == spaces.Box(-(2**31), 2**31 - 1, (2,), dtype=np.int32)
    for b, episode in enumerate(dataset.iterate_episodes()):
        n = int(out.lengths[b])
        assert np.array_equal(episode.observations, np.arange(n + 1))
        assert np.array_equal(episode.actions, out.actions[b, :n])


def test_export_errors_exit_2_with_one_line(target, tmp_path):
    unknown = export(target, "no-such-session", tmp_path / "x")
    assert unknown.returncode == 2
    assert "no-such-session" in unknown.stderr and "Traceback" not in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1

    for spec in ("discrete:0", "boxy", "box:1:0"):
        bad = export(target, "s", tmp_path / "x", "--format", "minari", "--action-space", spec)
        assert bad.returncode == 2 and spec in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1

    # A session with no finished episode has nothing to export.
    with RolloutRecorder(target=target, session="open", worker_id="w0") as rec:
        rec.record(
            {"action": np.zeros((3, 2)), "reward": np.zeros((3, 2)), "done": np.zeros((3, 2))}
        )
        rec.flush()
        empty = export(target, "open", tmp_path / "x")
    assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1

    # A value the given space does not hold is refused before anything is written.
    record(target, "small", 2, P=None, seed=4)
    refused = export(
        target, "small", tmp_path / "m", "--format", "minari", "--action-space", "discrete:1"
    )
    assert refused.returncode == 2 and "does not hold" in refused.stderr
    assert not (tmp_path / "m" / "rollout-recorder" / "small-v0").exists()


def test_minari_export_takes_the_envs_own_box_action_of_two_dimensions(
    target, tmp_path, monkeypatch
):
    """RecordRollouts records a (2, 2) Box action flattened to (4,); the export given the
    env's own action space writes the actions back in its shape."""
    gym = pytest.importorskip("gymnasium")
    from test_gymnasium import EndsEvery

    from recorder_client.gymnasium import RecordRollouts

    square = spaces.Box(-1, 1, (2, 2), np.float32)
    make = lambda: EndsEvery(3, square)  # noqa: E731

    rng = np.random.default_rng(4)
    actions = rng.uniform(-1, 1, (8, 2, 2, 2)).astype(np.float32)  # steps, envs, (2, 2)
    with RolloutRecorder(target=target, session="square") as recorder:
        envs = RecordRollouts(gym.vector.SyncVectorEnv([make] * 2), recorder, chunk_steps=5)
        envs.reset(seed=0)
        for a in actions:
            envs.step(a)
        envs.close()
        out = recorder.finish(pad_incomplete=False)
    assert out.actions.shape[2:] == (4,)
    write_minari(out, tmp_path / "m", "square-v0", action_space=square)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "m"))
    dataset = minari.load_dataset("square-v0")
    assert dataset.action_space == square
    # Next-step autoreset: steps 0-2 and 4-6 of each env are its two episodes.
    want = [actions[s : s + 3, e] for e in range(2) for s in (0, 4)]
    got = [episode.actions for episode in dataset.iterate_episodes()]
    order = np.lexsort((out.episode_start, out.episode_env))  # env, then start
    assert len(got) == 4
    for i, b in enumerate(order):
        assert got[b].shape == (3, 2, 2) and got[b].tobytes() == want[i].tobytes()
