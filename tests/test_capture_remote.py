"""The trajectory store behind the recorder server, reached through recorder.capture."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from recorder_client import (
    CellField,
    EpisodeOutcome,
    InvalidChunkError,
    InvalidQueryError,
    RolloutRecorder,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.store import EpisodeArrays, TrajectoryStore
from recorder_server.workload import SyntheticVecEnv

CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0, 0), bucket=8, name="x"),
        CellField("player_positions", (0, 1), bucket=8, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.9),),
)
FIELDS = ["player_positions", "player_inventory"]
WORKERS, CHUNKS, T, N = 4, 5, 64, 6


def worker_chunks(seed: int):
    """The chunks worker `seed` records: synthetic env plus outcome codes at done steps."""
    env = SyntheticVecEnv(N, seed=seed, done_prob=0.04)
    rng = np.random.default_rng(1000 + seed)
    for _ in range(CHUNKS):
        rollout, states = env.collect(T)
        codes = np.where(rollout.done, rng.integers(1, 4, rollout.done.shape), 0).astype(np.int8)
        yield rollout, states, codes


WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_capture_remote import CONFIG, FIELDS, worker_chunks
    from recorder_client import RolloutRecorder
    target, seed = sys.argv[1], int(sys.argv[2])
    with RolloutRecorder(record_states=True, state_fields=FIELDS, target=target,
                         session="store", worker_id=f"w{{seed}}", capture=CONFIG) as rec:
        for rollout, states, codes in worker_chunks(seed):
            rec.record(rollout, states, outcome=codes)
    """
)


def direct_store() -> TrajectoryStore:
    """The same finished episodes, split locally and fed to a local store."""
    store = TrajectoryStore(CONFIG)
    for seed in range(WORKERS):
        chunks = list(worker_chunks(seed))
        done = np.concatenate([c[0].done for c in chunks])
        actions = np.concatenate([c[0].action for c in chunks])
        rewards = np.concatenate([c[0].reward for c in chunks])
        pos = np.concatenate([c[1].player_positions for c in chunks])
        inv = np.concatenate([c[1].player_inventory for c in chunks])
        codes = np.concatenate([c[2] for c in chunks])
        for e in range(N):
            start = 0
            for t in np.flatnonzero(done[:, e]):
                sl = slice(start, t + 1)
                marked = np.flatnonzero(codes[sl, e])
                outcome = int(codes[sl, e][marked[-1]]) if marked.size else 0
                store.record_episode(
                    EpisodeArrays(
                        actions[sl, e],
                        rewards[sl, e],
                        {"player_positions": pos[sl, e], "player_inventory": inv[sl, e]},
                    ),
                    step=0,
                    outcome=EpisodeOutcome(outcome),
                )
                start = t + 1
    return store


def test_four_workers_remote_snapshot_equals_direct_computation(server_process):
    tests = str(__import__("pathlib").Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER.format(tests=tests), server_process.address, str(seed)]
        )
        for seed in range(WORKERS)
    ]
    assert [p.wait(120) for p in procs] == [0] * WORKERS
    with RolloutRecorder(
        record_states=True,
        state_fields=FIELDS,
        target=server_process.address,
        session="store",
        capture=CONFIG,
    ) as viewer:
        remote = viewer.capture.snapshot_potential("win_proximity", ["x", "y"])
        remote_x = viewer.capture.snapshot_potential("win_proximity", ["x"])
        start = viewer.capture.sample_start()
    store = direct_store()
    direct = store.snapshot_potential("win_proximity", ["x", "y"])
    assert direct and remote.keys() == direct.keys()
    for key, value in direct.items():
        assert remote[key] == pytest.approx(value, rel=1e-9, abs=1e-12)
    direct_x = store.snapshot_potential("win_proximity", ["x"])
    assert remote_x.keys() == direct_x.keys()
    assert all(remote_x[k] == pytest.approx(v, rel=1e-9, abs=1e-12) for k, v in direct_x.items())
    assert start is not None
    reference, prefix = start
    assert isinstance(reference, TrajectorySliceReference)
    assert prefix.length == reference.step + 1
    assert prefix.states["player_positions"].shape == (prefix.length, 1, 2)


def test_submitted_episodes_and_checkpoint_seed_a_fresh_server(server, tmp_path):
    from recorder_server import ServerOptions, start_server

    rng = np.random.default_rng(3)
    with RolloutRecorder(target=server.address, session="emu", capture=CONFIG) as rec:
        for i in range(12):
            L = int(rng.integers(5, 40))
            pos = rng.integers(0, 64, (L, 1, 2)).astype(np.int32)
            count = rec.capture.record_episode(
                rng.integers(0, 12, L),
                rng.random(L).astype(np.float32),
                {"player_positions": pos},
                outcome=[EpisodeOutcome.WIN, EpisodeOutcome.LOSS, "DRAW"][i % 3],
                step=i,
            )
            assert count == i + 1
        ref, prefix = rec.capture.sample_start()
        rec.capture.record_episode(
            prefix.actions, prefix.rewards, prefix.states, outcome="WIN", start_reference=ref
        )
        before = rec.capture.snapshot_potential("win_proximity", ["x", "y"])
        file = rec.capture.trajectory_store_checkpoint_file(compress=True, checkpoint_step=7)
    assert file is not None and file.size == len(file.data) and "step000000000007" in file.name
    path = tmp_path / file.name
    path.write_bytes(file.data)

    fresh = start_server(ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "fresh")))
    try:
        with RolloutRecorder(target=fresh.address, session="seeded", capture=CONFIG) as rec:
            assert rec.capture.snapshot_potential("win_proximity", ["x", "y"]) == {}
            rec.capture.load_trajectory_store_checkpoint_data(path)
            assert rec.capture.snapshot_potential("win_proximity", ["x", "y"]) == before
            with pytest.raises(InvalidChunkError, match="sha256"):
                rec.capture.load_trajectory_store_checkpoint_data(file.data[:-5] + bytes(5))
            assert rec.capture.snapshot_potential("win_proximity", ["x", "y"]) == before
    finally:
        fresh.stop(0)


def test_store_off_behaves_as_the_seed_says_and_ingest_works(target):
    with RolloutRecorder(target=target, session="off") as rec:
        done = np.zeros((6, 2), bool)
        done[2, 0] = done[5, 1] = True
        rec.record({"action": np.ones((6, 2), np.int32), "reward": np.ones((6, 2)), "done": done})
        assert rec.capture.snapshot_potential("win_proximity", ["x"]) == {}
        assert rec.capture.sample_start() is None
        assert rec.capture.trajectory_store_checkpoint_file(compress=True) is None
        # Episodes are still counted by the processor with no store.
        assert rec.capture.record_episode([1, 2], [0.0, 1.0], outcome="WIN") == 3
        assert rec.finish().num_episodes == 3


def test_bad_store_requests_name_the_problem(target):
    with RolloutRecorder(target=target, session="badstore", capture=CONFIG) as rec:
        with pytest.raises(InvalidQueryError, match="nope"):
            rec.capture.snapshot_potential("nope", ["x"])
        with pytest.raises(InvalidChunkError, match="leading length"):
            rec.capture.record_episode([1, 2, 3], [0.0], outcome="WIN")
        with pytest.raises(InvalidChunkError, match="outcome"):
            rec.record(
                {"action": np.ones((2, 1)), "reward": np.ones((2, 1)), "done": np.ones((2, 1))},
                outcome=np.ones((2, 1), np.float32),
            )
        # The store keys cells on player_positions: a chunk without it is refused by record().
        with pytest.raises(InvalidChunkError, match="cell-key field 'player_positions'"):
            rec.record(
                {"action": np.ones((2, 1)), "reward": np.ones((2, 1)), "done": np.ones((2, 1))}
            )
        rec.flush()
        with pytest.raises(ValueError, match="No data recorded"):
            rec.finish()
