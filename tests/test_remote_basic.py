"""End-to-end behaviour of RolloutRecorder against a real server on a real port."""

from __future__ import annotations

import socket
import time
import types

import grpc
import numpy as np
import pytest
from conftest import wait_for

from recorder_client import (
    InvalidChunkError,
    NoDataError,
    RecorderUnavailableError,
    RolloutRecorder,
    SessionMismatchError,
    Trajectory,
)
from recorder_client._messages import array_to_proto as encode_array
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc


def make_chunk(rng, T=6, N=3, P=None, done_p=0.25, adtype=np.int32, positions=True):
    shape = (T, N) if P is None else (T, N, P)
    traj = types.SimpleNamespace(
        action=rng.integers(0, 12, shape).astype(adtype),
        reward=rng.standard_normal((T, N)).astype(np.float32),
        done=rng.random((T, N)) < done_p,
    )
    states = {}
    if positions:
        states["player_positions"] = rng.integers(0, 64, (T, N, 1, 2)).astype(np.int32)
        states["player_inventory"] = rng.integers(0, 9, (T, N, 1, 4)).astype(np.int16)
    return traj, states


def assert_same(a: Trajectory, b: Trajectory) -> None:
    assert a.fields.keys() == b.fields.keys()
    for name in a.fields:
        x, y = a.fields[name], b.fields[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
    assert np.array_equal(a.lengths, b.lengths)


def test_record_finish_roundtrip_mapping_and_attributes(target):
    rng = np.random.default_rng(1)
    with RolloutRecorder(record_states=True, target=target, session="rt") as rec:
        chunks = [make_chunk(rng) for _ in range(4)]
        for i, (traj, states) in enumerate(chunks):
            if i % 2:
                traj = vars(traj)  # mapping access works as well as attributes
                states = types.SimpleNamespace(**states)
            rec.record(traj, states)
        out = rec.finish()
        assert rec.num_recorded_steps == 24
        assert not rec.is_full
    actions = np.concatenate([c[0].action for c in chunks])
    dones = np.concatenate([c[0].done for c in chunks])
    # Episode b of env e is the slice [start, start+length) of that env's column.
    for b in range(out.num_episodes):
        e, s, n = out.episode_env[b], out.episode_start[b], out.lengths[b]
        assert np.array_equal(out.actions[b, :n], actions[s : s + n, e])
        assert not out.actions[b, n:].any()
        assert out.episode_done[b] == bool(dones[s + n - 1, e])
    assert out.positions.shape[:2] == out.actions.shape
    assert out.player_inventory.dtype == np.int16
    assert out.mask().sum() == out.lengths.sum()


def test_finish_is_repeatable_and_reset_keeps_config(target):
    rng = np.random.default_rng(2)
    with RolloutRecorder(max_episodes=5, target=target, session="rep") as rec:
        for _ in range(3):
            rec.record(*make_chunk(rng, positions=False))
        first, second = rec.finish(), rec.finish()
        assert_same(first, second)
        rec.reset()
        assert rec.num_recorded_steps == 0
        with pytest.raises(NoDataError, match="No data recorded"):
            rec.finish()
        rec.record(*make_chunk(rng, positions=False))
        assert rec.finish().num_episodes <= 5
        assert rec.max_episodes == 5


def test_seed_value_errors(target):
    with RolloutRecorder(target=target, session="errs") as rec:
        with pytest.raises(ValueError, match="No data recorded"):
            rec.finish()
        rec.record(
            {
                "action": np.zeros((4, 2), np.int32),
                "reward": np.zeros((4, 2)),
                "done": np.zeros((4, 2), bool),
            }
        )
        with pytest.raises(ValueError, match="No complete episodes found"):
            rec.finish(pad_incomplete=False)
        assert rec.finish(pad_incomplete=True).actions.shape == (2, 4)


def test_is_full_drops_later_chunks(target):
    with RolloutRecorder(max_episodes=3, target=target, session="full") as rec:
        done = np.zeros((5, 2), bool)
        done[1, 0] = done[3, 1] = True
        chunk = {"action": np.ones((5, 2), np.int8), "reward": np.ones((5, 2)), "done": done}
        rec.record(chunk)
        assert not rec.is_full
        rec.record(chunk)  # 4 dones now: full, but this chunk is stored
        assert rec.is_full
        rec.record(chunk)  # dropped
        assert rec.num_recorded_steps == 10
        assert rec.finish().num_episodes == 3


BAD_INPUTS = {
    "N differs": lambda c: {
        **c,
        "action": np.zeros((6, 4), np.int32),
        "reward": np.zeros((6, 4), np.float32),
        "done": np.zeros((6, 4), bool),
    },
    "action trailing shape": lambda c: {**c, "action": np.zeros((6, 3, 2), np.int32)},
    "action dtype": lambda c: {**c, "action": c["action"].astype(np.int64)},
    "reward length": lambda c: {**c, "reward": np.zeros((5, 3), np.float32)},
    "done length": lambda c: {**c, "done": np.zeros((7, 3), bool)},
    "missing done": lambda c: {k: v for k, v in c.items() if k != "done"},
    "object dtype": lambda c: {**c, "reward": np.zeros((6, 3), dtype=object)},
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_chunk_raises_and_session_stays_intact(target, case):
    rng = np.random.default_rng(3)
    traj, _ = make_chunk(rng, positions=False)
    good = vars(traj)
    with RolloutRecorder(target=target, session=f"bad-{case.replace(' ', '-')}") as rec:
        rec.record(good)
        rec.flush()  # stored: the worker's layout is fixed, and checked at record()
        with pytest.raises(InvalidChunkError) as info:
            rec.record(BAD_INPUTS[case](good))
        msg = str(info.value)
        assert "expected" in msg and "got" in msg
        rec.record(good)
        out = rec.finish()
    with RolloutRecorder(target=target, session=f"ref-{case.replace(' ', '-')}") as ref:
        ref.record(good)
        ref.record(good)
        assert_same(out, ref.finish())


def test_state_field_set_change_is_refused(target):
    rng = np.random.default_rng(4)
    with RolloutRecorder(record_states=True, target=target, session="states") as rec:
        traj, states = make_chunk(rng)
        rec.record(traj, states)
        rec.flush()
        with pytest.raises(InvalidChunkError, match="state fields"):
            rec.record(traj, {"player_positions": states["player_positions"]})
        with pytest.raises(InvalidChunkError, match=r"player_positions.shape"):
            rec.record(traj, {**states, "player_positions": np.zeros((6, 3, 2, 2), np.int32)})
        rec.record(traj, states)
        assert rec.finish().positions.shape[0] >= 3


def test_session_config_mismatch(target):
    with RolloutRecorder(max_episodes=4, target=target, session="cfg") as rec:
        with pytest.raises(SessionMismatchError) as info:
            RolloutRecorder(max_episodes=8, target=target, session="cfg")
        assert "max_episodes=4" in str(info.value) and "8" in str(info.value)
        rec.record(
            {"action": np.zeros((2, 1)), "reward": np.zeros((2, 1)), "done": np.ones((2, 1), bool)}
        )
        assert rec.finish().num_episodes == 2


def test_server_side_validation_refuses_and_keeps_session(target):
    """A chunk that bypasses client checks (another client, another dtype) is refused by the server."""
    with RolloutRecorder(target=target, session="srv", worker_id="a") as rec:
        rec.record(
            {
                "action": np.zeros((3, 2), np.int32),
                "reward": np.zeros((3, 2)),
                "done": np.ones((3, 2), bool),
            }
        )
        rec.flush()
        with RolloutRecorder(target=target, session="srv", worker_id="b") as other:
            other.record(
                {
                    "action": np.zeros((3, 2), np.int64),
                    "reward": np.zeros((3, 2)),
                    "done": np.ones((3, 2), bool),
                }
            )
            with pytest.raises(InvalidChunkError, match="action.dtype: expected int32.*got int64"):
                other.flush()
        out = rec.finish()
        assert out.num_episodes == 6 and set(out.episode_worker.tolist()) == {0}

    channel = grpc.insecure_channel(target)
    stub = pb_grpc.RecorderStub(channel)
    stub.Join(pb.JoinRequest(session="srv2", config=pb.SessionConfig(), worker_id="raw"))
    good = pb.Chunk(
        sequence=1,
        action=encode_array(np.zeros((2, 2), np.int32)),
        reward=encode_array(np.zeros((2, 2), np.float32)),
        done=encode_array(np.ones((2, 2), bool)),
    )
    lying = pb.Chunk()
    lying.CopyFrom(good)
    lying.sequence = 2
    lying.action.raw_size = 1 << 40  # a zstd-bomb style lie about the size
    corrupt = pb.Chunk()
    corrupt.CopyFrom(good)
    corrupt.sequence = 3
    corrupt.reward.data = b"\x28\xb5\x2f\xfd" + b"\x00" * 12
    good4 = pb.Chunk()
    good4.CopyFrom(good)
    good4.sequence = 4
    reqs = [pb.RecordRequest(open=pb.RecordOpen(session="srv2", worker_id="raw"))]
    reqs += [pb.RecordRequest(chunk=c) for c in (good, lying, corrupt, good4)]
    acks = list(stub.Record(iter(reqs)))
    assert [a.result for a in acks] == [
        pb.RecordAck.STORED,
        pb.RecordAck.REJECTED,
        pb.RecordAck.REJECTED,
        pb.RecordAck.STORED,
    ]
    assert "chunk.action.raw_size: expected 16 bytes" in acks[1].error_message
    assert "chunk.reward" in acks[2].error_message
    # A resend of an already-taken sequence is acknowledged and not applied twice.
    again = list(stub.Record(iter([reqs[0], pb.RecordRequest(chunk=good)])))
    assert again[0].result == pb.RecordAck.DUPLICATE
    assert stub.GetStatus(pb.StatusRequest(session="srv2")).num_recorded_steps == 4
    channel.close()


def test_unreachable_server_names_target():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    start = time.monotonic()
    with pytest.raises(RecorderUnavailableError, match=f"127.0.0.1:{port}"):
        RolloutRecorder(target=f"127.0.0.1:{port}", connect_timeout=0.5)
    assert time.monotonic() - start < 5


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_episodes"):
        RolloutRecorder(max_episodes=-1, target="127.0.0.1:1")
    with pytest.raises(ValueError, match="reserved"):
        RolloutRecorder(state_fields=["rewards"], target="127.0.0.1:1")
    with pytest.raises(ValueError, match="both map"):
        RolloutRecorder(state_fields=["player_positions", "positions"], target="127.0.0.1:1")


def test_any_state_field_name_and_save_load(target, tmp_path):
    rng = np.random.default_rng(5)
    fields = ["map", "fuel_level", "player_positions"]
    with RolloutRecorder(
        record_states=True, state_fields=fields, target=target, session="any"
    ) as rec:
        T, N = 5, 2
        rec.record(
            {
                "action": rng.integers(0, 3, (T, N, 2)).astype(np.uint8),
                "reward": rng.random((T, N)),
                "done": rng.random((T, N)) < 0.3,
            },
            {
                "map": rng.integers(0, 5, (T, N, 4, 4)).astype(np.int8),
                "fuel_level": rng.random((T, N)).astype(np.float16),
                "player_positions": rng.integers(0, 9, (T, N, 2, 2)),
            },
        )
        out = rec.finish()
    assert out.block_map.dtype == np.int8 and out.fuel_level.dtype == np.float16
    assert out.positions.shape[2:] == (2, 2)
    assert out.rewards.dtype == np.float32 and out.actions.dtype == np.uint8
    with pytest.raises(AttributeError, match="recorded state fields"):
        _ = out.not_a_field
    path = tmp_path / "traj.npz"
    out.save(path)
    assert_same(out, Trajectory.load(path))
    back = Trajectory.load(path)
    assert back.worker_ids == out.worker_ids
    assert np.array_equal(back.episode_done, out.episode_done)


def test_to_factoriax_names_what_is_missing(target):
    with RolloutRecorder(target=target, session="fx") as rec:
        rec.record(
            {"action": np.zeros((2, 1)), "reward": np.zeros((2, 1)), "done": np.ones((2, 1))}
        )
        out = rec.finish()
    try:
        import factoriax.analysis.trajectory  # noqa: F401  (needs jax)
    except ImportError:
        with pytest.raises(ImportError, match="to_factoriax\\(\\) needs factoriax"):
            out.to_factoriax()
    else:
        assert out.to_factoriax().actions.shape == out.actions.shape


def test_is_full_is_global_across_workers(target):
    done = np.ones((1, 2), bool)
    chunk = {"action": np.zeros((1, 2)), "reward": np.zeros((1, 2)), "done": done}
    with RolloutRecorder(max_episodes=3, target=target, session="g", worker_id="a") as a:
        with RolloutRecorder(max_episodes=3, target=target, session="g", worker_id="b") as b:
            a.record(chunk)
            a.flush()
            b.record(chunk)  # 4 dones over both workers
            assert wait_for(lambda: b.is_full, 1.0, 0.002)  # with b's ack, or an update before
            assert wait_for(lambda: a.is_full, 1.0, 0.002)  # a hears of b's chunk
            assert a.record(chunk) is False  # dropped in the client, as the server would
            a.flush()
            assert a.status().chunks_dropped == 0 and a.stats.chunks_dropped_full == 1
            assert not b.record(chunk)
            assert b.finish().num_episodes == 3
