"""The scripts in examples/ run as a user runs them, with a small step budget, against the
embedded default server; what each recorded is checked against what its envs counted
themselves (CleanRL's RecordEpisodeStatistics, SB3's Monitor), which they print beside it.

examples/gymnasium_cartpole.py and examples/jax_rollout.py are the README's blocks: they run
in tests/test_readme.py, against truth computed there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_HERE = {"cleanrl_ppo.py", "sb3_ppo.py"}
RUN_BY_THE_README_TEST = {"gymnasium_cartpole.py", "jax_rollout.py"}


def run(script: str, *args: str, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_RECORDER_")}
    env["OMP_NUM_THREADS"] = "1"  # the test machine's few cores: no torch thread pool
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, f"{script} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def counted(stdout: str, who: str) -> tuple[int, str]:
    match = re.search(rf"^{who}: (\d+) episodes, mean return ([\d.]+)$", stdout, re.M)
    assert match, f"expected a line '{who}: N episodes, mean return R' in:\n{stdout}"
    return int(match.group(1)), match.group(2)


def test_every_example_is_run_by_a_test():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == RUN_HERE | RUN_BY_THE_README_TEST


def test_cleanrl_ppo_records_every_episode_its_envs_finished(tmp_path):
    pytest.importorskip("torch")
    stdout = run("cleanrl_ppo.py", "--total-timesteps", "1024", tmp_path=tmp_path)
    assert "iteration 1: step 1024," in stdout
    env, recorded = counted(stdout, "env"), counted(stdout, "recorded")
    assert env == recorded and env[0] > 10


def test_sb3_ppo_records_every_episode_its_envs_finished(tmp_path):
    pytest.importorskip("stable_baselines3")
    stdout = run("sb3_ppo.py", "1024", tmp_path=tmp_path)
    env, recorded = counted(stdout, "env"), counted(stdout, "recorded")
    assert env == recorded and env[0] > 10
    # One rollout of 128 steps of 8 envs, every step in an episode (tails included).
    assert re.search(r"^recorded 1024 steps; episodes terminated \d+, truncated 0$", stdout, re.M)
