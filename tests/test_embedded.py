"""The embedded default: no target, no env var -> a private server process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
from conftest import child_pids, pid_alive, wait_for

from recorder_client import RolloutRecorder


def test_embedded_records_finishes_and_leaves_nothing(monkeypatch):
    monkeypatch.delenv("ROLLOUT_RECORDER_TARGET", raising=False)
    before = set(child_pids())
    rec = RolloutRecorder(max_episodes=3)
    (pid,) = set(child_pids()) - before  # the private server process
    socket_dir = os.path.dirname(rec.target.removeprefix("unix:"))
    assert rec.target.startswith("unix:") and pid_alive(pid)
    done = np.zeros((4, 2), bool)
    done[1, 0] = done[2, 1] = True
    rec.record({"action": np.arange(8).reshape(4, 2), "reward": np.ones((4, 2)), "done": done})
    out = rec.finish()
    assert out.num_episodes == 3 and out.lengths.tolist() == [2, 2, 3]
    rec.close()
    assert not pid_alive(pid)
    assert not os.path.exists(socket_dir)


def test_env_var_target_is_used(monkeypatch, target):
    monkeypatch.setenv("ROLLOUT_RECORDER_TARGET", target)
    before = set(child_pids())
    with RolloutRecorder() as rec:
        assert rec.target == target and set(child_pids()) == before


def test_embedded_server_stops_when_its_parent_is_killed(tmp_path):
    """kill -9 of the training process must not leave the private server behind."""
    script = textwrap.dedent(
        """
        import os, sys, time
        os.environ.pop("ROLLOUT_RECORDER_TARGET", None)
        from recorder_client import RolloutRecorder
        rec = RolloutRecorder()
        print(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()[0], flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(proc.stdout.readline())
    assert pid_alive(server_pid)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    assert wait_for(lambda: not pid_alive(server_pid), timeout=10)


def test_exit_without_close_stops_the_server():
    script = textwrap.dedent(
        """
        import os
        os.environ.pop("ROLLOUT_RECORDER_TARGET", None)
        from recorder_client import RolloutRecorder
        rec = RolloutRecorder()
        print(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()[0], flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert wait_for(lambda: not pid_alive(int(out.stdout.strip())), timeout=10)


def test_the_launcher_finds_the_ready_line_after_other_lines(tmp_path):
    """`serve --http-listen` prints the dashboard's address first; both lines may come in one
    read, and the launcher must still see the second."""
    from recorder_client import _launch

    server = _launch.ServerProcess(
        ["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path), "--no-wal"]
        + ["--http-listen", "127.0.0.1:0"],
        startup_timeout=20,
    )
    try:
        assert server.address.startswith("127.0.0.1:")
        assert [line.split(" at ")[0] for line in server.preamble] == ["rollout-recorder dashboard"]
    finally:
        assert server.stop() == 0
