"""Errors reach the caller: what the client can check is refused by record() itself, and a
refusal the server sends later is raised by the recorder's next call of any kind (and goes
to ``on_error`` at once), and the unary calls wait for a restarting server up to
``connect_timeout``. Real servers on real ports throughout."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import RestartableServer, free_port, wait_for

from recorder_client import (
    InvalidChunkError,
    RecorderUnavailableError,
    RolloutRecorder,
    SessionDroppedError,
    UnknownSessionError,
    drop_session,
    list_sessions,
)
from recorder_client.capture_types import CellField, TrajectoryTrainingConfiguration


def chunk(t: int = 4, n: int = 3, adtype=np.int32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "action": rng.integers(0, 9, (t, n)).astype(adtype),
        "reward": rng.standard_normal((t, n)).astype(np.float32),
        "done": rng.random((t, n)) < 0.3,
    }


def states(t: int = 4, n: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return {
        "player_positions": rng.integers(0, 64, (t, n, 1, 2)).astype(np.int32),
        "player_inventory": rng.integers(0, 9, (t, n, 1, 4)).astype(np.int16),
    }


# -- record() refuses what the client can know, before anything is queued -----------------

# Each case: the second chunk, recorded right after the first one (before its ack), differs
# from it in a way the server refuses. Expected: (match in the message, chunk, env states).
CHANGES = {
    "action dtype": ("action.dtype: expected int32 .*got int64", chunk(adtype=np.int64), None),
    "reward dtype": (
        "reward.dtype: expected float32 .*got float64",
        {**chunk(), "reward": np.zeros((4, 3))},
        None,
    ),
    "N": ("N: expected 3 environments .*got 5", chunk(n=5), states(n=5)),
    "action trailing shape": (
        r"action.shape: expected trailing shape \(\) .*got \(2,\)",
        {**chunk(), "action": np.zeros((4, 3, 2), np.int32)},
        None,
    ),
    "state field gone": (
        r"state fields \['player_inventory', 'player_positions'\].*got \['player_positions'\]",
        chunk(),
        {"player_positions": states()["player_positions"]},
    ),
    "state dtype": (
        "env_states.player_inventory.dtype: expected int16 .*got int32",
        chunk(),
        {**states(), "player_inventory": np.zeros((4, 3, 1, 4), np.int32)},
    ),
    "state trailing shape": (
        r"env_states.player_positions.shape: expected trailing shape \(1, 2\) .*got \(2, 2\)",
        chunk(),
        {**states(), "player_positions": np.zeros((4, 3, 2, 2), np.int32)},
    ),
    "reward shape": (
        r"trajectories.reward: expected shape \(T, N\) = \(4, 3\), got \(4, 2\)",
        {**chunk(), "reward": np.zeros((4, 2), np.float32)},
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_changed_chunk_raises_at_record_and_nothing_is_recorded(target, case):
    match, second, second_states = CHANGES[case]
    with RolloutRecorder(target=target, session="changes", record_states=True) as rec:
        assert rec.record(chunk(), states())  # no flush: its ack has not come back yet
        with pytest.raises(InvalidChunkError, match=match):
            rec.record(second, second_states if second_states is not None else states())
        rec.flush()  # nothing was queued: nothing is refused later
        assert rec.status().num_recorded_steps == 4
        assert rec.record(chunk(seed=1), states(seed=1))  # the next good chunk records
        rec.flush()
        assert rec.status().num_recorded_steps == 8
        assert rec.stats.chunks_acked == 2 and rec.stats.chunks_sent == 2


def test_a_refused_first_chunk_does_not_fix_the_layout(target):
    """The session's dtype comes from another worker: this worker's first chunk is refused
    by the server, and its next chunk, in the session's dtype, is taken."""
    with RolloutRecorder(target=target, session="firsts", worker_id="a") as a:
        a.record(chunk())
        a.flush()
        with RolloutRecorder(target=target, session="firsts", worker_id="b") as b:
            b.record(chunk(adtype=np.int64))
            with pytest.raises(InvalidChunkError, match="action.dtype: expected int32"):
                b.flush()
            assert b.record(chunk(seed=2))
            b.flush()
            assert b.status().num_recorded_steps == 8


def test_capture_cell_field_missing_raises_at_record(tmp_path):
    from recorder_server import ServerOptions, start_server

    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("player_positions", (0, 0), bucket=8, name="x"),)
    )
    running = start_server(ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "d")))
    try:
        with RolloutRecorder(
            target=running.address, session="cells", record_states=True, capture=config
        ) as rec:
            with pytest.raises(InvalidChunkError, match="cell-key field 'player_positions'"):
                rec.record(chunk(), {"player_inventory": states()["player_inventory"]})
            with pytest.raises(InvalidChunkError, match="cell-key field 'player_positions'"):
                rec.record(chunk())  # no env states at all
            assert rec.record(chunk(), states())
            rec.flush()
            assert rec.status().num_recorded_steps == 4
    finally:
        running.stop(grace=0)


# -- a refusal that arrives after record() returned ----------------------------------------


def refused_later(target: str, session: str, **kwargs) -> tuple[RolloutRecorder, RolloutRecorder]:
    """Worker "a" stores int32 actions; worker "b" then records int64 ones, which only the
    server can refuse (the session's dtype is another worker's). Returns (a, b) once b's
    chunk is answered."""
    a = RolloutRecorder(target=target, session=session, worker_id="a")
    a.record(chunk())
    a.flush()
    b = RolloutRecorder(target=target, session=session, worker_id="b", **kwargs)
    child = b._sender._proc.pid if b.sender == "process" else None
    if child is not None:  # else, on a loaded machine, the child's whole round trip can
        os.kill(child, signal.SIGSTOP)  # end inside record(), which then raises it
    try:
        assert b.record(chunk(adtype=np.int64))  # record() cannot know: it returns True
    finally:
        if child is not None:
            os.kill(child, signal.SIGCONT)
    assert wait_for(lambda: b.stats.chunks_acked == 1, timeout=10)
    return a, b


CALLS = {
    "is_full": lambda r: r.is_full,
    "num_recorded_steps": lambda r: r.num_recorded_steps,
    "flush": lambda r: r.flush(),
    "finish": lambda r: r.finish(),
    "status": lambda r: r.status(),
    "record": lambda r: r.record(chunk(seed=3)),
    "close": lambda r: r.close(),
}


@pytest.mark.parametrize("sender", ["thread", "process"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_late_refusal_is_raised_by_the_next_call(target, call, sender):
    a, b = refused_later(target, f"late-{call}-{sender}", sender=sender)
    try:
        with pytest.raises(InvalidChunkError, match="action.dtype: expected int32.*got int64"):
            CALLS[call](b)
        if call != "close":  # once per error: the call after it goes through
            assert b.num_recorded_steps >= 4
            b.flush()
            assert b.finish().num_episodes >= 0
        b.close()
        # What was acknowledged stays: worker a's chunk, and b's later one if it recorded.
        steps = a.status().num_recorded_steps
        assert steps == (8 if call == "record" else 4)
    finally:
        b.close()
        a.close()


def test_on_error_gets_the_refusal_at_once_from_the_background(target):
    seen: list[tuple[BaseException, str]] = []
    got = threading.Event()

    def on_error(exc: BaseException) -> None:
        seen.append((exc, threading.current_thread().name))
        got.set()

    a, b = refused_later(target, "callback", on_error=on_error)
    try:
        assert got.wait(10)
        ((exc, thread),) = seen
        assert isinstance(exc, InvalidChunkError) and "action.dtype" in str(exc)
        assert thread != threading.main_thread().name
        with pytest.raises(InvalidChunkError):  # and it is raised by the next call as well
            b.flush()
    finally:
        b.close()
        a.close()


def test_a_drop_while_idle_is_raised_by_the_next_read_of_is_full(target):
    """The stream's failure (here the session dropped under an idle worker) is raised once by
    a read of is_full, and by every record() after it (nothing can be recorded)."""
    seen: list[BaseException] = []
    rec = RolloutRecorder(target=target, session="dropped", on_error=seen.append)
    try:
        rec.record(chunk())
        rec.flush()
        drop_session(target, "dropped")
        assert wait_for(lambda: seen, timeout=10)
        assert isinstance(seen[0], SessionDroppedError) and "'dropped'" in str(seen[0])
        with pytest.raises(SessionDroppedError, match="'dropped' was dropped"):
            assert not rec.is_full
        assert rec.is_full is False  # once
        with pytest.raises(SessionDroppedError):
            rec.record(chunk(seed=1))
    finally:
        rec.close()


# -- unary calls wait for a restarting server ----------------------------------------------


def test_unary_calls_wait_for_a_server_that_starts_later(tmp_path):
    server = RestartableServer(tmp_path / "data")
    results: dict[str, object] = {}

    def ask(name: str, call) -> None:
        started = time.monotonic()
        try:
            results[name] = (call(), time.monotonic() - started)
        except Exception as exc:  # recorded for the assertion below
            results[name] = (exc, time.monotonic() - started)

    threads = [
        threading.Thread(
            target=ask, args=("list", lambda: list_sessions(server.address, timeout=60))
        ),
        threading.Thread(
            target=ask, args=("drop", lambda: drop_session(server.address, "nothing", timeout=60))
        ),
    ]
    for thread in threads:
        thread.start()
    time.sleep(1.5)  # both calls are under way, against a port nothing listens on
    server.start()
    try:
        for thread in threads:
            thread.join(60)
        sessions, waited = results["list"]
        assert sessions == [] and waited > 1.4
        dropped, waited = results["drop"]
        assert isinstance(dropped, UnknownSessionError) and waited > 1.4  # the server's answer

        # A recorder's status() across a kill -9 and a restart on the same port.
        with RolloutRecorder(target=server.address, session="restarts", connect_timeout=60) as rec:
            rec.record(chunk())
            rec.flush()
            server.kill()
            restart = threading.Timer(1.5, server.start)
            restart.start()
            started = time.monotonic()
            status = rec.status()
            assert time.monotonic() - started > 1.0
            assert status.num_recorded_steps == 4  # the acknowledged chunk, from the log
            restart.join()
    finally:
        server.stop()


def test_unary_calls_against_a_dead_port_wait_connect_timeout_then_name_it(target):
    dead = f"127.0.0.1:{free_port()}"
    for call in (
        lambda: list_sessions(dead, timeout=1.5),
        lambda: drop_session(dead, "x", timeout=1.5),
    ):
        started = time.monotonic()
        with pytest.raises(RecorderUnavailableError, match=dead) as info:
            call()
        assert 1.4 < time.monotonic() - started < 6, info.value
        assert "1.5" in str(info.value)


def test_recorder_status_waits_connect_timeout_for_a_server_gone(tmp_path):
    from recorder_server import ServerOptions, start_server

    running = start_server(ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "d")))
    rec = RolloutRecorder(target=running.address, session="gone", connect_timeout=1.5)
    try:
        running.stop(grace=0)
        started = time.monotonic()
        with pytest.raises(RecorderUnavailableError, match=running.address):
            rec.status()
        assert 1.4 < time.monotonic() - started < 6
    finally:
        rec.close()
