"""is_full and num_recorded_steps are answered in the client from what the server's acks
carry (and, for a worker with nothing in flight, a status asked for in the background):
exact for a worker's own chunks at once, and for other workers' chunks once an answer that
counts them arrives."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import numpy as np
import pytest
from conftest import ServerProcess, free_port, wait_for
from reference_model import ReferenceMultiWorker, ReferenceRecorder

from recorder_client import RolloutRecorder


def chunk(rng, T=8, N=4, done_p=0.1):
    return types.SimpleNamespace(
        action=rng.integers(0, 12, (T, N)).astype(np.int32),
        reward=rng.standard_normal((T, N)).astype(np.float32),
        done=rng.random((T, N)) < done_p,
    )


@pytest.mark.parametrize("max_episodes", [None, 7])
def test_own_chunks_count_at_once_with_the_server_stopped(server_process, max_episodes):
    """With the server paused (SIGSTOP), each answer still matches the reference after
    every record(): nothing is asked of the server."""
    rng = np.random.default_rng(3)
    ref = ReferenceRecorder(max_episodes=max_episodes)
    with RolloutRecorder(
        max_episodes=max_episodes, target=server_process.address, session="own"
    ) as rec:
        rec.record(chunk(rng))
        ref.record(chunk(np.random.default_rng(3)))
        rec.flush()
        os.kill(server_process.pid, signal.SIGSTOP)
        try:
            timings = []
            for _ in range(12):
                c = chunk(rng, T=int(rng.integers(1, 10)))
                kept = rec.record(c)
                assert kept == ref.record(c)
                began = time.perf_counter()
                answer = (rec.is_full, rec.num_recorded_steps)
                timings.append(time.perf_counter() - began)
                assert answer == (ref.is_full, ref.num_recorded_steps)
            assert max(timings) < 0.05, timings  # no round trip to a stopped server
        finally:
            os.kill(server_process.pid, signal.SIGCONT)
        rec.flush()
        assert (rec.is_full, rec.num_recorded_steps) == (ref.is_full, ref.num_recorded_steps)
        status = rec.status()
        assert (status.is_full, status.num_recorded_steps) == (ref.is_full, ref.num_recorded_steps)


def test_other_workers_chunks_reach_an_idle_worker(target):
    """Four workers record at once; each answer only grows while they do, and once they
    are done every worker, the idle ones too, counts every chunk."""
    rng = np.random.default_rng(5)
    chunks = [[chunk(rng, T=int(rng.integers(1, 12))) for _ in range(25)] for _ in range(4)]
    total = sum(c.done.shape[0] for w in chunks for c in w)
    recs = [RolloutRecorder(target=target, session="many", worker_id=f"w{i}") for i in range(4)]
    watcher = RolloutRecorder(target=target, session="many", worker_id="watcher")
    seen: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(watcher.num_recorded_steps)
            time.sleep(0.001)

    def work(i):
        for c in chunks[i]:
            recs[i].record(c)
        recs[i].flush()

    try:
        observer = threading.Thread(target=watch)
        observer.start()
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        began = time.monotonic()
        assert wait_for(
            lambda: all(r.num_recorded_steps == total for r in [*recs, watcher]), 2.0, 0.002
        ), [r.num_recorded_steps for r in [*recs, watcher]]
        caught_up = time.monotonic() - began
        stop.set()
        observer.join()
        assert seen == sorted(seen) and 0 < max(seen) <= total
        assert caught_up < 0.5, caught_up
        assert watcher.status().num_recorded_steps == total
    finally:
        stop.set()
        for r in [*recs, watcher]:
            r.close()


def test_a_full_session_is_seen_by_a_worker_that_records_nothing(target):
    """Worker a fills the session; idle worker b sees is_full without recording, and its
    next chunk is dropped in the client, as the server would drop it."""
    rng = np.random.default_rng(9)
    ref = ReferenceMultiWorker(2, max_episodes=5)
    with (
        RolloutRecorder(max_episodes=5, target=target, session="fill", worker_id="a") as a,
        RolloutRecorder(max_episodes=5, target=target, session="fill", worker_id="b") as b,
    ):
        assert not b.is_full
        while not ref.is_full:
            c = chunk(rng, done_p=0.05)
            assert a.record(c) == ref.record(0, c)
            assert a.is_full == ref.is_full  # its own chunks: at once
        assert wait_for(lambda: b.is_full, 1.0, 0.002)
        assert b.num_recorded_steps == ref.num_recorded_steps
        assert not b.record(chunk(rng)) and b.stats.chunks_dropped_full == 1
        assert b.stats.chunks_sent == 0


def test_a_reset_reaches_the_other_workers(target):
    rng = np.random.default_rng(11)
    with (
        RolloutRecorder(max_episodes=3, target=target, session="rs", worker_id="a") as a,
        RolloutRecorder(max_episodes=3, target=target, session="rs", worker_id="b") as b,
    ):
        while not a.is_full:
            a.record(chunk(rng, done_p=0.2))
        assert wait_for(lambda: b.is_full, 1.0, 0.002)
        a.reset()
        assert (a.is_full, a.num_recorded_steps) == (False, 0)
        assert wait_for(lambda: (b.is_full, b.num_recorded_steps) == (False, 0), 1.0, 0.002)
        c = chunk(rng, done_p=0.0)
        assert b.record(c)
        assert (b.is_full, b.num_recorded_steps) == (False, 8)


def test_counters_survive_a_server_restart(tmp_path):
    """kill -9 and a restart from the write-ahead log: the rejoin brings the counters back."""
    rng = np.random.default_rng(13)
    listen = f"127.0.0.1:{free_port()}"
    server = ServerProcess(tmp_path / "data", "--listen", listen)
    try:
        rec = RolloutRecorder(target=server.address, session="rj", worker_id="a")
        for _ in range(5):
            rec.record(chunk(rng, T=4))
        rec.flush()
        server.kill()
        server = ServerProcess(tmp_path / "data", "--listen", listen)
        rec.record(chunk(rng, T=4))
        assert rec.num_recorded_steps == 24
        rec.flush()
        assert rec.num_recorded_steps == 24 and rec.stats.reconnects >= 1
        rec.close()
    finally:
        server.stop()


def test_device_array_done_flags_are_counted_when_asked(server_process):
    """Done flags of device arrays are not read by record() (that would wait for the
    device); is_full counts them when asked, still without the server (paused)."""
    from test_device_arrays import FakeDeviceArray

    rng = np.random.default_rng(17)
    ref = ReferenceRecorder(max_episodes=9)
    with RolloutRecorder(max_episodes=9, target=server_process.address, session="dev") as rec:
        rec.record(chunk(rng))
        rec.flush()
        ref.record(chunk(np.random.default_rng(17)))
        os.kill(server_process.pid, signal.SIGSTOP)
        try:
            for _ in range(10):
                c = chunk(rng)
                on_device = {k: FakeDeviceArray(getattr(c, k), "gpu") for k in vars(c)}
                assert rec.record(on_device) == ref.record(c)
                assert (rec.is_full, rec.num_recorded_steps) == (
                    ref.is_full,
                    ref.num_recorded_steps,
                )
        finally:
            os.kill(server_process.pid, signal.SIGCONT)
        rec.flush()
        assert (rec.is_full, rec.num_recorded_steps) == (ref.is_full, ref.num_recorded_steps)
