"""Deployment files cannot rot silently: docker-compose.yml and the Dockerfile.

- docker-compose.yml is validated against the Compose specification's JSON
  schema (tests/compose/compose-spec.json, see tests/compose/README.md) and every
  service's command runs here as a local process with the service's environment:
  the recorder (token from the compose secret), its healthcheck, then the two
  trainers, which must reach the recorder and finish.
- The Dockerfile's filesystem steps that need no root (WORKDIR, COPY, the
  `pip install` RUN line) are replayed into a fresh virtualenv, and the
  installed `rollout-recorder` serves and answers its own HEALTHCHECK.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml

from recorder_client import AuthenticationError, RolloutRecorder
from recorder_client._credentials import TOKEN_ENV, TOKEN_FILE_ENV, make_channel
from recorder_client._launch import ServerProcess
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SCHEMA = Path(__file__).resolve().parent / "compose" / "compose-spec.json"
SECRET_DIR = "/run/secrets/"
TRAINERS = ("trainer-0", "trainer-1")
SpecValidator = jsonschema.Draft201909Validator


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


# -- docker-compose.yml: the schema ---------------------------------------------------
def test_compose_file_matches_the_compose_spec_schema(compose):
    schema = json.loads(SCHEMA.read_text())
    # The file says "$schema": "http://json-schema.org/draft/2019-09/schema#", an
    # http spelling of draft 2019-09 that jsonschema does not look up by itself.
    assert "2019-09" in schema["$schema"]
    SpecValidator.check_schema(schema)
    errors = sorted(SpecValidator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_schema_refuses_what_the_spec_refuses(compose):
    # Guards against a schema that accepts anything (a wrong file, a broken $ref).
    schema = json.loads(SCHEMA.read_text())
    validator = SpecValidator(schema)
    bad_key = {**compose, "services": {**compose["services"], "x": {"imgae": "typo"}}}
    bad_condition = json.loads(json.dumps(compose))
    bad_condition["services"]["trainer-0"]["depends_on"]["recorder"]["condition"] = "healthy"
    assert not validator.is_valid(bad_key)
    assert not validator.is_valid(bad_condition)


def test_compose_file_has_the_deployment_shape(compose):
    services = compose["services"]
    assert set(services) == {"recorder", *TRAINERS}
    recorder = services["recorder"]
    assert recorder["build"] == "."
    assert recorder["restart"] in ("always", "unless-stopped", "on-failure")
    volume, _, mount = recorder["volumes"][0].partition(":")
    assert mount == "/data" and volume in compose["volumes"]  # a named volume
    test = recorder["healthcheck"]["test"]
    assert test[:3] == ["CMD", "rollout-recorder", "health"]
    assert recorder["secrets"] == ["recorder_token"]
    command = recorder["command"]
    token_path = command[command.index("--token-file") + 1]
    assert token_path == SECRET_DIR + "recorder_token"
    secret_file = REPO / compose["secrets"]["recorder_token"]["file"]
    assert secret_file.read_text().strip(), f"{secret_file} must hold a placeholder token"
    for name in TRAINERS:
        trainer = services[name]
        assert trainer["depends_on"] == {"recorder": {"condition": "service_healthy"}}
        assert trainer["environment"]["ROLLOUT_RECORDER_TARGET"] == "recorder:50051"
        assert trainer["environment"][TOKEN_FILE_ENV] == token_path
        assert trainer["secrets"] == ["recorder_token"]
        assert trainer["image"] == recorder["image"]
        assert trainer["command"][:2] == ["rollout-recorder", "demo-worker"]


# -- docker-compose.yml: each service as a local process -------------------------------------
def local_argv(command: list[str], replace: dict[str, str]) -> list[str]:
    """A service's command run with this interpreter, container paths replaced."""
    if isinstance(command, str):
        command = shlex.split(command)
    assert command[0] == "rollout-recorder", command
    return [sys.executable, "-m", "recorder_server", *(replace.get(a, a) for a in command[1:])]


def local_env(service: dict, replace: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    env.update({k: replace.get(str(v), str(v)) for k, v in environment.items()})
    return env


def wait_healthy(test: list[str], replace: dict[str, str], env: dict[str, str]) -> str:
    """Run a compose/Docker healthcheck command until it passes, as Docker would."""
    assert test[0] in ("CMD", "CMD-SHELL") and test[0] == "CMD", test
    argv = local_argv(test[1:], replace)
    out = None
    for _ in range(20):
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return out.stdout
        time.sleep(0.25)
    raise AssertionError(f"healthcheck never passed: {out.stdout}{out.stderr}")


def test_compose_services_run_as_local_processes(compose, tmp_path):
    services = compose["services"]
    token = (REPO / compose["secrets"]["recorder_token"]["file"]).read_text().strip()
    secret = tmp_path / "secrets" / "recorder_token"
    secret.parent.mkdir()
    secret.write_text(token + "\n")
    replace = {
        "0.0.0.0:50051": "127.0.0.1:0",
        "/data": str(tmp_path / "data"),
        SECRET_DIR + "recorder_token": str(secret),
    }

    recorder = services["recorder"]
    server = ServerProcess(
        command=local_argv(recorder["command"], replace), env=local_env(recorder, replace)
    )
    try:
        address = server.address
        replace["127.0.0.1:50051"] = address  # the healthcheck's target
        replace["recorder:50051"] = address  # the trainers' ROLLOUT_RECORDER_TARGET
        assert "SERVING" in wait_healthy(
            recorder["healthcheck"]["test"], replace, local_env(recorder, replace)
        )

        trainers = {
            name: subprocess.Popen(
                local_argv(services[name]["command"], replace),
                env=local_env(services[name], replace),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name in TRAINERS
        }
        for name, proc in trainers.items():
            output, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{name} failed:\n{output}"
            assert f"worker {name}: 20 chunks" in output, output

        with make_channel(address, token=token) as channel:
            status = pb_grpc.RecorderStub(channel).GetStatus(
                pb.StatusRequest(session="compose"), timeout=30
            )
        assert sorted(w.worker_id for w in status.workers) == sorted(TRAINERS)
        assert [w.chunks_stored for w in status.workers] == [20, 20]

        with pytest.raises(AuthenticationError, match="authentication failed"):
            RolloutRecorder(target=address, session="compose", token="not-the-token")
        with RolloutRecorder(
            record_states=True,
            state_fields=["player_positions", "player_inventory"],
            target=address,
            session="compose",
            worker_id="viewer",
            token=token,
        ) as viewer:
            traj = viewer.finish()
        assert traj.num_episodes > 0
        assert set(traj.worker_ids) >= set(TRAINERS)
        assert set(traj.episode_worker.tolist()) == {0, 1}
    finally:
        assert server.stop() == 0


# -- Dockerfile ------------------------------------------------------------------------
@dataclass
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    return instructions


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def pip_install_args(dockerfile: list[Instruction]) -> list[str]:
    lines = [i.args for i in dockerfile if i.keyword == "RUN" and "pip install" in i.args]
    assert len(lines) == 1, f"expected one RUN pip install line, got {lines}"
    argv = shlex.split(lines[0])
    assert argv[:2] == ["pip", "install"], argv
    return argv[2:]


def test_dockerfile_shape(dockerfile):
    first = next(i for i in dockerfile if i.keyword == "FROM")
    args = {
        m.group(1): m.group(2)
        for i in dockerfile
        if i.keyword == "ARG"
        for m in [re.fullmatch(r"(\w+)=(\S+)", i.args)]
        if m
    }
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], first.args)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", image), image
    users = [i.args for i in dockerfile if i.keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    assert any(i.keyword == "VOLUME" and "/data" in i.args for i in dockerfile)
    assert any(i.keyword == "EXPOSE" and i.args.split()[0] == "50051" for i in dockerfile)
    health = next(i.args for i in dockerfile if i.keyword == "HEALTHCHECK")
    check = exec_form(health[health.index("CMD") + 3 :].strip())
    assert check[:4] == ["rollout-recorder", "health", "--target", "127.0.0.1:50051"]
    cmd = exec_form(next(i.args for i in dockerfile if i.keyword == "CMD"))
    assert cmd[:2] == ["rollout-recorder", "serve"]
    assert cmd[cmd.index("--listen") + 1] == "0.0.0.0:50051"
    assert cmd[cmd.index("--data-dir") + 1] == "/data"
    # Runtime dependencies only.
    targets = [a for a in pip_install_args(dockerfile) if not a.startswith("-")]
    assert targets == [".[server]"], targets
    for instruction in dockerfile:
        if instruction.keyword == "COPY":
            for source in shlex.split(instruction.args)[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def replay_filesystem_steps(dockerfile: list[Instruction], root: Path, python: Path) -> None:
    """WORKDIR, COPY and the pip install RUN line, under `root` instead of `/`."""

    def place(path: str, cwd: Path) -> Path:
        return root / path.lstrip("/") if path.startswith("/") else cwd / path

    cwd = root
    for instruction in dockerfile:
        if instruction.keyword == "WORKDIR":
            cwd = place(instruction.args, cwd)
            cwd.mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            *sources, dest = shlex.split(instruction.args)
            target = place(dest, cwd)
            for source in sources:
                src = REPO / source
                if src.is_dir():  # Docker copies a directory's contents
                    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                    shutil.copytree(src, target, dirs_exist_ok=True, ignore=ignore)
                elif dest.endswith("/") or len(sources) > 1 or target.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target / src.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
        elif instruction.keyword == "RUN" and "pip install" in instruction.args:
            argv = [str(python), "-m", *shlex.split(instruction.args)]
            out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        elif instruction.keyword == "RUN" and instruction.args.startswith("python -m "):
            # The build-time compile of the store's loops, into a cache under `root`.
            first = shlex.split(instruction.args.split("&&")[0])
            env = {**os.environ, "NUMBA_CACHE_DIR": str(place(cache_dir(dockerfile), cwd))}
            out = subprocess.run(
                [str(python), *first[1:]],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def cache_dir(dockerfile: list[Instruction]) -> str:
    """The NUMBA_CACHE_DIR the image sets."""
    for instruction in dockerfile:
        if instruction.keyword == "ENV" and instruction.args.startswith("NUMBA_CACHE_DIR="):
            return instruction.args.split("=", 1)[1]
    raise AssertionError("the Dockerfile sets no NUMBA_CACHE_DIR")


def test_dockerfile_install_step_in_a_fresh_venv(dockerfile, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    replay_filesystem_steps(dockerfile, tmp_path / "image", bin_dir / "python")

    cache = tmp_path / "image" / cache_dir(dockerfile).lstrip("/")
    assert any(cache.rglob("*.nbi")), f"the build step left no compiled loops in {cache}"

    cli = str(bin_dir / "rollout-recorder")
    for argv in ([cli, "--help"], [cli, "health", "--help"], [cli, "serve", "--help"]):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    serve_help = subprocess.run([cli, "serve", "--help"], capture_output=True, text=True).stdout
    for flag in ("--token-file", "--tls-cert", "--tls-key", "--tls-client-ca"):
        assert flag in serve_help, flag

    # Runtime only: the server's standard services are there, no dev tools are.
    probe = "import grpc_health.v1.health, grpc_reflection.v1alpha.reflection, recorder_server"
    out = subprocess.run([str(bin_dir / "python"), "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listed = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert not installed & {"pytest", "ruff", "grpcio-tools", "hypothesis"}, installed

    # The image's CMD and HEALTHCHECK, with the installed command.
    cmd = exec_form(next(i.args for i in dockerfile if i.keyword == "CMD"))
    argv = [cli, *cmd[1:]]
    argv[argv.index("0.0.0.0:50051")] = "127.0.0.1:0"
    argv[argv.index("/data")] = str(tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    server = ServerProcess(command=argv, env=env)
    try:
        address = server.address
        health = next(i.args for i in dockerfile if i.keyword == "HEALTHCHECK")
        check = exec_form(health[health.index("CMD") + 3 :].strip())
        check = [cli, *(address if a == "127.0.0.1:50051" else a for a in check[1:])]
        out = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("SERVING")
    finally:
        assert server.stop() == 0
