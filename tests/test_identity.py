"""Who may write as a worker: one live stream per (session,
worker_id), a join's claim of acknowledged chunks checked, and drops that stick.

Real servers on port 0; the truth (chunks, steps, done flags) is counted here with numpy.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
from conftest import RestartableServer

from recorder_client import (
    InvalidChunkError,
    RolloutRecorder,
    SessionDroppedError,
    WorkerIdInUseError,
    drop_session,
    list_sessions,
)
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc


def chunk(seed: int, t: int = 6, n: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    done = rng.random((t, n)) < 0.3
    done[-1] = True
    return {
        "action": rng.integers(0, 9, (t, n)).astype(np.int32),
        "reward": rng.random((t, n)).astype(np.float32),
        "done": done,
    }


def truth(chunks: list[dict]) -> tuple[int, int]:
    """(steps, finished episodes) of these chunks, counted here."""
    return sum(c["done"].shape[0] for c in chunks), sum(int(c["done"].sum()) for c in chunks)


def held(rec: RolloutRecorder, worker_id: str) -> tuple[int, int, int, int]:
    """(chunks stored, last sequence, steps, sequences lost) of one worker as the server has
    them."""
    status = rec.status()
    (worker,) = [w for w in status.workers if w.worker_id == worker_id]
    return worker.chunks_stored, worker.last_sequence, worker.steps, worker.sequences_lost


def test_a_second_recorder_with_the_same_worker_id_is_refused_before_it_records(target):
    chunks = [chunk(i) for i in range(10)]
    with RolloutRecorder(target=target, session="two", worker_id="w") as first:
        for c in chunks[:5]:
            first.record(c)
        first.flush()
        with pytest.raises(WorkerIdInUseError) as refused:
            RolloutRecorder(target=target, session="two", worker_id="w")
        assert refused.value.retry_after is None  # its holder streams: no waiting helps
        message = str(refused.value)
        assert "'w'" in message and "session 'two'" in message
        assert " since 20" in message and "UTC" in message  # since when it is held
        assert "own worker_id" in message  # how to fix it
        for c in chunks[5:]:
            first.record(c)
        first.flush()
        steps, episodes = truth(chunks)
        assert held(first, "w") == (10, 10, steps, 0)
        status = first.status()
        assert (status.num_recorded_steps, status.episodes_finished) == (steps, episodes)
        assert first.stats.chunks_acked == 10 and first.stats.sequences_lost == 0


def _config(rec: RolloutRecorder) -> pb.SessionConfig:
    return rec._config()


def test_an_overclaiming_join_is_refused_and_voids_nothing(target):
    chunks = [chunk(i) for i in range(6)]
    with RolloutRecorder(target=target, session="claim", worker_id="w") as live:
        for c in chunks[:3]:
            live.record(c)
        live.flush()
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.RecorderStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(
                    pb.JoinRequest(
                        session="claim",
                        config=_config(live),
                        worker_id="w",
                        acked_sequence=10**6,
                        instance_id="someone-else",
                    ),
                    timeout=10,
                )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details()
        assert "acked_sequence" in details and "1000000" in details
        assert "at most 3" in details
        for c in chunks[3:]:
            live.record(c)
        live.flush()
        steps, _ = truth(chunks)
        assert held(live, "w") == (6, 6, steps, 0)
        assert live.status().sequences_lost == 0 and live.stats.sequences_lost == 0


def test_another_instance_is_refused_while_the_holder_has_a_stream(target):
    """A raw client naming another instance can neither join, stream nor leave as the
    holder's worker id; the holder goes on."""
    with RolloutRecorder(target=target, session="fence", worker_id="w") as holder:
        holder.record(chunk(0))
        holder.flush()
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.RecorderStub(channel)
            join = pb.JoinRequest(
                session="fence", config=_config(holder), worker_id="w", instance_id="thief"
            )
            with pytest.raises(grpc.RpcError) as joined:
                stub.Join(join, timeout=10)
            assert joined.value.code() == grpc.StatusCode.ALREADY_EXISTS
            opened = pb.RecordOpen(session="fence", worker_id="w", instance_id="thief")
            with pytest.raises(grpc.RpcError) as streamed:
                list(stub.Record(iter([pb.RecordRequest(open=opened)]), timeout=10))
            assert streamed.value.code() == grpc.StatusCode.ALREADY_EXISTS
            leave = pb.LeaveRequest(session="fence", worker_id="w", instance_id="thief")
            with pytest.raises(grpc.RpcError) as left:
                stub.Leave(leave, timeout=10)
            assert left.value.code() == grpc.StatusCode.ALREADY_EXISTS
        holder.record(chunk(1))
        holder.flush()
        assert held(holder, "w")[:2] == (2, 2)


def test_the_holder_takes_its_worker_id_back_after_a_restart(tmp_path):
    server = RestartableServer(tmp_path / "data").start()
    chunks = [chunk(i) for i in range(6)]
    try:
        rec = RolloutRecorder(
            target=server.address, session="back", worker_id="w", reconnect_timeout=60
        )
        for c in chunks[:3]:
            rec.record(c)
        rec.flush()
        server.stop()  # its stream is cut
        server.start()
        for c in chunks[3:]:
            rec.record(c)
        rec.flush(timeout=60)
        assert rec.stats.reconnects >= 1
        steps, _ = truth(chunks)
        assert held(rec, "w") == (6, 6, steps, 0)
        # Its own again: another recorder with that id is still refused.
        with pytest.raises(WorkerIdInUseError):
            RolloutRecorder(target=server.address, session="back", worker_id="w")
        rec.close()
        # Left: the id is free for a new recorder, which resumes after the stored chunks.
        with RolloutRecorder(target=server.address, session="back", worker_id="w") as again:
            again.record(chunk(7))
            again.flush()
            assert held(again, "w")[:2] == (7, 7)
    finally:
        server.stop()


_HOLDER = textwrap.dedent(
    """
    import sys, numpy as np
    from recorder_client import RolloutRecorder
    rec = RolloutRecorder(target=sys.argv[1], session="gone", worker_id="w")
    rec.record({"action": np.zeros((4, 2), np.int32), "reward": np.zeros((4, 2), np.float32),
                "done": np.ones((4, 2), bool)})
    rec.flush()
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def test_a_killed_holders_id_is_kept_for_its_grace_then_free(server, monkeypatch):
    """The server holds a worker id whose stream ended for a grace period (a live holder
    reconnects within it), then gives it to the next recorder."""
    from recorder_server import identity

    monkeypatch.setattr(identity, "GRACE_S", 2.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, server.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        ended = time.monotonic()
        with pytest.raises(WorkerIdInUseError, match="without a stream") as refused:
            RolloutRecorder(
                target=server.address, session="gone", worker_id="w", connect_timeout=0.5
            )
        assert 0 < refused.value.retry_after <= 2.0
        assert time.monotonic() - ended < 2.0
        # Given the time, a new recorder waits out the grace and takes the id.
        with RolloutRecorder(target=server.address, session="gone", worker_id="w") as taker:
            assert time.monotonic() - ended >= 2.0
            taker.record(chunk(1))
            taker.flush()
            assert held(taker, "w")[:2] == (2, 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_drop_sticks_for_its_recorders_and_a_new_recorder_recreates_it(target):
    rec = RolloutRecorder(target=target, session="dropme", worker_id="w", reconnect_timeout=10)
    try:
        for i in range(3):
            rec.record(chunk(i))
        rec.flush()
        drop_session(target, "dropme")
        with pytest.raises(SessionDroppedError) as told:
            rec.record(chunk(3))
            rec.flush(timeout=10)
        message = str(told.value)
        assert "'dropme'" in message and "dropped at 20" in message
        time.sleep(0.5)  # a reconnect, if any, would have re-created it by now
        assert "dropme" not in [s.name for s in list_sessions(target)]
        with pytest.raises(SessionDroppedError):
            rec.flush(timeout=10)
        with RolloutRecorder(target=target, session="dropme", worker_id="w") as fresh:
            fresh.record(chunk(9))
            fresh.flush()
            steps, _ = truth([chunk(9)])
            assert held(fresh, "w") == (1, 1, steps, 0)
            assert fresh.status().sequences_lost == 0
        # Still refused after the session exists again.
        with pytest.raises(SessionDroppedError):
            rec.flush(timeout=10)
    finally:
        rec.close()


def test_a_claim_no_cause_explains_fails_the_worker_loudly(tmp_path):
    """Under --wal-fsync always every ack follows its fsync: a log that lost acknowledged
    chunks (here cut by hand at a record boundary, no torn tail) has no cause the server can
    name, so the worker's claim is refused, naming both numbers, instead of being counted
    as a power cut."""
    server = RestartableServer(tmp_path / "data", "--wal-fsync", "always").start()
    segment = lambda: sorted((tmp_path / "data" / "wal").glob("wal-*.log"))[-1]  # noqa: E731
    rec = RolloutRecorder(target=server.address, session="s", worker_id="w", reconnect_timeout=30)
    try:
        sizes = []
        for i in range(5):
            rec.record(chunk(i))
            rec.flush()
            sizes.append(segment().stat().st_size)
        server.kill()
        with open(segment(), "r+b") as fh:
            fh.truncate(sizes[2])  # chunks 4 and 5 gone
        server.start()
        rec.record(chunk(5))
        with pytest.raises(InvalidChunkError) as refused:
            rec.flush(timeout=30)
        assert "acked_sequence" in str(refused.value)
        assert "at most 3" in str(refused.value) and "got 5" in str(refused.value)
    finally:
        rec.close(timeout=5)
        server.stop()


@pytest.mark.parametrize("stop", ["checkpoint", "kill"])
def test_after_a_restart_the_worker_id_waits_for_its_holder_alone(tmp_path, stop):
    """The server keeps a digest of each holder's instance id in its checkpoint (a clean
    stop) and its log (a kill -9): after the restart a stranger that is quicker than the
    holder is refused, and the holder takes its id back."""
    server = RestartableServer(tmp_path / "data").start()
    chunks = [chunk(i) for i in range(4)]
    rec = RolloutRecorder(target=server.address, session="r", worker_id="w", reconnect_timeout=60)
    try:
        for c in chunks[:2]:
            rec.record(c)
        rec.flush()
        if stop == "kill":
            server.kill()
        else:
            server.stop()
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RecorderStub(channel)
            quick = pb.JoinRequest(
                session="r", config=_config(rec), worker_id="w", instance_id="stranger"
            )
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(quick, timeout=10)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "without a stream" in refused.value.details()
        for c in chunks[2:]:
            rec.record(c)
        rec.flush(timeout=60)
        steps, _ = truth(chunks)
        assert held(rec, "w") == (4, 4, steps, 0)
    finally:
        rec.close(timeout=5)
        server.stop()


def test_a_join_reports_its_loss_with_the_cause_the_fsync_policy_allows(target):
    """Under --wal-fsync batch (the default) a worker's first join in a server process may
    claim chunks the last stop lost: the reply names the cause and the range. Once it has
    joined this process, every ack it gets is held, so a higher claim is refused."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)

        def join(acked: int) -> pb.JoinReply:
            request = pb.JoinRequest(
                session="cause",
                config=pb.SessionConfig(),
                worker_id="w",
                acked_sequence=acked,
                instance_id="the-recorder",
            )
            return stub.Join(request, timeout=10)

        reply = join(5)
        assert reply.last_sequence == 0 and reply.HasField("loss")
        loss = reply.loss
        assert loss.cause == pb.LossReport.CAUSE_UNSYNCED_TAIL
        assert (loss.first_sequence, loss.last_sequence) == (1, 5)
        assert "--wal-fsync batch" in loss.detail
        assert not join(5).HasField("loss")  # nothing more is lost
        with pytest.raises(grpc.RpcError) as refused:
            join(7)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 5" in refused.value.details() and "got 7" in refused.value.details()


def test_dropped_sessions_are_remembered_within_bounds():
    from recorder_server.identity import Tombstones, proof

    stones = Tombstones(limit=3, members=10)
    for i in range(5):
        stones.add(f"s{i}", {proof(f"r{i}-{k}") for k in range(4)})
    # Two of 4 members fit in 10 at a time; the newest are kept.
    assert [stones.get(f"s{i}") is not None for i in range(5)] == [False] * 3 + [True] * 2
    with pytest.raises(Exception, match="'s4' was dropped at 20"):
        stones.check("s4", "r4-0")
    stones.check("s4", "someone-new")  # a new recorder may create it again
    stones.check("s0", "r0-0")  # forgotten


def test_tombstones_survive_a_round_trip_through_their_entries():
    """What a checkpoint would keep of the dropped sessions refuses the same recorders."""
    import json

    from recorder_server.identity import Tombstones, proof

    stones = Tombstones()
    stones.add("a", {proof("r1")}, 1000.0)
    stones.add("b", {proof("r2"), proof("r3")}, 2000.0)
    again = Tombstones()
    again.load(json.loads(json.dumps(stones.entries())) + [["bad", "x", []], 7])
    assert again.entries() == stones.entries()
    with pytest.raises(Exception, match="'b' was dropped at 1970-01-01 00:33:20 UTC"):
        again.check("b", "r3")
    again.check("a", "r2")


def handover_chunk(action: int, done_last: bool) -> dict:
    done = np.zeros((3, 2), bool)
    done[-1] = done_last
    return {
        "action": np.full((3, 2), action, np.int32),
        "reward": np.ones((3, 2), np.float32),
        "done": done,
    }


def pieces_by_env(out) -> dict[int, list[tuple]]:
    """Each env's episode pieces in time order: (actions seen, length, partial, done)."""
    got: dict[int, list[tuple]] = {}
    order = np.lexsort((out.episode_start, out.episode_env))
    for b in order:
        n = int(out.lengths[b])
        got.setdefault(int(out.episode_env[b]), []).append(
            (
                sorted(set(out.actions[b, :n].tolist())),
                n,
                str(out.episode_partial[b]),
                bool(out.episode_done[b]),
            )
        )
    return got


def test_a_worker_id_another_process_recorded_into_starts_new_episodes(target):
    """A replacement process (a restarted actor, its envs new) takes over a worker id whose
    episodes the one before left open: those end there (gap_after), and its steps start new
    episodes. A new recorder of the same process has the same envs: it continues them."""
    first = textwrap.dedent(
        """
        import sys
        import numpy as np
        from recorder_client import RolloutRecorder
        chunk = {
            "action": np.full((3, 2), 1, np.int32),
            "reward": np.ones((3, 2), np.float32),
            "done": np.zeros((3, 2), bool),
        }
        with RolloutRecorder(target=sys.argv[1], session="handover", worker_id="actor-3") as rec:
            rec.record(chunk)
        """
    )
    subprocess.run([sys.executable, "-c", first, target], check=True, timeout=120)
    with RolloutRecorder(target=target, session="handover", worker_id="actor-3") as rec:
        rec.record(handover_chunk(2, done_last=True))
        out = rec.finish(include_partial=True)
    for env_index in (0, 1):
        assert pieces_by_env(out)[env_index] == [([1], 3, "gap_after", False), ([2], 3, "", True)]

    # The same process again: one recorder leaves an episode open, the next continues it.
    for action, done_last in ((3, False), (4, True)):
        with RolloutRecorder(target=target, session="handover", worker_id="actor-3") as rec:
            rec.record(handover_chunk(action, done_last))
            out = rec.finish(include_partial=True)
    assert pieces_by_env(out)[0][-1] == ([3, 4], 6, "", True)
