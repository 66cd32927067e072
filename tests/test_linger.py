"""Small chunks recorded quickly join into one message (linger_ms), with the same episodes.

Truth comes from the reference model of the in-process recorder, fed the same record()
calls; message counts from the client's own stream stats (one ack a message).
"""

from __future__ import annotations

import dataclasses
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


def test_a_joined_message_reaches_store_and_dataset_call_by_call(tmp_path):
    """Two sessions of one server take the same calls, one each alone and one joined: the
    dataset holds the same episodes with the same store ids (the store took them in the
    same order), and the store's archive is the same (the server splits a joined message back into its calls)."""
    from test_dataset import chunk, wait_written
    from test_dataset_store import CAPTURE

    # Fine cells: later calls find new ones, whose first_seen_step is their call's.
    capture = dataclasses.replace(
        CAPTURE, cell_fields=tuple(dataclasses.replace(f, bucket=1) for f in CAPTURE.cell_fields)
    )

    from recorder_client.dataset import open_dataset
    from recorder_server import ServerOptions, start_server
    from recorder_server.dataset.sink import DatasetOptions

    uri = str(tmp_path / "dataset")
    server = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            dataset=DatasetOptions(uri=uri, node_id="n1", flush_seconds=0.2),
        )
    )
    calls = []
    for i in range(16):
        arrays, states = chunk(0, i)
        arrays.pop("outcome")
        arrays["action"] = arrays["action"] & 0xF
        calls.append((arrays, states))
    finished = int(sum(a["done"].sum() for a, _ in calls))
    tables = {}
    try:
        for session, linger in (("alone", 0), ("joined", 500)):
            with RolloutRecorder(
                record_states=True,
                capture=capture,
                target=server.address,
                session=session,
                linger_ms=linger,
            ) as rec:
                for arrays, states in calls:
                    rec.record(arrays, states)
                rec.flush()
                joined = rec.stats.chunks_joined
                archive = rec.capture.archive()
            assert (joined > 8) == (linger > 0), joined
            wait_written(uri, session, finished)
            table = open_dataset(uri, session=session).to_table(
                columns=["env", "start", "store_trajectory", "step", "reward"]
            )
            order = [("env", "ascending"), ("start", "ascending"), ("step", "ascending")]
            tables[session] = (table.sort_by(order), archive)
    finally:
        server.stop(grace=0)
    (alone, cells_alone), (joined, cells_joined) = tables["alone"], tables["joined"]
    # Store ids count episodes in the order the store took them.
    for column in ("env", "start", "store_trajectory", "step", "reward"):
        assert alone[column].to_pylist() == joined[column].to_pylist(), column
    # The archive, first_seen_step (the env steps before each episode's call) included.
    assert cells_alone.key_names == cells_joined.key_names
    for name in cells_alone.key_names:
        assert np.array_equal(cells_alone.cells[name], cells_joined.cells[name]), name
    for name in ("visits", "first_seen_step", "best_return", "best_trajectory_id", "best_step"):
        a, b = getattr(cells_alone, name), getattr(cells_joined, name)
        assert np.array_equal(a, b), (name, a, b)


def test_the_log_keeps_a_joined_chunks_parts():
    """A joined chunk's part lengths go into its write-ahead log record, so that a replay
    hands its episodes on call by call again."""
    from recorder_client._messages import array_to_proto
    from recorder_client._proto import recorder_pb2 as pb
    from recorder_server.durability import records
    from recorder_server.rpc.convert import chunk_from_proto
    from recorder_server.sessions import ServiceLimits

    msg = pb.Chunk(sequence=3, part_lengths=[2, 6])
    msg.action.CopyFrom(array_to_proto(np.zeros((8, 3), np.int32)))
    msg.reward.CopyFrom(array_to_proto(np.zeros((8, 3), np.float32)))
    msg.done.CopyFrom(array_to_proto(np.zeros((8, 3), bool)))
    chunk = chunk_from_proto(msg, ServiceLimits())
    assert chunk.parts == (2, 6)
    replayed = records.decode(b"".join(records.chunk("s", "w", chunk))).body
    assert (replayed.sequence, replayed.parts) == (3, (2, 6))
    msg.ClearField("part_lengths")
    alone = records.decode(
        b"".join(records.chunk("s", "w", chunk_from_proto(msg, ServiceLimits())))
    )
    assert alone.body.parts == ()
    assert (alone.body.cut_before, alone.body.fresh_start) == (False, False)
    # The client's marks of a hole (chunks it dropped) and of a new process's first chunk.
    for flag in ("cut_before", "fresh_start"):
        marked = pb.Chunk()
        marked.CopyFrom(msg)
        setattr(marked, flag, True)
        body = records.decode(
            b"".join(records.chunk("s", "w", chunk_from_proto(marked, ServiceLimits())))
        ).body
        assert getattr(body, flag) and not body.parts, flag


@pytest.mark.parametrize("cap", ["max_chunk_env_steps", "max_chunk_bytes"])
def test_a_joined_message_keeps_to_the_servers_chunk_caps(tmp_path, cap):
    """Each call fits the server's chunk caps; the message they join into must too (the
    server states them when the worker joins)."""
    from recorder_server import ServerOptions, start_server
    from recorder_server.limits import ServiceLimits

    calls = chunks(12)
    call_bytes = sum(a.nbytes for a in (*calls[0][0].values(), *calls[0][1].values()))
    # Room for two calls, not three.
    value = 2 * T * N if cap == "max_chunk_env_steps" else 2 * call_bytes + call_bytes // 2
    limits = dataclasses.replace(ServiceLimits(), **{cap: value})
    options = ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), limits=limits)
    running = start_server(options)
    config = {"record_states": True, "state_fields": ["player_positions"]}
    ref = ReferenceRecorder(**config)
    try:
        with RolloutRecorder(
            **config, target=running.address, session="capped", linger_ms=500
        ) as rec:
            record_all(rec, ref, calls)
            rec.flush()  # a refused message would raise here
            assert rec.stats.chunks_joined >= 4, rec.stats  # they still join, two by two
            assert rec.stats.chunks_acked >= 6, rec.stats
            assert_bit_identical(rec.finish(), ref.finish())
    finally:
        running.stop(grace=0)
