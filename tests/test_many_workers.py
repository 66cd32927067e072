"""Eight real worker processes record into one session at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
from conftest import wait_for
from reference_model import ReferenceRecorder

from recorder_client import RolloutRecorder
from recorder_server.workload import SyntheticVecEnv

WORKERS = 8
CHUNKS, T, N = 6, 32, 5
FIELDS = ["player_positions", "player_inventory"]

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from recorder_client import RolloutRecorder
    from recorder_server.workload import SyntheticVecEnv
    target, index, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rec = RolloutRecorder(record_states=True, state_fields={fields!r}, target=target,
                          session="many", worker_id=f"w{{index}}")
    print("joined", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    env = SyntheticVecEnv({n}, seed=index, done_prob=0.05)
    for _ in range({chunks}):
        rec.record(*env.collect({t}))
    rec.close()
    """
).format(fields=FIELDS, n=N, chunks=CHUNKS, t=T)


def expected_for(index: int) -> dict[str, np.ndarray]:
    ref = ReferenceRecorder(record_states=True, state_fields=FIELDS)
    env = SyntheticVecEnv(N, seed=index, done_prob=0.05)
    for _ in range(CHUNKS):
        ref.record(*env.collect(T))
    return ref.finish(pad_incomplete=True)


def test_eight_worker_processes_every_episode_once_in_join_order(server_process, tmp_path):
    go = tmp_path / "go"
    procs = []
    # Start them one by one so the join order is known: w0, w1, ...
    for i in range(WORKERS):
        p = subprocess.Popen(
            [sys.executable, "-c", WORKER, server_process.address, str(i), str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "joined"
        procs.append(p)
    go.touch()  # now all eight stream at once
    for p in procs:
        assert p.wait(120) == 0
        p.stdout.close()
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=server_process.address, session="many"
    ) as viewer:
        assert wait_for(lambda: viewer.status().chunks_stored == WORKERS * CHUNKS)
        out = viewer.finish()
        status = viewer.status()
    assert [w.worker_id for w in status.workers][:WORKERS] == [f"w{i}" for i in range(WORKERS)]
    assert list(out.worker_ids[:WORKERS]) == [f"w{i}" for i in range(WORKERS)]
    # Worker by worker in join order, and each worker's block is exactly its own episodes.
    assert np.all(np.diff(out.episode_worker) >= 0)
    row = 0
    for i in range(WORKERS):
        exp = expected_for(i)
        b = exp["actions"].shape[0]
        rows = slice(row, row + b)
        assert np.all(out.episode_worker[rows] == i)
        assert np.array_equal(out.lengths[rows], exp["lengths"])
        assert np.array_equal(out.episode_env[rows], exp["episode_env"])
        assert np.array_equal(out.episode_start[rows], exp["episode_start"])
        assert np.array_equal(out.episode_done[rows], exp["episode_done"])
        for name in ("actions", "rewards", "positions", "player_inventory"):
            got = out.fields[name][rows, : exp[name].shape[1]]
            assert got.tobytes() == exp[name].tobytes(), (i, name)
            assert not out.fields[name][rows, exp[name].shape[1] :].any()
        row += b
    assert row == out.num_episodes  # nothing extra, nothing missing
    assert out.num_episodes == sum(expected_for(i)["actions"].shape[0] for i in range(WORKERS))
