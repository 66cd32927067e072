"""`rollout-recorder demo` ends with what to try next, and each suggestion works: the
dashboard and worker commands parse, the DuckDB query runs over the dataset the demo wrote,
and the example scripts exist."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from recorder_server.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def run_demo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recorder_server", "demo", "--workers", "2", "--chunks", "3"]
        + ["--envs", "8", "--length", "64", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_demo_ends_with_next_steps_that_work(tmp_path):
    dataset = tmp_path / "dataset"
    out = run_demo("--dataset-dir", str(dataset))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    finished = int(re.search(r"\| episodes finished +\| (\d+)", text).group(1))
    assert finished > 0
    next_steps = text.split("What to try next:", 1)[1]
    commands = [line.strip() for line in next_steps.splitlines() if line.startswith("      ")]

    # The dashboard's server and a worker into it: real commands of this command line.
    serve = next(c for c in commands if " serve " in c)
    assert "--http-listen 127.0.0.1:8080" in serve and "http://127.0.0.1:8080" in next_steps
    for command in (serve, next(c for c in commands if " demo-worker " in c)):
        argv = shlex.split(command)
        at = next(i for i, word in enumerate(argv) if word in ("serve", "demo-worker"))
        build_parser().parse_args(argv[at:])

    # The query, run as printed, reads one row per episode of the dataset the demo wrote.
    duckdb = pytest.importorskip("duckdb")
    query = next(c for c in commands if "duckdb" in c)
    ran = subprocess.run(
        [sys.executable, *shlex.split(query)[1:]], cwd=ROOT, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr
    assert "episode_id" in ran.stdout and "return" in ran.stdout
    files = f"{dataset}/*/*.parquet"
    episodes = duckdb.sql(f"SELECT count(DISTINCT episode_id) FROM '{files}'").fetchall()[0][0]
    assert episodes == finished  # every finished episode, none of the unfinished tails

    for script in re.findall(r"(examples/\w+\.py)", next_steps):
        assert (ROOT / script).is_file(), script

    # A second run replaces the first run's dataset instead of mixing the two.
    assert run_demo("--dataset-dir", str(dataset)).returncode == 0
    again = duckdb.sql(f"SELECT count(DISTINCT episode_id) FROM '{files}'").fetchall()[0][0]
    assert again == finished  # the same seeds, the same episodes, once


def test_demo_never_deletes_a_directory_it_did_not_write(tmp_path):
    keep = tmp_path / "mine" / "notes.txt"
    keep.parent.mkdir()
    keep.write_text("not a dataset")
    out = run_demo("--dataset-dir", str(keep.parent))
    assert out.returncode == 2
    assert "--dataset-dir: expected a new directory or an earlier demo's dataset" in out.stderr
    assert keep.read_text() == "not a dataset"
