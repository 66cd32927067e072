"""Sessions and workers as resources, recovery without wedging, and the client's rules for
refusals: against real `rollout-recorder serve` processes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import RestartableServer, ServerProcess, wait_for

from recorder_client import (
    DataLossError,
    InvalidChunkError,
    InvalidNameError,
    RolloutRecorder,
    UnknownSessionError,
    drop_session,
    list_sessions,
)


def chunk(seed: int, t: int = 8, n: int = 3, dtype=np.int32) -> dict:
    rng = np.random.default_rng(seed)
    done = rng.random((t, n)) < 0.3
    done[-1] = True
    return {
        "action": rng.integers(0, 9, (t, n)).astype(dtype),
        "reward": rng.random((t, n)).astype(np.float32),
        "done": done,
    }


def same(a, b) -> None:
    assert a.actions.tobytes() == b.actions.tobytes()
    assert a.rewards.tobytes() == b.rewards.tobytes()
    assert a.lengths.tolist() == b.lengths.tolist()


@pytest.fixture
def proc(tmp_path):
    started = []

    def make(*extra):
        server = ServerProcess(tmp_path / "data", *extra)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def test_sessions_are_listed_dropped_and_stay_dropped_after_a_restart(tmp_path):
    server = RestartableServer(tmp_path / "data", "--max-sessions", "3").start()
    try:
        target = server.address
        for i in range(3):
            with RolloutRecorder(target=target, session=f"run-{i}", worker_id="w") as rec:
                rec.record(chunk(i))
        listed = {s["name"]: s for s in list_sessions(target)}
        assert sorted(listed) == ["run-0", "run-1", "run-2"]
        one = listed["run-1"]
        assert one["workers"] == 0  # the worker left on close(); its chunk stays
        assert one["episodes"] == chunk(1)["done"].sum()
        assert one["raw_bytes"] > 0 and one["wire_bytes"] > 0 and one["idle_seconds"] >= 0
        with pytest.raises(Exception, match="at most 3 sessions"):
            RolloutRecorder(target=target, session="run-3")
        drop_session(target, "run-1")
        with pytest.raises(UnknownSessionError):
            drop_session(target, "run-1")
        with RolloutRecorder(target=target, session="run-3", worker_id="w") as rec:
            rec.record(chunk(3))  # the dropped session's place is free at once
            rec.flush()
        server.kill()
        data = (tmp_path / "data").rglob("*")
        # Nothing of the dropped session stays on disk: not in the log, not in a checkpoint.
        assert not any(b"run-1" in p.read_bytes() for p in data if p.is_file())
        server.start()
        assert sorted(s["name"] for s in list_sessions(target)) == ["run-0", "run-2", "run-3"]
        with RolloutRecorder(target=target, session="run-2", worker_id="w") as rec:
            again = rec.finish()
        assert again.actions.shape[0] == chunk(2)["done"].sum()
    finally:
        server.stop()


def test_workers_leave_on_close_and_idle_ones_expire(proc):
    server = proc("--max-workers", "2", "--worker-ttl", "1")
    target = server.address
    a = RolloutRecorder(target=target, session="s", worker_id="a")
    b = RolloutRecorder(target=target, session="s", worker_id="b")
    a.record(chunk(1))
    a.flush()
    with pytest.raises(Exception, match="at most 2 active workers"):
        RolloutRecorder(target=target, session="s", worker_id="c")
    b.close()  # leaves: its place is free at once
    c = RolloutRecorder(target=target, session="s", worker_id="c")
    c.record(chunk(2))
    c.flush()
    # a and c go idle past --worker-ttl: they expire, and free their places.
    assert wait_for(lambda: not any(w.active for w in a.status().workers), timeout=10)
    d = RolloutRecorder(target=target, session="s", worker_id="d")
    # An expired worker that records again joins again by itself, where it was.
    a.record(chunk(3))
    a.flush(timeout=20)
    # Both places are taken now: c cannot come back.
    c.record(chunk(4))
    with pytest.raises(Exception, match="at most 2 active workers"):
        c.flush(timeout=20)
    status = {w.worker_id: w for w in a.status().workers}
    assert status["a"].active and status["a"].last_sequence == 2
    assert status["a"].chunks_stored == 2 and status["c"].chunks_stored == 1
    assert not status["c"].active
    assert "b" not in status  # left without chunks: forgotten
    out = a.finish()
    assert list(out.worker_ids) == ["a", "c", "d"]
    assert sorted(set(out.episode_worker.tolist())) == [0, 1]
    for rec in (a, d):
        rec.close()
    c.close(timeout=1)


def test_reset_forgets_workers_that_left(proc):
    server = proc("--max-workers", "4")
    target = server.address
    keeper = RolloutRecorder(target=target, session="s", worker_id="keeper")
    for i in range(3):
        with RolloutRecorder(target=target, session="s", worker_id=f"gone-{i}") as rec:
            rec.record(chunk(i))
    assert len(keeper.status().workers) == 4
    keeper.reset()
    assert [w.worker_id for w in keeper.status().workers] == ["keeper"]
    keeper.record(chunk(9))
    out = keeper.finish()
    assert list(out.worker_ids) == ["keeper"] and set(out.episode_worker.tolist()) == {0}
    keeper.close()


def test_idle_sessions_are_dropped_after_the_session_ttl(tmp_path):
    server = RestartableServer(tmp_path / "data", "--session-ttl", "1").start()
    try:
        target = server.address
        with RolloutRecorder(target=target, session="short", worker_id="w") as rec:
            rec.record(chunk(0))
        assert [s["name"] for s in list_sessions(target)] == ["short"]
        assert wait_for(lambda: not list_sessions(target), timeout=10)
        # The sweep logs just after the drop that list_sessions already sees.
        line = "session 'short' dropped: unused for 1 s"
        assert wait_for(lambda: line in server.log(), timeout=5), server.log()
    finally:
        server.stop()


def _segment(data_dir: Path) -> Path:
    return sorted((data_dir / "wal").glob("wal-*.log"))[-1]


@pytest.mark.parametrize("mode", ["raise", "continue"])
def test_a_lost_acknowledged_tail_is_reported_not_spun_on(tmp_path, mode, caplog):
    """A power cut loses the unsynced end of the log after the chunks were acknowledged: the
    client names the lost range and its cause (or counts it), and goes on from the next
    sequence. (Only a policy that acks before its fsync can lose them: under "always" the
    same claim is refused, see test_identity.)"""
    server = RestartableServer(tmp_path / "data", "--wal-fsync", "batch").start()
    sizes = []
    chunks = [chunk(i) for i in range(10)]
    rec = RolloutRecorder(
        target=server.address,
        session="s",
        worker_id="w",
        reconnect_timeout=30,
        on_data_loss=mode,
    )
    try:
        for c in chunks[:6]:
            rec.record(c)
            rec.flush()
            sizes.append(_segment(tmp_path / "data").stat().st_size)
        server.kill()
        with open(_segment(tmp_path / "data"), "r+b") as fh:
            fh.truncate(sizes[3])  # chunks 5 and 6 were acknowledged, then lost
        server.start()
        with caplog.at_level(logging.WARNING, logger="recorder_client"):
            if mode == "raise":
                rec.record(chunks[6])
                with pytest.raises(DataLossError) as info:
                    rec.flush(timeout=30)
                assert (info.value.first, info.value.last) == (5, 6)
                assert "lost chunks 5..6" in str(info.value)
                assert "stopped before its write-ahead log synced them" in str(info.value)
                assert "--wal-fsync batch" in str(info.value)
            else:
                rec.record(chunks[6])
                rec.flush(timeout=30)
        assert any("lost chunks 5..6" in r.getMessage() for r in caplog.records)
        rec.record(chunks[7])
        rec.flush(timeout=30)
        assert rec.stats.reconnects <= 3 and rec.stats.sequences_lost == 2
        status = rec.status()
        assert status.sequences_lost == 2 and status.workers[0].last_sequence == 8
        out = rec.finish()
        with RolloutRecorder(target=server.address, session="ref", worker_id="r") as ref:
            for c in chunks[:4] + chunks[6:8]:
                ref.record(c)
            want = ref.finish()
        # No episode spans the hole: each env's first piece after it (its start was lost) is
        # left out; every other episode is whole.
        keep, cut = [], set()
        for b in range(want.num_episodes):  # env by env, in time order
            env = int(want.episode_env[b])
            if want.episode_start[b] >= 4 * 8 and env not in cut:
                cut.add(env)
                continue
            keep.append(b)
        assert out.lengths.tolist() == want.lengths[keep].tolist()
        for row, b in enumerate(keep):
            n = int(want.lengths[b])
            assert out.actions[row, :n].tobytes() == want.actions[b, :n].tobytes()
            assert out.rewards[row, :n].tobytes() == want.rewards[b, :n].tobytes()
        assert (out.episode_partial == "").all()
        assert "chunks 5..6 were acknowledged but are not held" in server.log()
    finally:
        rec.close()
        server.stop()


def test_a_message_over_the_servers_cap_fails_at_once(proc):
    """A chunk the server can never take (over its gRPC message cap) ends the worker's
    stream with a clear error; the client neither waits for room nor reconnects."""
    server = proc("--max-message-mib", "1")
    rec = RolloutRecorder(target=server.address, session="s", worker_id="w")
    try:
        big = chunk(0, t=4, n=2)
        noise = np.random.default_rng(0).integers(0, 2**31, (4, 2, 40_000), dtype=np.int32)
        big["action"] = noise  # 1.28 MB on the wire too: over the 1 MiB cap
        rec.record(big)
        began = time.monotonic()
        with pytest.raises(Exception, match="(?i)message|larger|exhausted"):
            rec.flush(timeout=30)
        assert time.monotonic() - began < 10
        assert rec.stats.reconnects == 0
    finally:
        rec.close(timeout=1)


def test_a_refused_first_chunk_does_not_fix_the_workers_layout(proc):
    server = proc()
    target = server.address
    with RolloutRecorder(target=target, session="s", worker_id="first") as first:
        first.record(chunk(0))  # the session's action dtype is int32 now
    with RolloutRecorder(target=target, session="s", worker_id="second") as rec:
        rec.record(chunk(1, dtype=np.int64))
        with pytest.raises(InvalidChunkError, match="int32"):
            rec.flush()
        rec.record(chunk(2))  # the corrected chunk is taken
        rec.flush()
        status = {w.worker_id: w for w in rec.status().workers}
        assert status["second"].chunks_stored == 1


def test_a_refusal_never_costs_the_next_chunk(proc):
    server = proc()
    target = server.address
    with RolloutRecorder(target=target, session="s", worker_id="first") as first:
        first.record(chunk(0))  # the session's action dtype is int32 now
    with RolloutRecorder(target=target, session="s", worker_id="w") as rec:
        rec.record(chunk(1, dtype=np.int64))  # refused by the server
        assert wait_for(lambda: rec.stats.chunks_acked == 1)
        with pytest.raises(InvalidChunkError, match="int32"):
            rec.record(chunk(2))  # raised here, after this call's chunk was queued
        rec.flush()
        status = {w.worker_id: w for w in rec.status().workers}
        assert status["w"].chunks_stored == 1 and status["w"].last_sequence == 2


def test_outcome_codes_are_checked_at_record(proc):
    server = proc()
    with RolloutRecorder(target=server.address, session="s", worker_id="w") as rec:
        for bad in (7, 99, -5):
            codes = np.zeros((8, 3), np.int32)
            codes[2, 1] = bad
            with pytest.raises(InvalidChunkError, match=f"got {bad}"):
                rec.record(chunk(0), outcome=codes)
        with pytest.raises(InvalidChunkError, match="integer codes"):
            rec.record(chunk(0), outcome=np.zeros((8, 3), np.float32))
        rec.record(chunk(0), outcome=np.ones((8, 3), np.int8))
        rec.flush()
        assert rec.status().chunks_stored == 1


def test_names_are_refused_with_a_name_error(proc):
    server = proc()
    for name in ("../../etc", "a\x00b", "", "x" * 10_000):
        with pytest.raises(InvalidNameError) as info:
            RolloutRecorder(target=server.address, session=name)
        assert not isinstance(info.value, InvalidChunkError)
        assert len(str(info.value)) < 300
    with pytest.raises(InvalidNameError):
        RolloutRecorder(target=server.address, session="ok", worker_id="bad\nid")
    with pytest.raises(InvalidNameError):
        drop_session(server.address, "../x")


def test_sigterm_after_malformed_streams_exits_in_time_and_frees_the_data_dir(tmp_path):
    import grpc

    server = RestartableServer(tmp_path / "data", "--grace", "1").start()
    channel = grpc.insecure_channel(server.address)
    record = channel.stream_stream(
        "/recorder.v1.Recorder/Record", request_serializer=None, response_deserializer=None
    )

    def garbage():
        yield b"\x0a\x05hello"  # an `open` whose fields are not a RecordOpen
        yield b"\xff\xff\xff\xff\x0f"
        time.sleep(60)  # and the stream stays open

    calls = [record(garbage()) for _ in range(2)]
    time.sleep(1.0)
    began = time.monotonic()
    code = server.stop(timeout=30)
    took = time.monotonic() - began
    for call in calls:
        call.cancel()
    channel.close()
    assert code is not None and took < 1 + 5, (code, took)
    server.start()  # the data directory's lock was released
    with RolloutRecorder(target=server.address, session="s", worker_id="w") as rec:
        rec.record(chunk(0))
        assert rec.finish().num_episodes == chunk(0)["done"].sum()
    server.stop()
