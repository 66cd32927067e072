"""Recovery never discards an intact acknowledged record: checkpoints kept after drops, a
fallback past a corrupt newest checkpoint, log records of sessions a checkpoint does not
know. Against real `rollout-recorder serve` processes, killed with SIGKILL."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
from conftest import RestartableServer
from reference_model import ReferenceRecorder

from recorder_client import (
    RecorderUnavailableError,
    RolloutRecorder,
    SessionDroppedError,
    drop_session,
    list_sessions,
)


def chunk(rng: np.random.Generator) -> dict:
    return {
        "action": rng.integers(0, 12, (8, 3)).astype(np.int32),
        "reward": rng.random((8, 3)).astype(np.float32),
        "done": rng.random((8, 3)) < 0.2,
    }


def expected(chunks: list[dict]) -> dict:
    ref = ReferenceRecorder()
    for c in chunks:
        ref.record(c)
    return ref.finish()


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def sessions_after_restart(target: str) -> list[dict]:
    """list_sessions() once the restarted server answers (a channel that saw the old one
    go may be in its reconnect backoff for a moment)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return list_sessions(target)
        except RecorderUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def checkpoints(data_dir):
    return sorted((data_dir / "checkpoints").glob("ckpt-*.rrc"))


def test_drop_then_corrupt_newest_checkpoint_keeps_every_acknowledged_chunk(tmp_path):
    """Failure #5: B dropped, A records 10 chunks, kill -9, one flipped byte in the newest
    checkpoint. A keeps every acknowledged chunk and B stays dropped."""
    data = tmp_path / "data"
    server = RestartableServer(data, "--checkpoint-every", "0").start()
    rng = np.random.default_rng(5)
    recorded: list[dict] = []
    try:
        a = RolloutRecorder(target=server.address, session="keep-a", worker_id="a")
        with RolloutRecorder(target=server.address, session="gone-b", worker_id="b") as b:
            for _ in range(3):
                b.record(chunk(rng))
        for _ in range(2):
            recorded.append(chunk(rng))
            a.record(recorded[-1])
        a.flush()
        drop_session(server.address, "gone-b")
        for _ in range(10):
            recorded.append(chunk(rng))
            a.record(recorded[-1])
        a.flush()  # every chunk acknowledged
        server.kill()
        kept = checkpoints(data)
        assert len(kept) >= 2, kept
        flip_byte(kept[-1])
        server.start()
        log = server.log()
        assert f"skipped checkpoint {kept[-1]}" in log
        assert "expected a session that was joined" not in log
        assert sorted(s["name"] for s in sessions_after_restart(server.address)) == ["keep-a"]
        status = a.status()
        assert status.chunks_stored == 12 and status.sequences_lost == 0
        out = a.finish()
        truth = expected(recorded)
        assert out.actions.tobytes() == truth["actions"].tobytes()
        assert out.rewards.tobytes() == truth["rewards"].tobytes()
        assert out.lengths.tolist() == truth["lengths"].tolist()
        a.close()
        server.kill()
        # Nothing of the dropped session is on disk, in any checkpoint or log segment.
        assert not any(b"gone-b" in p.read_bytes() for p in data.rglob("*") if p.is_file())
    finally:
        server.stop()


def run_in_process(data, **durability):
    from recorder_server.app import ServerOptions, start_server
    from recorder_server.durability import DurabilityOptions

    return start_server(
        ServerOptions(
            listen="127.0.0.1:0", data_dir=str(data), durability=DurabilityOptions(**durability)
        )
    )


def test_two_checkpoints_and_the_log_behind_the_older_are_kept(tmp_path):
    data = tmp_path / "data"
    server = run_in_process(data)
    rng = np.random.default_rng(1)
    try:
        with RolloutRecorder(target=server.address, session="s", worker_id="w") as rec:
            for round_ in range(4):
                rec.record(chunk(rng))
                rec.flush()
                path, cut = server.durability.checkpoint(server.sessions)
                steps = [step for step, _ in server.durability.checkpoints.checkpoints()]
                assert steps[-1] == cut and len(steps) == min(round_ + 1, 3)
                segments = sorted((data / "wal").glob("wal-*.log"))
                first = int(segments[0].name[4:20])
                # The log reaches back to the oldest kept checkpoint (to 0 while only one is).
                assert first <= (steps[0] if len(steps) >= 2 else 0)
    finally:
        server.stop(checkpoint=False)


def test_records_of_a_session_no_checkpoint_holds_are_reported_with_their_sequences(tmp_path):
    """Both copies of the checkpoint written at a drop are corrupt, and the log before it is
    gone: the later chunk records of a session the checkpoint held cannot be replayed. They
    are named, session, worker and sequences, never dropped in silence."""
    data = tmp_path / "data"
    server = run_in_process(data)
    rng = np.random.default_rng(2)
    try:
        rec = RolloutRecorder(target=server.address, session="keep-a", worker_id="a")
        rec.record(chunk(rng))
        rec.flush()
        with RolloutRecorder(target=server.address, session="gone-b", worker_id="b") as b:
            b.record(chunk(rng))
        drop_session(server.address, "gone-b")
        for _ in range(4):
            rec.record(chunk(rng))
        rec.flush()
        rec.close()
    finally:
        server.stop(checkpoint=False)
    for path in checkpoints(data):
        flip_byte(path)
    server = run_in_process(data)
    try:
        lines = server.recovery.lines()
        assert server.sessions.all() == []
        assert any(
            "not replayed: 4 chunk record(s) of session 'keep-a', worker 'a' (sequences 2..5)"
            in line
            for line in lines
        ), lines
        assert any("records 0.." in line and "are gone" in line for line in lines), lines
    finally:
        server.stop(checkpoint=False)


def test_a_torn_tail_is_recorded_as_a_loss_cause_that_outlives_a_restart(tmp_path):
    """The torn record's first bytes name its session, worker and sequence: the cause goes
    on that worker, from that sequence, and is kept by the checkpoint written at once."""
    from recorder_server.loss import LossCause, LossKind

    data = tmp_path / "data"
    server = run_in_process(data, fsync="always")
    rng = np.random.default_rng(3)
    rec = RolloutRecorder(
        target=server.address, session="s", worker_id="w", reconnect_timeout=1, connect_timeout=1
    )
    for _ in range(3):
        rec.record(chunk(rng))
    rec.flush()
    server.stop(0, checkpoint=False)
    with contextlib.suppress(RecorderUnavailableError):
        rec.close(timeout=1)
    (segment,) = sorted((data / "wal").glob("wal-*.log"))
    size = segment.stat().st_size
    with open(segment, "r+b") as fh:
        fh.truncate(size - 3)  # the last record, chunk 3, only in part
    server = run_in_process(data)
    try:
        (session,) = server.sessions.all()
        offset = server.recovery.dropped_offset
        detail = (
            f"a torn log tail of {size - 3 - offset} bytes at offset {offset} of {segment.name}"
        )
        assert session.loss_causes == [LossCause(LossKind.TORN_TAIL, detail, "w", 3)]
        assert session.last_sequence["w"] == 2
        assert "a C record of session 's', worker 'w'" in "\n".join(server.recovery.lines())
        assert server.recovery.loss_checkpoint is not None
    finally:
        server.stop(checkpoint=False)
    server = run_in_process(data)  # from the checkpoint written at recovery
    try:
        (session,) = server.sessions.all()
        assert session.loss_causes == [LossCause(LossKind.TORN_TAIL, detail, "w", 3)]
        assert "dropped a torn log tail" not in "\n".join(server.recovery.lines())
    finally:
        server.stop(checkpoint=False)


def test_a_torn_record_that_held_no_chunk_costs_nothing(tmp_path):
    data = tmp_path / "data"
    server = run_in_process(data, fsync="always")
    with RolloutRecorder(target=server.address, session="s", worker_id="w") as rec:
        rec.record(chunk(np.random.default_rng(4)))
    late = RolloutRecorder(
        target=server.address, session="s", worker_id="w2", reconnect_timeout=1, connect_timeout=1
    )
    server.stop(0, checkpoint=False)  # the log ends with w2's join
    with contextlib.suppress(RecorderUnavailableError):
        late.close(timeout=1)
    (segment,) = sorted((data / "wal").glob("wal-*.log"))
    with open(segment, "r+b") as fh:
        fh.truncate(segment.stat().st_size - 1)
    server = run_in_process(data)
    try:
        (session,) = server.sessions.all()
        assert session.loss_causes == []
        assert session.chunks_stored == 1
        assert "a J record of session 's', worker 'w2'" in "\n".join(server.recovery.lines())
    finally:
        server.stop(checkpoint=False)


def test_a_drop_sticks_for_its_recorders_after_a_restart(tmp_path):
    """The checkpoint written at the drop keeps its tombstone: after a kill -9 and a
    restart, the dropped session's recorder is still refused and does not re-create it."""
    server = RestartableServer(tmp_path / "data", "--checkpoint-every", "0").start()
    rng = np.random.default_rng(6)
    rec = RolloutRecorder(
        target=server.address, session="gone", worker_id="w", reconnect_timeout=30
    )
    try:
        rec.record(chunk(rng))
        rec.flush()
        drop_session(server.address, "gone")
        server.kill()
        server.start()
        with pytest.raises(SessionDroppedError) as told:
            rec.record(chunk(rng))
            rec.flush(timeout=30)
        assert "'gone'" in str(told.value)
        assert sessions_after_restart(server.address) == []
    finally:
        with contextlib.suppress(SessionDroppedError):
            rec.close(timeout=5)
        server.stop()


def test_a_replayed_drop_leaves_a_tombstone():
    """A drop whose checkpoint was never written is replayed from the log: its recorders
    are refused all the same."""
    from recorder_server.chunks import SessionConfig
    from recorder_server.errors import RequestError
    from recorder_server.identity import proof
    from recorder_server.metrics import NullMetrics
    from recorder_server.sessions import ServiceLimits, Sessions

    log: list[bytes] = []
    live = Sessions(
        ServiceLimits(), NullMetrics(), journal=lambda parts: log.append(b"".join(parts))
    )
    config = SessionConfig(None, False, ())
    live.join("gone", config, "w", instance="recorder-1")
    live.drop("gone")
    replayed = Sessions(ServiceLimits(), NullMetrics())
    for record in log:
        replayed.replay(record)
    assert replayed.all() == []
    stone = replayed.tombstones.get("gone")
    assert stone is not None and proof("recorder-1") in stone.instances
    with pytest.raises(RequestError, match="'gone' was dropped"):
        replayed.join("gone", config, "w", instance="recorder-1")
    live.close()
    replayed.close()
