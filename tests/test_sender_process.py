"""`RolloutRecorder(sender="process")`: the stream in a child process records what the
thread sender records (its late refusals: tests/test_client_errors.py), sends what a killed
trainer had recorded, and says so when the child itself dies.

Truth comes from the reference model of the in-process recorder fed the same calls, and
from the server's own counters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import wait_for
from reference_model import ReferenceRecorder
from test_linger import T, chunks, record_all
from test_property_remote import assert_bit_identical

from recorder_client import RecorderError, RolloutRecorder
from recorder_client._sender_process import SENDER_NICE


@pytest.mark.parametrize("linger_ms", [0, 500])
def test_records_exactly_what_the_in_process_recorder_records(target, linger_ms):
    calls = chunks(30, seed=7)
    config = {"record_states": True, "state_fields": ["player_positions"]}
    ref = ReferenceRecorder(**config)
    session = f"process-{linger_ms}"
    with RolloutRecorder(
        **config, target=target, session=session, sender="process", linger_ms=linger_ms
    ) as rec:
        record_all(rec, ref, calls)
        assert rec.num_recorded_steps == ref.num_recorded_steps == 30 * T
        rec.flush()
        assert rec.bytes_in_flight == 0
        stats = rec.stats
        assert stats.raw_bytes == sum(
            a.nbytes for traj, states in calls for a in (*traj.values(), *states.values())
        )
        assert stats.chunks_acked + stats.chunks_joined == 30, stats
        assert rec.status().num_recorded_steps == 30 * T
        assert_bit_identical(rec.finish(), ref.finish())


def test_the_child_sends_what_a_killed_trainer_recorded(target, tmp_path):
    """kill -9 of the training process right after its record() calls: the child still
    sends every chunk, and exits."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import numpy as np
        from recorder_client import RolloutRecorder
        rec = RolloutRecorder(target={target!r}, session="orphaned", sender="process")
        rng = np.random.default_rng(0)
        for _ in range(40):
            rec.record({{
                "action": rng.integers(0, 5, (64, 16)).astype(np.int32),
                "reward": rng.standard_normal((64, 16)).astype(np.float32),
                "done": rng.random((64, 16)) < 0.02,
            }})
        print(rec._sender._proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    with RolloutRecorder(target=target, session="orphaned") as probe:
        assert wait_for(lambda: probe.status().num_recorded_steps == 40 * 64, timeout=30)
    assert wait_for(lambda: not _alive(child), timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_sender_process_is_raised_by_the_next_call(target):
    traj, _ = chunks(1)[0]
    rec = RolloutRecorder(target=target, session="child-killed", sender="process")
    try:
        rec.record(traj)
        rec.flush()
        os.kill(rec._sender._proc.pid, signal.SIGKILL)
        rec._sender._proc.wait(10)
        with pytest.raises(RecorderError, match=r"sender process exited .* after 1 acknowledged"):
            rec.record(traj)
        with pytest.raises(RecorderError, match="sender process exited"):
            rec.flush()
    finally:
        rec.close()
        assert rec.stats.chunks_acked == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_child_runs_below_the_training_process(target):
    rec = RolloutRecorder(target=target, session="child-nice", sender="process")
    try:
        with open(f"/proc/{rec._sender._proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        nice, policy = int(fields[16]), int(fields[38])  # stat's fields 19 and 41
        assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + SENDER_NICE)
        assert policy == os.SCHED_BATCH
    finally:
        rec.close()


def _thread_waits(pid: int) -> dict[str, int]:
    """Each thread of `pid`: its voluntary context switches (sleeps it woke from)."""
    counts = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            counts[tid] = sum(int(line.split()[1]) for line in f if line.startswith("voluntary"))
    return counts


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_childs_sender_sleeps_until_a_chunk_comes(target):
    """Chunks 15 ms apart are close enough for an in-process sender to poll its queue every
    millisecond (its thread woke 7-14 times a chunk). The child's sender does not: its
    wake-ups would save nothing and can land on the training loop's core. Its busiest thread
    wakes about twice a chunk."""
    calls = chunks(30, seed=4)
    with RolloutRecorder(target=target, session="no-poll", sender="process") as rec:
        rec.record(*calls[0])
        rec.flush()
        pid = rec._sender._proc.pid
        before = _thread_waits(pid)
        for traj, states in calls[1:]:
            time.sleep(0.015)
            rec.record(traj, states)
        rec.flush()
        waits = max(n - before.get(tid, 0) for tid, n in _thread_waits(pid).items())
    assert waits < 4 * (len(calls) - 1), f"{waits} wake-ups for {len(calls) - 1} chunks"


def test_a_flush_with_every_chunk_answered_needs_no_word_from_the_child(target):
    """flush() once the server answered every chunk returns from the shared counters,
    without a round trip to the child: it returns while the child is stopped (SIGSTOP).
    A chunk the child has not taken makes the next flush wait for the child again."""
    calls = chunks(3, seed=3)
    with RolloutRecorder(target=target, session="answered", sender="process") as rec:
        for traj, states in calls:
            rec.record(traj, states)
        rec.flush()
        pid = rec._sender._proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            rec.flush(timeout=5)
            assert time.monotonic() - started < 1
            rec.record(*calls[0])
            assert not rec._sender._answered()  # still in the pipe: this flush asks the child
        finally:
            os.kill(pid, signal.SIGCONT)
        rec.flush()
        assert rec.status().num_recorded_steps == 4 * T


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sender": "processes"}, 'sender: expected "thread" or "process", got \'processes\''),
        ({"max_episodes": 5}, 'max_episodes: expected None with sender="process"'),
        ({"on_error": print}, 'on_error: expected None with sender="process"'),
        ({"on_backpressure": "drop"}, "on_backpressure: expected 'block' with"),
    ],
)
def test_options_the_process_sender_cannot_keep_are_refused(target, kwargs, match):
    kwargs = {"sender": "process", **kwargs}
    with pytest.raises(ValueError, match=match):
        RolloutRecorder(target=target, session="refused-options", **kwargs)


def test_device_free_torch_tensors_cross_to_the_child(target):
    torch = pytest.importorskip("torch")
    calls = chunks(4, seed=11)
    ref = ReferenceRecorder()
    with RolloutRecorder(target=target, session="process-torch", sender="process") as rec:
        for traj, _ in calls:
            rec.record({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in traj.items()})
            ref.record(traj)
        assert_bit_identical(rec.finish(), ref.finish())


def test_ctrl_c_leaves_the_sender_process_to_send_what_close_flushes(target):
    """SIGINT reaches a terminal's whole process group: the child must outlive it, so that
    the training process's close() still sends the chunks recorded."""
    calls = chunks(6, seed=5)
    rec = RolloutRecorder(target=target, session="ctrl-c", sender="process")
    try:
        os.kill(rec._sender._proc.pid, signal.SIGINT)
        for traj, _ in calls:
            rec.record(traj)
    finally:
        rec.close()
    with RolloutRecorder(target=target, session="ctrl-c") as probe:
        assert probe.status().num_recorded_steps == 6 * T
