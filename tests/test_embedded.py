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


def _without_health_packages(tmp_path) -> dict[str, str]:
    """An environment whose Python cannot import grpc_health or grpc_reflection, as after
    `pip install rollout-recorder` without the [server] extra (packages of those names
    first on the path, whose import fails as a missing one does)."""
    for name in ("grpc_health", "grpc_reflection"):
        package = tmp_path / "shadow" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_RECORDER_TARGET"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(tmp_path / "shadow"), env.get("PYTHONPATH")])
    )
    return env


def test_a_client_only_install_records_without_a_warning_about_server_extras(tmp_path):
    """The embedded server needs no health service (nothing probes a private server): a
    client-only install records with a silent stderr. A server of one's own says what is
    off."""
    env = _without_health_packages(tmp_path)
    script = textwrap.dedent(
        """
        import numpy as np
        from recorder_client import RolloutRecorder
        with RolloutRecorder() as rec:
            done = np.zeros((4, 2), bool)
            done[1, 0] = True
            rec.record({"action": np.zeros((4, 2), np.int64), "reward": np.ones((4, 2)), "done": done})
            print("episodes", rec.finish().num_episodes)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["episodes", "3"]
    assert out.stderr == ""
    served = subprocess.Popen(
        [sys.executable, "-m", "recorder_server", "serve", "--listen", "127.0.0.1:0"]
        + ["--data-dir", str(tmp_path / "data"), "--no-wal"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert served.stdout.readline().startswith("rollout-recorder listening on ")
    finally:
        served.terminate()
        _, err = served.communicate(timeout=30)
    assert "WARNING" in err and "gRPC health and reflection are off" in err, err
