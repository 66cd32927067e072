"""Small chunks recorded quickly join into one message (linger_ms), with the same episodes.

Truth comes from the reference model of the in-process recorder, fed the same record()
calls; message counts from the client's own stream stats (one ack a message).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from reference_model import ReferenceRecorder
from test_property_remote import assert_bit_identical

from recorder_client import RolloutRecorder

T, N = 8, 3


def chunks(count: int, seed: int = 0, done_p: float = 0.15) -> list[tuple[dict, dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        traj = {
            "action": rng.integers(0, 5, (T, N)).astype(np.int32),
            "reward": rng.standard_normal((T, N)).astype(np.float32),
            "done": rng.random((T, N)) < done_p,
        }
        states = {"player_positions": rng.integers(0, 9, (T, N, 2)).astype(np.int32)}
        out.append((traj, states))
    return out


def record_all(rec, ref, calls) -> None:
    for traj, states in calls:
        assert rec.record(traj, states) == ref.record(traj, states)


def test_quick_small_chunks_join_and_finish_is_exact(target):
    calls = chunks(12)
    config = {"record_states": True, "state_fields": ["player_positions"]}
    ref = ReferenceRecorder(**config)
    with RolloutRecorder(**config, target=target, session="linger", linger_ms=500) as rec:
        record_all(rec, ref, calls)
        # Counted in the client while they wait to be sent.
        assert rec.num_recorded_steps == ref.num_recorded_steps == 12 * T
        rec.flush()
        # The first goes alone (nothing came before it); the rest join while it is in flight.
        assert 1 < rec.stats.chunks_acked <= 3, rec.stats
        assert rec.stats.raw_bytes == sum(
            a.nbytes for traj, states in calls for a in (*traj.values(), *states.values())
        )
        assert_bit_identical(rec.finish(), ref.finish())
        assert rec.num_recorded_steps == 12 * T


def test_linger_zero_sends_each_chunk_alone(target):
    with RolloutRecorder(target=target, session="alone", linger_ms=0) as rec:
        for traj, _ in chunks(6):
            rec.record(traj)
        rec.flush()
        assert rec.stats.chunks_acked == 6


def test_max_episodes_keeps_chunks_whole(target):
    """With max_episodes the chunk that fills the session is kept and the next dropped, as
    in-process: chunks never join."""
    calls = chunks(10, seed=3, done_p=0.3)
    ref = ReferenceRecorder(max_episodes=9)
    with RolloutRecorder(max_episodes=9, target=target, session="whole", linger_ms=500) as rec:
        sent = [rec.record(traj) for traj, _ in calls]
        for traj, _ in calls:
            ref.record(traj)
        rec.flush()
        assert rec.stats.chunks_acked + rec.stats.chunks_dropped_full >= sum(sent)
        assert rec.is_full and ref.is_full
        assert_bit_identical(rec.finish(), ref.finish())


def test_flush_does_not_wait_out_the_linger(target):
    with RolloutRecorder(target=target, session="hurry", linger_ms=10_000) as rec:
        for traj, _ in chunks(4):
            rec.record(traj)
        t0 = time.monotonic()
        rec.flush()
        assert time.monotonic() - t0 < 5
        assert rec.stats.chunks_acked <= 2


def test_only_chunks_of_one_layout_join(target):
    """Chunks with terminated/truncated and chunks with done alone are sent apart; the
    episodes keep their flags."""
    calls = chunks(4, seed=5, done_p=0.25)
    with RolloutRecorder(target=target, session="layouts", linger_ms=500) as rec:
        for i, (traj, _) in enumerate(calls):
            if i >= 2:  # the same steps, the flags given as terminated and truncated
                term = traj["done"].copy()
                term[:, 0] = False
                traj = {**traj, "terminated": term, "truncated": traj["done"] & ~term}
                traj.pop("done")
            rec.record(traj)
        rec.flush()
        assert rec.stats.chunks_acked == 3  # the first, the second, the last two together
        got = rec.finish(pad_incomplete=False)
    done = np.concatenate([traj["done"] for traj, _ in calls])
    # Finished episodes env by env: from each done to the next.
    want = [int(x) for e in range(N) for x in np.diff(np.flatnonzero(np.r_[True, done[:, e]]))]
    assert got.lengths.tolist() == want


def test_linger_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"linger_ms: expected 0 to 10000, got -1"):
        RolloutRecorder(target="127.0.0.1:1", linger_ms=-1)
