"""`pip install rollout-recorder` with no extras, in a fresh virtual environment.

The embedded default (`RolloutRecorder()` without a target) must record and finish on the
client's packages alone (grpcio, protobuf, numpy, zstandard). What needs the server extra (a
trajectory store, a metrics endpoint) fails at once with a message naming
``pip install 'rollout-recorder[server]'``.

The project is copied before it is installed: pip builds in the source tree, and its build/
and egg-info directories have no place in the working tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRA = "pip install 'rollout-recorder[server]'"
SERVER_ONLY = ("numba", "prometheus_client", "tensorboardX", "grpc_health", "grpc_reflection")

SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import numpy as np
    from recorder_client import (
        CellField, RecorderError, RolloutRecorder, TrajectoryTrainingConfiguration,
    )

    present = [m for m in json.loads(sys.argv[1]) if importlib.util.find_spec(m) is not None]
    done = np.zeros((4, 2), bool)
    done[1, 0] = done[2, 1] = True
    chunk = {"action": np.arange(8).reshape(4, 2), "reward": np.ones((4, 2)), "done": done}
    with RolloutRecorder(max_episodes=3) as rec:
        rec.record(chunk)
        out = rec.finish()
    capture = TrajectoryTrainingConfiguration(cell_fields=(CellField("player_positions", (0, 0)),))
    try:
        with RolloutRecorder(capture=capture, record_states=True):
            refused = None
    except RecorderError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    print(json.dumps({
        "present": present,
        "lengths": out.lengths.tolist(),
        "episodes": [out.actions[b, :n].tolist() for b, n in enumerate(out.lengths)],
        "refused": refused,
    }))
    """
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def project_source(parent: Path) -> Path:
    """The project's build inputs (metadata, client/, server/) copied to ``parent``/src, so
    that pip's build/ lands in the copy."""
    source = parent / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *(p.name for p in ROOT.glob("LICENSE*"))):
        shutil.copy2(ROOT / name, source / name)
    for package in ("client", "server"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return source


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh venv holding `pip install <this project>`, no extras; returns (bin, env)."""
    root = tmp_path_factory.mktemp("packaging")
    source = project_source(root)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("ROLLOUT_RECORDER_")
    }
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], root, env, 120)
    bin_dir = venv / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(source)], root, env, 240)
    return bin_dir, env


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_embedded_default_works_without_the_server_extra(bare_venv, tmp_path):
    import json

    bin_dir, env = bare_venv
    out = _run([str(bin_dir / "python"), "-c", SCRIPT, json.dumps(SERVER_ONLY)], tmp_path, env, 120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["present"] == [], f"the bare install has server packages: {result['present']}"
    assert result["lengths"] == [2, 2, 3]
    assert sorted(result["episodes"]) == [[0, 2], [1, 3, 5], [4, 6]]
    # A store needs numba: refused at Join, naming the pip line.
    assert result["refused"] is not None, "capture= worked without numba"
    assert EXTRA in result["refused"] and "numba" in result["refused"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_cli_without_the_server_extra(bare_venv, tmp_path):
    bin_dir, env = bare_venv
    cli = str(bin_dir / "rollout-recorder")
    out = _run([cli, "--version"], tmp_path, env, 60)
    assert out.stdout.strip() == "rollout-recorder 0.1.0"
    serve = [cli, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    for flags, package in (
        (["--metrics-listen", "127.0.0.1:0"], "prometheus-client"),
        (["--tensorboard-dir", str(tmp_path / "tb")], "tensorboardX"),
    ):
        done = subprocess.run(
            [*serve, *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert f"needs {package}" in done.stderr and EXTRA in done.stderr
    # The dataset sink needs the dataset extra: refused at start, naming it.
    done = subprocess.run(
        [*serve, "--dataset-uri", str(tmp_path / "ds")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "pip install 'rollout-recorder[dataset]'" in done.stderr
    reader = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import recorder_client; recorder_client.read_episodes('d')",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reader.returncode == 1 and "ImportError" in reader.stderr
    assert "pip install 'rollout-recorder[dataset]'" in reader.stderr
    health = subprocess.run(
        [cli, "health", "--target", "127.0.0.1:1", "--timeout", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert health.returncode == 1 and "needs grpcio-health-checking" in health.stdout


@pytest.mark.timeout(180)
def test_the_wheel_carries_every_module_and_the_dashboard_files(tmp_path):
    """Every .py file under client/ and server/ and every file of the dashboard's static/
    directory is in the wheel, and setuptools finds no importable directory left out of
    the `packages` configuration."""
    import zipfile

    source = project_source(tmp_path)
    wheels = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
    out = _run([*cmd, "-w", str(wheels), str(source)], tmp_path, dict(os.environ), 150)
    assert "absent from the `packages` configuration" not in out.stdout + out.stderr
    (wheel,) = wheels.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{installed}/{path.relative_to(ROOT / directory).as_posix()}"
        for directory, installed in (("client", "recorder_client"), ("server", "recorder_server"))
        for path in (ROOT / directory).rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (path.suffix == ".py" or path.parent == ROOT / "server" / "dashboard" / "static")
    }
    assert any("/dashboard/static/" in name for name in expected)
    assert expected <= names, sorted(expected - names)
