"""The README as a new user reads it: short, and its two examples run exactly as printed.

The examples are taken from README.md at test time (the fenced python block under each
heading), run in a subprocess against the embedded default server, and what they print is
checked against the truth computed here from the environment itself. examples/ holds the same
scripts, for people who want a file to run: they must equal the README's blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

GYM_HEADING = "## Record a Gymnasium loop"
JAX_HEADING = "## Record a factoriax or JAX loop"


def python_block(heading: str) -> str:
    """The first fenced python block after ``heading`` and before the next heading."""
    text = README.read_text()
    assert heading in text, f"README.md: expected a section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert match, f"README.md: expected a ```python block under {heading!r}"
    return match.group(1)


def run_example(code: str, tmp_path: Path) -> str:
    """Run a README example as a user would, with no server configured: the client starts
    its embedded one. Returns stdout."""
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_RECORDER_")}
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"the example exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_readme_is_a_front_door_of_at_most_170_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 170, f"README.md: expected at most 170 lines, got {len(lines)}"
    text = "\n".join(lines)
    for needed in ("make demo", "make test", "| `action` |", "| `obs` |", "## What next"):
        assert needed in text, f"README.md: expected {needed!r}"
    # The contract, then the Gymnasium example, come right after the quick start.
    headings = re.findall(r"^## (.*)$", text, re.M)
    assert headings[:3] == ["Quick start", "What `record()` takes", "Record a Gymnasium loop"]


@pytest.mark.parametrize(
    "heading,path",
    [(GYM_HEADING, "examples/gymnasium_cartpole.py"), (JAX_HEADING, "examples/jax_rollout.py")],
)
def test_example_scripts_are_the_readme_blocks(heading, path):
    assert (ROOT / path).read_text() == python_block(heading), (
        f"{path} differs from the README's block under {heading!r}: copy one onto the other"
    )


def gym_truth(num_envs: int, steps: int) -> tuple[int, float, int, int]:
    """Episodes finished, their mean return, the truncated ones and the unfinished tails,
    from CartPole's own returns: the same seeds, the same actions, Gymnasium's default
    next-step autoreset (the step after a done only resets, with reward 0)."""
    import gymnasium as gym

    envs = gym.make_vec("CartPole-v1", num_envs, vectorization_mode="sync")
    envs.reset(seed=0)
    envs.action_space.seed(0)
    running = np.zeros(num_envs)
    returns: list[float] = []
    truncations = 0
    pending = np.zeros(num_envs, dtype=bool)  # the next step is an autoreset step
    open_steps = np.zeros(num_envs, dtype=int)  # steps of the episode under way
    for _ in range(steps):
        _, reward, terminated, truncated, _ = envs.step(envs.action_space.sample())
        running += reward
        truncations += int(truncated.sum())
        open_steps += ~pending
        pending = terminated | truncated
        open_steps[pending] = 0
        for env in np.flatnonzero(pending):
            returns.append(running[env])
            running[env] = 0.0
    envs.close()
    tails = int((open_steps > 0).sum())
    return len(returns), float(np.mean(returns)), truncations, tails


def test_gymnasium_example_runs_as_printed(tmp_path):
    code = python_block(GYM_HEADING)
    # The truth below follows these settings; a change to them must change it too.
    for setting in ('"CartPole-v1", 8,', "range(640)", "reset(seed=0)", "action_space.seed(0)"):
        assert setting in code, f"the Gymnasium example: expected {setting!r}"
    stdout = run_example(code, tmp_path)
    match = re.search(r"^(\d+) episodes finished, mean return ([\d.]+)$", stdout, re.M)
    assert match, f"the Gymnasium example printed:\n{stdout}"
    episodes, mean_return, truncations, tails = gym_truth(num_envs=8, steps=640)
    assert int(match.group(1)) == episodes
    assert abs(float(match.group(2)) - mean_return) <= 0.006  # printed to 2 decimals
    # The observations: one row per episode, the unfinished tails included.
    match = re.search(r"^observations \((\d+), (\d+), 4\), (\d+) truncated$", stdout, re.M)
    assert match, f"the Gymnasium example printed:\n{stdout}"
    assert int(match.group(1)) == episodes + tails
    assert int(match.group(3)) == truncations


JAX_TRUTH = """
import sys
import jax
code = sys.stdin.read()
exec(code.split("with RolloutRecorder(", 1)[0])  # the rollout function, without the recorder
keys = jax.random.split(jax.random.key(0), 20)
print(sum(int(collect(key)[0]["done"].sum()) for key in keys))
"""


def test_jax_example_runs_as_printed(tmp_path):
    pytest.importorskip("jax")
    code = python_block(JAX_HEADING)
    for setting in ("T, N = 128, 64", "jax.random.split(jax.random.key(0), 20)"):
        assert setting in code, f"the JAX example: expected {setting!r}"
    stdout = run_example(code, tmp_path)
    match = re.search(r"^(\d+) episodes finished, (\d+) steps$", stdout, re.M)
    assert match, f"the JAX example printed:\n{stdout}"
    # The truth: the done flags the rollout itself produced, counted without the recorder.
    truth = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(JAX_TRUTH)],
        input=code,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(match.group(1)) == int(truth.stdout)
    # Unfinished tails are returned too (pad_incomplete=True): every step is in an episode.
    assert int(match.group(2)) == 128 * 64 * 20
    assert "positions=(" in stdout and ":int32" in stdout
