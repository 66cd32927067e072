"""A finish() result far above gRPC's 4 MiB message default streams back whole."""

from __future__ import annotations

import numpy as np

from recorder_client import RolloutRecorder


def test_finish_of_more_than_64_mib_round_trips(target):
    rng = np.random.default_rng(7)
    T, N, W = 256, 8, 1024
    chunks = []
    with RolloutRecorder(
        record_states=True, state_fields=["features"], target=target, session="big"
    ) as rec:
        for i in range(8):
            done = np.zeros((T, N), bool)
            done[-1, i % N] = True
            traj = {
                "action": rng.integers(0, 1 << 40, (T, N), dtype=np.int64),
                "reward": rng.random((T, N)),
                "done": done,
            }
            states = {"features": rng.random((T, N, W), dtype=np.float32)}
            chunks.append((traj, states))
            rec.record(traj, states)
        out = rec.finish()
    total = sum(a.nbytes for a in out.fields.values())
    assert total >= 64 << 20, total
    features = np.concatenate([s["features"] for _, s in chunks])
    actions = np.concatenate([t["action"] for t, _ in chunks])
    for b in range(out.num_episodes):
        e, s, n = out.episode_env[b], out.episode_start[b], out.lengths[b]
        assert out.features[b, :n].tobytes() == features[s : s + n, e].tobytes()
        assert np.array_equal(out.actions[b, :n], actions[s : s + n, e])
        assert not out.features[b, n:].any()
