"""Sequence gaps cut episodes: no episode is ever joined across chunks lost after their ack.

The truth is the test's own recording: every step a worker really took (lost chunks too),
walked step by step per environment, split at its done flags and at the holes. Each action
names its step on that real axis, so a returned row is checked step by step against it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import core_chunk
from test_durability import durable  # noqa: F401 - the fixture

from recorder_client import CellField, TrajectoryTrainingConfiguration, UtilityConfig
from recorder_client.trajectory import CORRUPT, GAP_AFTER, GAP_BEFORE, partial_name
from recorder_server.chunks import SessionConfig
from recorder_server.durability import snapshot
from recorder_server.errors import RequestError
from recorder_server.loss import LossCause, LossKind
from recorder_server.metrics import NullMetrics
from recorder_server.session import Session
from recorder_server.sessions import ServiceLimits, Sessions

CONFIG = SessionConfig(None, False, ())


def _real_chunks(rng, num_chunks: int, num_envs: int, density: float, worker: int):
    """(action, reward, done) of each chunk a worker takes; action = the step's id
    worker * 10**9 + real step * 1000 + env."""
    chunks, t = [], 0
    for _ in range(num_chunks):
        length = int(rng.integers(1, 7))
        steps = np.arange(t, t + length, dtype=np.int64)[:, None]
        action = worker * 10**9 + steps * 1000 + np.arange(num_envs, dtype=np.int64)[None, :]
        done = rng.random((length, num_envs)) < density
        chunks.append((action, rng.random((length, num_envs)).astype(np.float32), done))
        t += length
    return chunks


def _truth(chunks, lost: set[int], num_envs: int) -> list[tuple[tuple[int, ...], bool, int]]:
    """Every piece the recording holds, walked step by step: (action ids, done, flags)."""
    pieces = []
    for e in range(num_envs):
        current: list[int] = []
        flags, gap = 0, False
        for c, (action, _reward, done) in enumerate(chunks):
            if c in lost:
                if current:
                    pieces.append((tuple(current), False, flags | GAP_AFTER))
                current, flags, gap = [], 0, True
                continue
            for t in range(action.shape[0]):
                if not current:
                    flags = GAP_BEFORE if gap else 0
                    gap = False
                current.append(int(action[t, e]))
                if done[t, e]:
                    pieces.append((tuple(current), True, flags))
                    current = []
        if current:  # the open tail (a hole at the very end left none)
            pieces.append((tuple(current), False, flags))
    return pieces


def _expected(pieces, pad_incomplete: bool, include_partial: bool):
    out = []
    for ids, done, flags in pieces:
        if flags & GAP_BEFORE and not include_partial:
            continue
        if not done and (not pad_incomplete or not ids):
            continue
        out.append((ids, done, partial_name(flags)))
    return out


def _rows(plan) -> list[tuple[tuple[int, ...], bool, str]]:
    """Each row of an Assembly: its actions (real steps only), done and partial reason."""
    (spec,) = [f for f in plan.fields if f.name == "actions"]
    flat = np.concatenate([part for _f, _c, part in plan.field_parts(spec, 1 << 30)])
    ends = np.cumsum(plan.lengths)
    return [
        (
            tuple(int(a) for a in flat[end - n : end]),
            bool(plan.done[b]),
            partial_name(int(plan.partial[b])),
        )
        for b, (n, end) in enumerate(zip(plan.lengths.tolist(), ends.tolist(), strict=True))
    ]


def _record(session: Session, worker: str, chunks, lost: set[int], first: int = 0, join=None):
    """Send the chunks from index ``first`` on that are not lost; before each run after a
    hole, the worker joins again claiming the lost ones acknowledged (what a client does
    after a torn log tail). ``join(acked)``: how it joins (default: the session's)."""
    join = join or (lambda acked: session.join(worker, CONFIG, acked))
    claimed = 0
    for c in range(first, len(chunks)):
        if c in lost:
            claimed = c + 1
            continue
        if claimed:
            join(claimed)
            claimed = 0
        action, reward, done = chunks[c]
        arrays = {"action": action, "reward": reward, "done": done}
        session.apply(worker, core_chunk(c + 1, arrays))
    if claimed:
        join(claimed)


@pytest.mark.parametrize("seed", range(12))
def test_finish_returns_each_contiguous_piece_marked_never_one_across_a_hole(seed):
    """Random done patterns, random holes (at the start, in the middle, several, at the end):
    finish() under each option returns exactly the pieces the step-by-step walk finds."""
    rng = np.random.default_rng(seed)
    session = Session("s", CONFIG, NullMetrics())
    truth = []
    try:
        for w in range(2):
            num_envs = int(rng.integers(1, 5))
            chunks = _real_chunks(rng, int(rng.integers(3, 12)), num_envs, [0.05, 0.3][w], w)
            lost = {c for c in range(len(chunks)) if rng.random() < 0.25} if w == 0 else set()
            if seed == 0:
                lost = {0, 1}  # a hole before anything held
            session.join(f"w{w}", CONFIG)
            _record(session, f"w{w}", chunks, lost)
            truth.append(_truth(chunks, lost, num_envs))
        for pad in (False, True):
            for partial in (False, True):
                want = [p for t in truth for p in _expected(t, pad, partial)]
                if not want:
                    continue
                got = _rows(session.assemble(pad, partial))
                assert got == want, (pad, partial)
    finally:
        session.close()


def test_a_hole_ends_the_episode_before_it_and_hides_the_start_of_the_one_after():
    """One env, chunks 1..3 of 4 steps; chunk 2 lost. Real episode: steps 0..9 (done at 9).
    Held: steps 0..3 (before the hole) and 8..11; the done at step 9 ends a piece 8..9 whose
    start is unknown, then 10..11 is an ordinary open tail."""
    session = Session("s", CONFIG, NullMetrics())
    try:
        session.join("w", CONFIG)
        done = np.zeros((12, 1), dtype=bool)
        done[9, 0] = True
        action = np.arange(12, dtype=np.int64)[:, None]
        reward = np.zeros((12, 1), np.float32)
        chunks = [(action[i : i + 4], reward[i : i + 4], done[i : i + 4]) for i in (0, 4, 8)]
        _record(session, "w", chunks, {1})
        assert session.status().sequences_lost == 1
        with pytest.raises(RequestError, match="No complete episodes"):
            session.assemble(False, False)  # no whole episode
        assert _rows(session.assemble(True, True)) == [
            ((0, 1, 2, 3), False, "gap_after"),
            ((8, 9), True, "gap_before"),
            ((10, 11), False, ""),
        ]
        assert _rows(session.assemble(True, False)) == [
            ((0, 1, 2, 3), False, "gap_after"),
            ((10, 11), False, ""),
        ]
    finally:
        session.close()


def test_the_cut_survives_log_replay_and_a_checkpoint():
    """A gap accepted live is cut the same after replaying the log, and after restoring a
    checkpoint of the session (then recording on)."""
    rng = np.random.default_rng(3)
    log: list[bytes] = []
    limits = ServiceLimits(max_sessions=4)
    live = Sessions(limits, NullMetrics(), journal=lambda parts: log.append(b"".join(parts)))
    chunks = _real_chunks(rng, 10, 3, 0.2, 0)
    lost = {3, 4, 7}
    try:
        session, _ = live.join("run", CONFIG, "w")
        # What recovery records after a torn log tail: it explains the claims below.
        session.loss_causes.append(LossCause(LossKind.TORN_TAIL, "chunks lost in this test"))

        def join(acked):
            live.join("run", CONFIG, "w", acked)

        _record(session, "w", chunks[:6], lost, join=join)
        meta, blobs = snapshot.session_state(session)
        _record(session, "w", chunks, lost, 6, join=join)
        want = _expected(_truth(chunks, lost, 3), True, True)
        assert _rows(session.assemble(True, True)) == want
        replayed = Sessions(limits, NullMetrics())
        for record in log:
            replayed.replay(record)
        assert _rows(replayed.get("run").assemble(True, True)) == want
        replayed.close()
        restored = Session("run", snapshot.session_config(meta), NullMetrics())
        snapshot.restore_session(restored, meta, snapshot.unpack(snapshot.pack(meta, blobs))[1])
        restored.active.add("w")
        _record(restored, "w", chunks, lost, 6)
        assert _rows(restored.assemble(True, True)) == want
        assert _rows(restored.assemble(False, False)) == _expected(
            _truth(chunks, lost, 3), False, False
        )
        restored.close()
    finally:
        live.close()


def test_a_refused_chunk_is_a_hole_and_a_replay_takes_its_sequence():
    """A chunk the server refuses after taking its sequence (here: another action dtype)
    is a hole in the worker's steps, as lost chunks are; the log says so, so that a replay
    takes the sequence and the chunks behind it too. So does a chunk dropped on a full
    session, across a reset."""
    rng = np.random.default_rng(9)
    log: list[bytes] = []
    limits = ServiceLimits(max_sessions=4)
    live = Sessions(limits, NullMetrics(), journal=lambda parts: log.append(b"".join(parts)))
    chunks = _real_chunks(rng, 8, 3, 0.25, 0)
    refused = {2, 5}
    try:
        session, _ = live.join("run", CONFIG, "w")
        for c, (action, reward, done) in enumerate(chunks):
            sent = action.astype(np.int32) if c in refused else action
            arrays = {"action": sent, "reward": reward, "done": done}
            if c in refused:
                with pytest.raises(RequestError, match="chunk.action.dtype"):
                    session.apply("w", core_chunk(c + 1, arrays))
            else:
                session.apply("w", core_chunk(c + 1, arrays))
        want = _expected(_truth(chunks, refused, 3), True, True)
        assert _rows(session.assemble(True, True)) == want
        full, _ = live.join("full", SessionConfig(1, False, ()), "w")
        one = {"action": chunks[0][0], "reward": chunks[0][1], "done": np.ones((2, 3), bool)}
        one = {k: v[:2] for k, v in one.items()}
        full.apply("w", core_chunk(1, one))
        full.apply("w", core_chunk(2, one))  # dropped: the session is full
        full.reset()
        full.apply("w", core_chunk(3, one))
        replayed = Sessions(limits, NullMetrics())
        for record in log:
            replayed.replay(record)  # raises on a record that does not apply
        assert _rows(replayed.get("run").assemble(True, True)) == want
        assert replayed.get("full").status() == full.status()
        replayed.close()
    finally:
        live.close()


def test_rows_over_a_corrupt_chunk_are_marked():
    """A chunk whose action frame fails its proof after the ack: the rows that read it are
    marked corrupt, the others stay whole."""
    session = Session("s", CONFIG, NullMetrics())
    try:
        session.join("w", CONFIG)
        done = np.zeros((9, 2), dtype=bool)
        done[[2, 5, 8], 0] = True
        done[8, 1] = True
        action = np.arange(18, dtype=np.int64).reshape(9, 2)
        reward = np.zeros((9, 2), np.float32)
        for i, t in enumerate((0, 3, 6)):
            arrays = {"action": action[t : t + 3], "reward": reward[t : t + 3]}
            session.apply("w", core_chunk(i + 1, {**arrays, "done": done[t : t + 3]}))
        middle = session.workers["w"].chunks[1]
        middle.corrupt = ("chunk 2 of worker 'w' was acknowledged, but its action frame ...",)
        plan = session.assemble(False)
        plan.mark_corrupt()
        # Env 0: 0..2, 3..5 (reads chunk 2), 6..8; env 1: 0..8 (reads chunk 2).
        assert [partial_name(int(f)) for f in plan.partial] == ["", "corrupt", "", "corrupt"]
        assert int(plan.partial[1]) == CORRUPT
    finally:
        session.close()


# -- a real server: acknowledged chunks lost to a torn log tail ----------------------------

N_ENVS = 3
FIELDS = ["player_positions", "player_inventory"]
STORE = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0, 0), bucket=4, name="x"),
        CellField("player_positions", (0, 1), bucket=1, name="env"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.9),),
)


def _server_chunks(worker: int, count: int, seed: int):
    """(action ids, reward, done, positions) per chunk: positions name the step and env."""
    rng = np.random.default_rng(seed)
    out = []
    for action, reward, done in _real_chunks(rng, count, N_ENVS, 0.15, worker):
        steps = (action % 10**9) // 1000
        positions = np.stack([steps % 40, action % 1000], axis=-1)[:, :, None, :].astype(np.int32)
        out.append((action, reward, done, positions))
    return out


def _send(rec, chunk) -> None:
    action, reward, done, positions = chunk
    rec.record({"action": action, "reward": reward, "done": done}, {"player_positions": positions})


def _pieces(traj) -> list[tuple[tuple[int, ...], bool, str]]:
    return [
        (tuple(int(a) for a in traj.actions[b, :n]), bool(traj.episode_done[b]), str(p))
        for b, (n, p) in enumerate(zip(traj.lengths.tolist(), traj.episode_partial.tolist()))
    ]


def test_a_torn_log_tail_that_lost_acknowledged_chunks_joins_no_episode(durable, tmp_path):  # noqa: F811
    """Worker w0's chunks 8..10 are acknowledged, then lost: kill -9 and the log's tail cut
    in chunk 8's record. Its recorder reconnects, claims 10 and records 11..20. finish(),
    the dataset (read_episodes) and the store (sample_start, the archive) hold no episode
    that did not happen, and every episode clear of the hole whole."""
    from recorder_client import RolloutRecorder, read_episodes

    first = durable().start()
    w1, w0 = _server_chunks(1, 5, 11), _server_chunks(0, 20, 12)
    kw = dict(session="g", record_states=True, state_fields=["player_positions"], capture=STORE)
    with RolloutRecorder(target=first.address, worker_id="w1", **kw) as rec:
        for chunk in w1:
            _send(rec, chunk)
    wal = first.data_dir / "wal"
    sizes = []
    rec = RolloutRecorder(
        target=first.address,
        worker_id="w0",
        reconnect_timeout=60,
        on_data_loss="continue",
        **kw,
    )
    try:
        for chunk in w0[:10]:
            _send(rec, chunk)
            rec.flush()
            sizes.append(sorted(wal.glob("wal-*.log"))[-1].stat().st_size)
        first.kill9()
        last = sorted(wal.glob("wal-*.log"))[-1]
        assert last.stat().st_size == sizes[-1]
        with open(last, "r+b") as fh:
            fh.truncate(sizes[6] + 10)  # mid-way through chunk 8's record
        dataset = tmp_path / "dataset"
        second = durable(
            "--dataset-uri", str(dataset), "--dataset-flush-seconds", "0.5", port=first.port
        ).start()
        for chunk in w0[10:]:
            _send(rec, chunk)
        rec.flush()
        status = rec.status()
        assert status.sequences_lost == 3 and status.chunks_stored == 5 + 7 + 10
        lost = {7, 8, 9}
        truth = [
            _truth([c[:3] for c in w1], set(), N_ENVS),
            _truth([c[:3] for c in w0], lost, N_ENVS),
        ]
        for pad, partial in ((False, False), (True, True), (True, False)):
            want = [p for t in truth for p in _expected(t, pad, partial)]
            assert _pieces(rec.finish(pad, include_partial=partial)) == want, (pad, partial)
        whole = {p[0][0]: p[0] for t in truth for p in t if p[1] and not p[2]}
        for _ in range(60):
            sampled = rec.capture.sample_start()
            assert sampled is not None
            prefix = tuple(int(a) for a in sampled[1].actions)
            assert whole.get(prefix[0], ())[: len(prefix)] == prefix, prefix
        visits = int(rec.capture.archive().visits.sum())
        assert visits == sum(len(ids) for ids in whole.values())
    finally:
        rec.close()
    assert second.stop() == 0
    want = [p for t in truth for p in _expected(t, False, False)]
    assert _pieces(read_episodes(str(dataset), "g")) == want
    marked = [p for t in truth for p in _expected(t, False, True)]
    assert _pieces(read_episodes(str(dataset), "g", include_partial=True)) == marked
    assert any(p[2] == "gap_before" for p in marked)


def test_episodes_over_a_corrupt_chunk_are_marked_or_left_out_everywhere(durable, tmp_path):  # noqa: F811
    """Chunk 2 of 6 is acknowledged on its frame headers, and its inventory frame (a state
    field the store does not key cells on, so not decoded before the ack) does not decode.
    A restart (SIGTERM: a checkpoint) comes after chunk 4, and env 0's episode from chunk 1
    ends in chunk 5. finish() names the chunk and marks the rows that read it; the dataset
    marks them "corrupt" (read_episodes leaves them out by default); the store holds none."""
    from test_verify_frames import broken_frame

    from recorder_client import RolloutRecorder, read_episodes
    from recorder_client._credentials import make_channel
    from recorder_client._messages import array_to_proto
    from recorder_client._proto import recorder_pb2 as pb
    from recorder_client._proto import recorder_pb2_grpc as pb_grpc

    dataset = tmp_path / "dataset"
    server = durable("--dataset-uri", str(dataset), "--dataset-flush-seconds", "0.5").start()
    rng = np.random.default_rng(5)
    length, chunks, msgs = 16, [], []
    for c in range(6):
        steps = np.arange(c * length, (c + 1) * length, dtype=np.int64)[:, None]
        action = steps * 1000 + np.arange(N_ENVS, dtype=np.int64)[None, :]
        done = rng.random((length, N_ENVS)) < 0.12
        done[:, 0] = c == 4 and np.arange(length) == 3  # env 0: one episode over chunks 1..5
        reward = rng.random((length, N_ENVS)).astype(np.float32)
        positions = np.stack([steps % 40 + 0 * action, action % 1000], axis=-1)[:, :, None, :]
        chunks.append((action, reward, done))
        msg = pb.Chunk(sequence=c + 1)
        msg.action.CopyFrom(array_to_proto(action, pack=True))
        msg.reward.CopyFrom(array_to_proto(reward))
        msg.done.CopyFrom(array_to_proto(done))
        pos = array_to_proto(positions.astype(np.int32), pack=True)
        msg.states.append(pb.NamedArray(name="player_positions", array=pos))
        inventory = np.repeat(action[:, :, None] % 7, 8, axis=2).astype(np.int32)
        inv = broken_frame(inventory) if c == 1 else array_to_proto(inventory, pack=True)
        msg.states.append(pb.NamedArray(name="player_inventory", array=inv))
        msgs.append(msg)
    config = pb.SessionConfig(
        record_states=True,
        state_fields=FIELDS,
        capture_config_json=json.dumps(STORE.to_dict(), sort_keys=True),
    )
    for part in (msgs[:4], msgs[4:]):
        with make_channel(server.address) as channel:
            stub = pb_grpc.RecorderStub(channel)
            stub.Join(pb.JoinRequest(session="c", config=config, worker_id="w"), timeout=10)
            opening = pb.RecordRequest(open=pb.RecordOpen(session="c", worker_id="w"))
            acks = list(stub.Record(iter([opening, *(pb.RecordRequest(chunk=m) for m in part)])))
            assert all(a.result == pb.RecordAck.STORED for a in acks), acks
        if part is not msgs[4:]:  # a checkpoint holds the open episodes and the store
            assert server.stop() == 0
            server.start()
    bad = range(length * 1000, 2 * length * 1000)  # the ids of chunk 2's steps
    finished = [p for p in _truth(chunks, set(), N_ENVS) if p[1]]
    over = [any(i in bad for i in ids) for ids, _done, _flags in finished]
    marked = [(ids, True, "corrupt" if o else "") for (ids, _, _), o in zip(finished, over)]
    whole = [m for m, o in zip(marked, over) if not o]
    assert any(over) and whole
    kw = dict(session="c", record_states=True, state_fields=FIELDS, capture=STORE)
    with RolloutRecorder(target=server.address, on_data_loss="continue", **kw) as rec:
        out = rec.finish(pad_incomplete=False)
        assert out.num_corrupt_chunks == 1 and "chunk 2 of worker 'w'" in out.corrupt_chunks[0]
        assert _pieces(out) == marked
        _inventory_zero_exactly_in_chunk_2(out, bad)
        starts = {ids[0]: ids for ids, _done, _reason in whole}
        for _ in range(30):
            sampled = rec.capture.sample_start()
            assert sampled is not None
            prefix = tuple(int(a) for a in sampled[1].actions)
            assert starts.get(prefix[0], ())[: len(prefix)] == prefix, prefix
        visits = int(rec.capture.archive().visits.sum())
        assert visits == sum(len(ids) for ids, _done, _reason in whole)
    assert server.stop() == 0
    assert _pieces(read_episodes(str(dataset), "c")) == whole
    written = read_episodes(str(dataset), "c", include_partial=True)
    assert _pieces(written) == marked
    _inventory_zero_exactly_in_chunk_2(written, bad)


def _inventory_zero_exactly_in_chunk_2(traj, bad: range) -> None:
    """The rows hold the inventory recorded (action id % 7), zeros on chunk 2's steps."""
    for b, n in enumerate(traj.lengths.tolist()):
        ids = traj.actions[b, :n]
        want = np.where((ids >= bad.start) & (ids < bad.stop), 0, ids % 7)
        assert (traj.player_inventory[b, :n] == want[:, None]).all(), b
