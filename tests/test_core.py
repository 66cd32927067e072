"""The core without gRPC: episode splitting, Session, the registry and its log records.

Every expected value here is worked out by hand from the chunks the test builds.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import core_chunk

from recorder_server.chunks import Chunk, SessionConfig
from recorder_server.durability import records
from recorder_server.episodes import NO_DATA_MESSAGE, NO_EPISODES_MESSAGE, WorkerTimeline
from recorder_server.errors import ErrorKind, RequestError
from recorder_server.metrics import NullMetrics
from recorder_server.session import Applied, Session
from recorder_server.sessions import ServiceLimits, Sessions

SERVER = Path(__file__).resolve().parents[1] / "server"
# The core: everything but the gRPC edge, the command line and the metrics sinks.
CORE = [
    "chunks",
    "episodes",
    "errors",
    "session",
    "session_proofs",
    "session_store",
    "sessions",
    "workload",
    "ingest",
    "store",
    "durability",
]


def _chunk(sequence: int, action, reward, done, **states) -> Chunk:
    arrays = {"action": action, "reward": reward, "done": done}
    return core_chunk(sequence, {**arrays, **{f"state:{k}": v for k, v in states.items()}})


def _dones(length: int, n: int, at: list[tuple[int, int]]) -> np.ndarray:
    done = np.zeros((length, n), dtype=bool)
    for t, e in at:
        done[t, e] = True
    return done


def _simple(sequence: int, length: int, n: int, at, *, dtype=np.int32, first=0) -> Chunk:
    action = (first + np.arange(length * n, dtype=np.int64).reshape(length, n)).astype(dtype)
    return _chunk(sequence, action, np.ones((length, n), np.float32), _dones(length, n, at))


# -- imports -----------------------------------------------------------------------------------


def _core_modules() -> list[str]:
    names = []
    for name in CORE:
        path = SERVER / name
        if path.is_dir():
            names += [f"recorder_server.{name}.{p.stem}" for p in sorted(path.glob("*.py"))]
        else:
            names.append(f"recorder_server.{name}")
    return [n.removesuffix(".__init__") for n in names]


def test_the_core_imports_neither_grpc_nor_protobuf():
    """Loading every core module (and whatever they import) loads no grpc and no protobuf."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {[m for m in _core_modules() if not m.endswith('__main__')]!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'google', 'grpc_health', 'grpc_reflection') or '_proto' in m)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_no_core_source_names_grpc_or_protobuf():
    """The same, read from the sources: no core module has an import of them."""
    for module in _core_modules():
        path = SERVER.joinpath(*module.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            for name in names:
                assert not name.startswith(("grpc", "google")), (path, name)
                assert "_proto" not in name and "rpc" not in name.split("."), (path, name)


# -- episodes ----------------------------------------------------------------------------------


def test_a_timeline_splits_chunks_at_done_flags_and_owns_the_open_starts():
    tl = WorkerTimeline("w", 0)
    env, start, end, _ = tl.add_chunk(_dones(4, 2, [(1, 0)]), {}, 0)
    assert (env.tolist(), start.tolist(), end.tolist()) == ([0], [0], [2])
    assert tl.open_start.tolist() == [2, 0] and tl.oldest_open() == 0
    # Steps 4..6: env 0 ends at 4, env 1 at 6 (its first episode, from step 0).
    env, start, end, _ = tl.add_chunk(_dones(3, 2, [(0, 0), (2, 1)]), {}, 0)
    assert (env.tolist(), start.tolist(), end.tolist()) == ([0, 1], [2, 0], [5, 7])
    assert tl.open_start.tolist() == [5, 7] and tl.oldest_open() == 5
    assert tl.t_total == 7 and tl.episodes_finished == 3
    env, start, end, done, _ = tl.episodes(pad_incomplete=True)
    # Env by env; env 0's tail (steps 5, 6) is kept, env 1's is empty and was finished.
    assert env.tolist() == [0, 0, 0, 1]
    assert start.tolist() == [0, 2, 5, 0] and end.tolist() == [2, 5, 7, 7]
    assert done.tolist() == [True, True, False, True]
    env, start, end, done, _ = tl.episodes(pad_incomplete=False)
    assert (env.tolist(), start.tolist(), end.tolist()) == ([0, 0, 1], [0, 2, 0], [2, 5, 7])


@pytest.mark.parametrize("density", [0.0, 1 / 500, 1 / 40, 1 / 20, 0.5, 1.0])
def test_a_timeline_lists_episodes_env_by_env_at_any_share_of_done_flags(density):
    """Sparse and dense done flags give the same episodes, env by env and in time order, as
    walking each env's flags."""
    rng = np.random.default_rng(7)
    tl = WorkerTimeline("w", 0)
    num_envs, opened = 9, [0] * 9
    for c in range(3):
        dones = rng.random((64, num_envs)) < density
        env, start, end, _ = tl.add_chunk(dones, {}, 0)
        want = []
        for e in range(num_envs):
            for t in np.flatnonzero(dones[:, e]).tolist():
                want.append((e, opened[e], c * 64 + t + 1))
                opened[e] = c * 64 + t + 1
        assert list(zip(env.tolist(), start.tolist(), end.tolist(), strict=True)) == want
        assert env.dtype == start.dtype == end.dtype == np.int64
    assert tl.open_start.tolist() == opened


def test_an_environment_that_never_finished_keeps_its_empty_tail():
    """The in-process rule: a tail is kept when the env never finished, even if empty."""
    tl = WorkerTimeline("w", 0)
    tl.add_chunk(_dones(2, 2, [(1, 1)]), {}, 0)
    env, start, end, done, _ = tl.episodes(pad_incomplete=True)
    assert (env.tolist(), start.tolist(), end.tolist(), done.tolist()) == (
        [0, 1],
        [0, 0],
        [2, 2],
        [False, True],
    )


# -- Session -----------------------------------------------------------------------------------


def _session(max_episodes=None, **kw) -> Session:
    return Session("s", SessionConfig(max_episodes, False, ()), NullMetrics(), **kw)


def test_workers_join_in_order_and_a_different_configuration_is_refused():
    session = _session(max_workers=2)
    try:
        assert session.join("a", session.config)[0].index == 0
        assert session.join("b", session.config)[0].index == 1
        assert session.join("a", session.config)[0].index == 0  # a rejoin keeps its place
        other = SessionConfig(5, False, ())
        with pytest.raises(RequestError) as caught:
            session.join("c", other)
        assert caught.value.kind == ErrorKind.SESSION_MISMATCH
        assert "max_episodes=None (this worker asked for 5)" in str(caught.value)
        with pytest.raises(RequestError) as caught:
            session.join("c", session.config)
        assert caught.value.kind == ErrorKind.LIMIT
        with pytest.raises(RequestError) as caught:
            session.apply("nobody", _simple(1, 2, 2, []))
        assert caught.value.kind == ErrorKind.NOT_JOINED
    finally:
        session.close()


def test_sequences_duplicates_gaps_and_a_refused_chunk():
    session = _session()
    session.join("w", session.config)
    try:
        assert session.apply("w", _simple(1, 3, 2, [(1, 0)])) == Applied.STORED
        assert session.apply("w", _simple(1, 3, 2, [(1, 0)])) == Applied.DUPLICATE
        with pytest.raises(RequestError) as caught:
            session.apply("w", _simple(3, 3, 2, []))
        assert caught.value.kind == ErrorKind.SEQUENCE_GAP
        assert "chunk.sequence: expected 2 for worker 'w', got 3" in str(caught.value)
        # A chunk refused for its content still takes its sequence number.
        with pytest.raises(RequestError) as caught:
            session.apply("w", _simple(2, 3, 2, [], dtype=np.int64))
        assert caught.value.kind == ErrorKind.INVALID
        assert "chunk.action.dtype: expected int32" in str(caught.value)
        assert "got int64" in str(caught.value)
        with pytest.raises(RequestError, match=r"chunk.N: expected 2 environments.*got 3"):
            session.apply("w", _simple(3, 3, 3, []))
        assert session.apply("w", _simple(4, 2, 2, [(0, 1)])) == Applied.STORED
        status = session.status()
        assert status.num_recorded_steps == 5 and status.chunks_stored == 2
        assert status.episodes_finished == 2
        (worker,) = status.workers
        assert (worker.last_sequence, worker.steps, worker.num_envs) == (4, 5, 2)
    finally:
        session.close()


def test_a_full_session_drops_chunks_and_reset_starts_again():
    session = _session(max_episodes=2)
    session.join("w", session.config)
    try:
        assert session.apply("w", _simple(1, 2, 2, [(0, 0), (1, 1)])) == Applied.STORED
        assert session.is_full
        assert session.apply("w", _simple(2, 2, 2, [(0, 0)])) == Applied.DROPPED_FULL
        status = session.status()
        assert (status.chunks_stored, status.chunks_dropped, status.is_full) == (1, 1, True)
        session.reset()
        status = session.status()
        assert (status.chunks_stored, status.num_recorded_steps, status.is_full) == (0, 0, False)
        assert status.workers[0].worker_id == "w" and status.max_episodes == 2
        # Sequence numbers go on: a resend of an old chunk stays a duplicate.
        assert session.apply("w", _simple(2, 2, 2, [])) == Applied.DUPLICATE
        assert session.apply("w", _simple(3, 2, 2, [])) == Applied.STORED
    finally:
        session.close()


def test_finish_padding_order_and_its_errors():
    session = _session(max_episodes=3)
    session.join("a", session.config)
    session.join("b", session.config)
    try:
        with pytest.raises(RequestError) as caught:
            session.assemble(True)
        assert caught.value.kind == ErrorKind.NO_DATA and str(caught.value) == NO_DATA_MESSAGE
        session.apply("b", _simple(1, 3, 1, [], first=100))
        with pytest.raises(RequestError) as caught:
            session.assemble(False)
        assert caught.value.kind == ErrorKind.NO_DATA
        assert str(caught.value) == NO_EPISODES_MESSAGE
        session.apply("a", _simple(1, 4, 2, [(1, 0), (0, 1)]))
        plan = session.assemble(True)
        # Worker a (joined first), env 0: steps 0-1, 2-3 (tail); env 1: step 0; cut to 3.
        assert plan.workers.tolist() == [0, 0, 0]
        assert plan.envs.tolist() == [0, 0, 1]
        assert plan.lengths.tolist() == [2, 2, 1] and plan.max_length == 2
        assert plan.done.tolist() == [True, False, True]
        actions = [f for f in plan.fields if f.name == "actions"][0]
        ((row, count, flat),) = list(plan.field_parts(actions, 1 << 20))
        # Actions of env e at step t are 2 * t + e.
        assert (row, count, flat.tolist()) == (0, 3, [0, 2, 4, 6, 1])
    finally:
        session.close()


def test_a_failing_log_refuses_the_chunk_and_keeps_its_sequence_free():
    appended = []

    def journal(record):
        if len(appended) == 1:
            raise OSError(28, "No space left on device")
        appended.append(record)

    session = _session(journal=journal)
    session.join("w", session.config)
    try:
        assert session.apply("w", _simple(1, 2, 2, [])) == Applied.STORED
        with pytest.raises(RequestError) as caught:
            session.apply("w", _simple(2, 2, 2, []))
        assert caught.value.kind == ErrorKind.STORAGE
        assert "No space left on device" in str(caught.value)
        appended.append(None)  # space again: the same chunk is taken
        assert session.apply("w", _simple(2, 2, 2, [])) == Applied.STORED
        assert session.status().chunks_stored == 2
    finally:
        session.close()


def test_replaying_the_log_rebuilds_the_sessions_exactly():
    log: list[bytes] = []
    limits = ServiceLimits(max_sessions=4)
    live = Sessions(limits, NullMetrics(), journal=lambda parts: log.append(b"".join(parts)))
    config = SessionConfig(None, True, ("player_positions",))
    rng = np.random.default_rng(5)
    try:
        for w in ("a", "b"):
            session, _ = live.join("run", config, w)
        for seq in range(1, 4):
            for w in ("a", "b"):
                session.apply(
                    w,
                    _chunk(
                        seq,
                        rng.integers(0, 9, (5, 3)).astype(np.int16),
                        rng.random((5, 3)),
                        rng.random((5, 3)) < 0.3,
                        player_positions=rng.integers(0, 64, (5, 3, 2)).astype(np.int32),
                    ),
                )
        live.get("run").reset()
        session.apply("a", _simple(4, 5, 3, [(2, 1)], dtype=np.int16))
        kinds = [records.decode(r).kind for r in log]
        assert kinds == [b"J", b"J", *[b"C"] * 6, b"R", b"C"]
        replayed = Sessions(limits, NullMetrics())
        for record in log:
            replayed.replay(record)
        a, b = live.get("run"), replayed.get("run")
        assert a.status() == b.status()
        pa, pb = a.assemble(True), b.assemble(True)
        assert pa.lengths.tolist() == pb.lengths.tolist()
        for fa, fb in zip(pa.fields, pb.fields, strict=True):
            (ra,), (rb,) = list(pa.field_parts(fa, 1 << 20)), list(pb.field_parts(fb, 1 << 20))
            assert ra[2].tobytes() == rb[2].tobytes() and ra[2].dtype == rb[2].dtype
        replayed.close()
    finally:
        live.close()


def test_the_registry_refuses_bad_names_and_too_many_sessions():
    sessions = Sessions(ServiceLimits(max_sessions=1), NullMetrics())
    config = SessionConfig(None, False, ())
    try:
        for name in ("../x", "", ".hidden", "a/b", "x" * 129):
            with pytest.raises(RequestError) as caught:
                sessions.join(name, config, "w")
            assert caught.value.kind == ErrorKind.INVALID_NAME
        long = "y" * 10_000
        with pytest.raises(RequestError) as caught:
            sessions.join(long, config, "w")
        assert len(str(caught.value)) < 300  # a long name is shown shortened
        sessions.join("one", config, "w")
        with pytest.raises(RequestError) as caught:
            sessions.join("two", config, "w")
        assert caught.value.kind == ErrorKind.LIMIT
        with pytest.raises(RequestError) as caught:
            sessions.get("three")
        assert caught.value.kind == ErrorKind.UNKNOWN_SESSION
    finally:
        sessions.close()


@pytest.mark.parametrize("part_bytes", [1, 12, 40, 1 << 20])
def test_finish_parts_cover_every_row_once_across_workers(part_bytes):
    """Parts hold consecutive rows, several workers' rows when they fit, at most part_bytes
    (or one row), and together every real step once, in row order."""
    session = _session()
    try:
        expected = []
        for w, (n, at) in enumerate([(3, [(1, 0), (2, 2)]), (1, [(0, 0)]), (2, [(2, 1)])]):
            name = f"w{w}"
            session.join(name, session.config)
            chunk = _simple(1, 4, n, at, first=100 * w)
            session.apply(name, chunk)
        plan = session.assemble(True)
        actions = next(f for f in plan.fields if f.name == "actions")
        # Every episode's actions, row by row (action of env e at step t: base + n * t + e).
        for w, e, s, n in zip(
            plan.workers.tolist(), plan.envs.tolist(), plan.starts.tolist(), plan.lengths.tolist()
        ):
            width = (3, 1, 2)[w]
            expected += [100 * w + width * t + e for t in range(s, s + n)]
        parts = list(plan.field_parts(actions, part_bytes))
        rows = [r for first, count, _ in parts for r in range(first, first + count)]
        assert rows == list(range(plan.num_episodes))
        assert np.concatenate([flat for _, _, flat in parts]).tolist() == expected
        for _, count, flat in parts:
            assert flat.nbytes <= part_bytes or count == 1
        if part_bytes == 1 << 20:
            assert len(parts) == 1  # three workers' rows in one part
    finally:
        session.close()


def test_a_checkpoint_taken_while_a_chunk_is_decoded_replays_that_chunk():
    """A chunk takes its sequence before it is decoded and stored: a snapshot in between
    must not record the sequence without the chunk (its log record, after the snapshot's
    cut, would then be skipped as a resend)."""
    import threading
    from contextlib import ExitStack

    from recorder_server.durability import snapshot

    log: list[bytes] = []
    limits = ServiceLimits()
    live = Sessions(limits, NullMetrics(), journal=lambda parts: log.append(b"".join(parts)))
    config = SessionConfig(None, False, ())
    session, _ = live.join("run", config, "w")
    session.apply("w", _simple(1, 4, 2, [(1, 0)]))
    entered, go = threading.Event(), threading.Event()
    alloc = session.feeder.alloc

    def slow_alloc(*args):
        entered.set()
        go.wait(5)
        return alloc(*args)

    session.feeder.alloc = slow_alloc
    worker = threading.Thread(target=session.apply, args=("w", _simple(2, 4, 2, [(3, 1)])))
    worker.start()
    assert entered.wait(5)
    threading.Timer(0.3, go.set).start()
    with ExitStack() as stack:  # as a checkpoint does
        live.lock_all(stack)
        cut = len(log)
        meta, blobs = snapshot.session_state(session)
    worker.join(5)
    restored = Sessions(limits, NullMetrics())
    try:
        restored.restore(json.loads(json.dumps(meta)), [memoryview(b) for b in blobs])
        for record in log[cut:]:
            restored.replay(record)
        assert restored.get("run").status() == session.status()
        assert session.status().chunks_stored == 2
    finally:
        live.close()
        restored.close()
