"""Flow control: record() never waits on the network while there is room in flight;
the in-flight cap holds against a stalled server (a real SIGSTOP); drop mode counts."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from conftest import wait_for

from recorder_client import RolloutRecorder

T, N = 16, 64


def numbered_chunk(i: int) -> dict:
    """A chunk whose every action is its sequence number: order is visible in the result."""
    done = np.zeros((T, N), bool)
    done[-1, :] = i % 3 == 2
    return {
        "action": np.full((T, N), i, np.int64),
        "reward": np.full((T, N), i, np.float32),
        "done": done,
    }


CHUNK_BYTES = T * N * (8 + 4 + 1)


def run_with_timeout(fn, timeout: float):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, box


@pytest.fixture
def stopped(server_process):
    """The server process, frozen with SIGSTOP for the duration of a block."""

    class Freezer:
        def __enter__(self):
            os.kill(server_process.process.pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            os.kill(server_process.process.pid, signal.SIGCONT)

    yield server_process, Freezer()
    os.kill(server_process.process.pid, signal.SIGCONT)


def test_record_returns_while_the_server_is_stalled(stopped):
    server, freeze = stopped
    with RolloutRecorder(target=server.address, session="nb", reconnect_timeout=60) as rec:
        with freeze:
            thread, box = run_with_timeout(
                lambda: [rec.record(numbered_chunk(i)) for i in range(20)], timeout=10
            )
            assert not thread.is_alive(), "record() waited on a stalled server with room in flight"
            assert box["result"] == [True] * 20
            assert rec.bytes_in_flight == 20 * CHUNK_BYTES
        rec.flush(timeout=30)
        out = rec.finish()
    assert rec.bytes_in_flight == 0
    assert sorted(set(out.actions[out.mask()].tolist())) == list(range(20))


def test_in_flight_cap_holds_and_blocks_until_the_server_resumes(stopped):
    server, freeze = stopped
    cap = 4 * CHUNK_BYTES
    with RolloutRecorder(
        target=server.address, session="cap", max_bytes_in_flight=cap, reconnect_timeout=60
    ) as rec:
        seen = []
        with freeze:
            thread, _ = run_with_timeout(
                lambda: [rec.record(numbered_chunk(i)) for i in range(12)], timeout=3
            )
            assert thread.is_alive(), "record() went past the in-flight cap"
            for _ in range(10):
                seen.append(rec.bytes_in_flight)
                assert rec.bytes_in_flight <= cap
                thread.join(0.05)
            assert thread.is_alive()
        thread.join(30)
        assert not thread.is_alive()
        rec.flush(timeout=30)
        out = rec.finish()
    assert max(seen) == cap
    # Every chunk arrived, in order, exactly once.
    per_env0 = out.actions[out.episode_env == 0]
    firsts = [int(row[0]) for row in per_env0]
    assert firsts == sorted(firsts) and firsts[0] == 0
    assert rec.dropped_chunks == 0
    assert sorted(set(out.actions[out.mask()].tolist())) == list(range(12))


def test_drop_mode_counts_what_it_dropped(stopped):
    server, freeze = stopped
    cap = 3 * CHUNK_BYTES
    with RolloutRecorder(
        target=server.address,
        session="drop",
        max_bytes_in_flight=cap,
        on_backpressure="drop",
        reconnect_timeout=60,
    ) as rec:
        with freeze:
            kept = [rec.record(numbered_chunk(i)) for i in range(10)]
        assert kept == [True] * 3 + [False] * 7
        assert rec.dropped_chunks == 7
        rec.flush(timeout=30)  # room again once the server answers
        assert all(rec.record(numbered_chunk(i)) for i in range(10, 12))
        whole = rec.finish()
        out = rec.finish(include_partial=True)
    assert sorted(set(out.actions[out.mask()].tolist())) == [0, 1, 2, 10, 11]
    # Chunk i ends its envs' episodes when i % 3 == 2: the episodes are chunks 0-2, 3-5,
    # 6-8 and 9-11. The one of chunks 10-11 lost its start with chunk 9: it is marked, not
    # passed off as whole, and finish() leaves it out by default.
    for b in range(out.num_episodes):
        chunks = sorted(set(out.actions[b, : int(out.lengths[b])].tolist()))
        assert (chunks, out.episode_partial[b]) in (([0, 1, 2], ""), ([10, 11], "gap_before"))
    assert int((out.episode_partial == "gap_before").sum()) == N
    assert sorted(set(whole.actions[whole.mask()].tolist())) == [0, 1, 2]


def pieces(out) -> dict[tuple, set]:
    """Each episode piece as the chunk numbers its actions hold, with its partial marks."""
    got: dict[tuple, set] = {}
    for b in range(out.num_episodes):
        chunks = tuple(sorted(set(out.actions[b, : int(out.lengths[b])].tolist())))
        got[chunks] = got.get(chunks, set()) | {str(out.episode_partial[b])}
    return got


def test_no_episode_spans_chunks_dropped_at_the_cap(tmp_path):
    """Episodes open across the drop end at the hole (gap_after), and what follows starts
    unknown (gap_before), as at a chunk the server refused; so after a kill -9 and the
    replay of the write-ahead log too."""
    from conftest import RestartableServer

    server = RestartableServer(tmp_path / "data").start()
    try:
        with RolloutRecorder(
            target=server.address,
            session="hole",
            max_bytes_in_flight=2 * CHUNK_BYTES,
            on_backpressure="drop",
            reconnect_timeout=60,
        ) as rec:
            for i in (0, 1):  # no done: the episodes stay open
                chunk = numbered_chunk(i)
                chunk["done"][:] = False
                assert rec.record(chunk)
            rec.flush(timeout=30)
            os.kill(server.pid, signal.SIGSTOP)
            try:
                kept = [rec.record(numbered_chunk(i)) for i in range(3, 7)]
            finally:
                os.kill(server.pid, signal.SIGCONT)
            rec.flush(timeout=30)
            assert kept == [True, True, False, False]  # chunks 5 and 6 are the hole
            last = numbered_chunk(7)
            last["done"][-1] = True
            assert rec.record(last)
            before = pieces(rec.finish(include_partial=True))
        server.kill()
        server.start()
        with RolloutRecorder(target=server.address, session="hole") as reader:
            after = pieces(reader.finish(include_partial=True))
    finally:
        server.kill()
    # The episodes open after chunk 4 end at the hole (dropped chunk 5 ended them), and
    # chunk 7 ends ones that began in dropped chunk 6: both pieces are marked.
    assert before == after == {(0, 1, 3, 4): {"gap_after"}, (7,): {"gap_before"}}


def test_no_reordering_within_a_worker_under_backpressure(server_process):
    rng = np.random.default_rng(0)
    with RolloutRecorder(
        target=server_process.address, session="order", max_bytes_in_flight=2 * CHUNK_BYTES
    ) as rec:
        lengths = rng.integers(1, 2 * T, 60)
        expected = []
        for i, length in enumerate(lengths):
            chunk = {
                "action": np.full((length, 2), i, np.int32),
                "reward": np.zeros((length, 2), np.float32),
                "done": np.zeros((length, 2), bool),
            }
            rec.record(chunk)
            expected += [i] * int(length)
        out = rec.finish()
    # No done flag: one episode per env, the whole time axis in record order.
    assert out.actions[0].tolist() == expected
    assert wait_for(lambda: rec.bytes_in_flight == 0, timeout=1)
