"""Deployment files cannot rot silently: docker-compose.yml, the Dockerfile, and the
multi-node files deploy/compose.cluster.yml and deploy/kubernetes/daemonset.yaml.

- docker-compose.yml is validated against the Compose specification's JSON
  schema (tests/compose/compose-spec.json, see tests/compose/README.md) and every
  service's command runs here as a local process with the service's environment:
  the recorder (token from the compose secret), its healthcheck, then the two
  trainers, which must reach the recorder and finish.
- The Dockerfile's filesystem steps that need no root (WORKDIR, COPY, the
  `pip install` RUN line) are replayed into a fresh virtualenv, and the
  installed `rollout-recorder` serves and answers its own HEALTHCHECK.
- deploy/compose.cluster.yml is validated against the same schema, its required variables
  and MinIO settings are checked, minio-init's script runs with a stand-in `mc`, and the
  recorder (variables set to test values: a local directory, or an S3 server reached through
  the AWS variables it passes through) and the trainer run as local processes; the episodes
  must be in the dataset under the node id.
- deploy/kubernetes/daemonset.yaml is parsed and checked for agreement (ports, probes,
  volumes, variables, the stop deadline, the header's trainer snippet); the container's
  command runs locally with the kubelet's values, its probes pass, and a trainer set up as
  the header says records into it.
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
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from recorder_client import AuthenticationError, RolloutRecorder, open_dataset, read_episodes
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


# -- deploy/compose.cluster.yml: one node of a multi-node run --------------------------------
CLUSTER_FILE = REPO / "deploy" / "compose.cluster.yml"
MINIO_ENV = REPO / "deploy" / "minio.env"
AWS_PASSED = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
)
_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER_FILE.read_text())


def interpolate(value, shell: dict[str, str]):
    """Compose's interpolation of every string in ``value``: $$, $VAR, ${VAR}, ${VAR:-x},
    ${VAR-x}, ${VAR:?message} and ${VAR?message} (ValueError naming the variable)."""
    if isinstance(value, dict):
        return {k: interpolate(v, shell) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, shell) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"] or "", m["arg"]
        current = shell.get(name)
        missing = current is None or (current == "" and op.startswith(":"))
        if op.endswith("-"):
            return arg if missing else current
        if op.endswith("?"):
            if missing:
                raise ValueError(f"required variable {name} is missing a value: {arg}")
            return current
        return current or ""

    return _VARIABLE.sub(one, value)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as `docker compose --env-file` reads them (comments and blanks skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


def compose_environment(service: dict, shell: dict[str, str]) -> dict[str, str]:
    """A service's environment as Compose sets it: NAME=VALUE entries as given, a bare NAME
    (or a null value) passed through from the shell when the shell sets it."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(
            item.split("=", 1) if "=" in item else (item, None) for item in environment
        )
    out = {}
    for name, value in environment.items():
        if value is None:
            if name in shell:
                out[name] = shell[name]
        else:
            out[name] = str(value)
    return out


def process_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without tokens and AWS settings, plus ``extra``: a local process sees
    only what the deployment file gives it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (TOKEN_ENV, TOKEN_FILE_ENV) and not k.startswith("AWS_")
    }
    return {**env, **extra}


def seconds(duration: str | int) -> float:
    """A compose duration such as ``45s``, ``1m30s`` or a bare number of seconds."""
    if isinstance(duration, int):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def stop_takes_at_most(argv: list[str]) -> float:
    """Seconds `serve` with these arguments may take to stop on SIGTERM (see cli/serve.py)."""
    from recorder_server.cli.main import build_parser
    from recorder_server.cli.serve import STOP_DEADLINE_S
    from recorder_server.dataset.sink import DatasetOptions

    args = build_parser().parse_args(argv)
    total = args.grace + STOP_DEADLINE_S
    if args.dataset_uri is not None:
        total += DatasetOptions(uri=args.dataset_uri).stop_timeout
    return total


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cluster_compose_file_matches_the_compose_spec_schema(cluster):
    validator = SpecValidator(json.loads(SCHEMA.read_text()))
    for document in (cluster, interpolate(cluster, read_env_file(MINIO_ENV))):
        errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_cluster_compose_needs_a_node_id_and_a_dataset_uri(cluster):
    shell = read_env_file(MINIO_ENV)
    interpolate(cluster, shell)
    for name in ("RECORDER_NODE_ID", "RECORDER_DATASET_URI"):
        for without in ({k: v for k, v in shell.items() if k != name}, {**shell, name: ""}):
            with pytest.raises(ValueError, match=f"required variable {name}"):
                interpolate(cluster, without)


def test_cluster_compose_file_has_the_node_shape(cluster):
    services = cluster["services"]
    assert set(services) == {"recorder", "trainer", "minio", "minio-init"}
    recorder, trainer = services["recorder"], services["trainer"]
    assert (CLUSTER_FILE.parent / recorder["build"] / "Dockerfile").is_file()
    assert "profiles" not in recorder and "profiles" not in trainer
    assert services["minio"]["profiles"] == services["minio-init"]["profiles"] == ["minio"]
    command = recorder["command"]
    assert command[:2] == ["rollout-recorder", "serve"]
    assert flag(command, "--dataset-uri").startswith("${RECORDER_DATASET_URI:?")
    assert flag(command, "--node-id").startswith("${RECORDER_NODE_ID:?")
    assert flag(command, "--data-dir") == "/data"
    volume, _, mount = recorder["volumes"][0].partition(":")
    assert mount == "/data" and volume in cluster["volumes"]  # a named volume: it outlives
    # AWS settings pass through from the shell, unset when the shell has none.
    assert set(AWS_PASSED) <= set(recorder["environment"])
    port = flag(command, "--listen").rpartition(":")[2]
    test = recorder["healthcheck"]["test"]
    assert test[:4] == ["CMD", "rollout-recorder", "health", "--target"]
    assert test[4] == f"127.0.0.1:{port}"
    shell = read_env_file(MINIO_ENV)
    argv = interpolate(command, shell)[1:]
    assert seconds(recorder["stop_grace_period"]) > stop_takes_at_most(argv)
    assert trainer["depends_on"] == {"recorder": {"condition": "service_healthy"}}
    assert trainer["environment"]["ROLLOUT_RECORDER_TARGET"] == f"recorder:{port}"
    assert trainer["environment"][TOKEN_FILE_ENV] == flag(command, "--token-file")
    assert trainer["image"] == recorder["image"]
    secret = CLUSTER_FILE.parent / cluster["secrets"]["recorder_token"]["file"]
    assert secret.read_text().strip(), f"{secret} must hold a placeholder token"
    # minio.env: MinIO's root user is the key pair the recorder sends, at the minio service.
    minio = interpolate(services["minio"], shell)
    assert minio["environment"]["MINIO_ROOT_USER"] == shell["AWS_ACCESS_KEY_ID"]
    assert minio["environment"]["MINIO_ROOT_PASSWORD"] == shell["AWS_SECRET_ACCESS_KEY"]
    endpoint = urlparse(shell["AWS_ENDPOINT_URL"])
    assert endpoint.hostname == "minio" and endpoint.port == 9000
    assert shell["RECORDER_DATASET_URI"].startswith("s3://")


def test_cluster_compose_minio_init_creates_the_dataset_bucket(cluster, tmp_path):
    """minio-init's script, run by /bin/sh with a stand-in `mc` that records its arguments."""
    shell = read_env_file(MINIO_ENV)
    init = interpolate(cluster["services"]["minio-init"], shell)
    assert init["depends_on"] == {"minio": {"condition": "service_started"}}
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "mc"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:{os.environ['PATH']}", **compose_environment(init, shell)}
    out = subprocess.run(init["entrypoint"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    bucket = urlparse(shell["RECORDER_DATASET_URI"]).netloc
    user, password = shell["AWS_ACCESS_KEY_ID"], shell["AWS_SECRET_ACCESS_KEY"]
    assert calls.read_text().splitlines() == [
        f"alias set local {shell['AWS_ENDPOINT_URL']} {user} {password}",
        f"mb --ignore-existing local/{bucket}",
    ]


@pytest.mark.parametrize("store", ["local", "s3"])
def test_cluster_compose_services_run_as_local_processes(cluster, tmp_path, request, store):
    """The recorder's command with test values for the variables (a local directory, or an S3
    server reached through the passed-through AWS variables), its healthcheck, the trainer;
    then every episode is in the dataset under the node id."""
    shell = {"RECORDER_NODE_ID": "node-a"}
    if store == "local":
        uri = str(tmp_path / "dataset")
    else:
        s3 = request.getfixturevalue("s3")
        uri = f"{s3.make_bucket('compose-cluster')}/run-1"
        shell.update(s3.environment)
    shell["RECORDER_DATASET_URI"] = uri
    services = interpolate(cluster, shell)["services"]
    token = (CLUSTER_FILE.parent / cluster["secrets"]["recorder_token"]["file"]).read_text()
    secret = tmp_path / "secrets" / "recorder_token"
    secret.parent.mkdir()
    secret.write_text(token)
    replace = {
        "0.0.0.0:50051": "127.0.0.1:0",
        "/data": str(tmp_path / "data"),
        SECRET_DIR + "recorder_token": str(secret),
    }

    def env_of(service: dict) -> dict[str, str]:
        given = compose_environment(service, shell)
        return process_env({k: replace.get(v, v) for k, v in given.items()})

    recorder, trainer = services["recorder"], services["trainer"]
    if store == "s3":  # the recorder reaches S3 only through what compose passes through
        assert {k: env_of(recorder)[k] for k in s3.environment} == s3.environment
    server = ServerProcess(command=local_argv(recorder["command"], replace), env=env_of(recorder))
    try:
        replace["127.0.0.1:50051"] = replace["recorder:50051"] = server.address
        assert "SERVING" in wait_healthy(recorder["healthcheck"]["test"], replace, env_of(recorder))
        out = subprocess.run(
            local_argv(trainer["command"], replace),
            env=env_of(trainer),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "worker node-a-trainer-0: 20 chunks" in out.stdout, out.stdout
    finally:
        assert server.stop() == 0  # SIGTERM: the sidecar writes what it has left first
    episodes = read_episodes(uri, "cluster")
    assert episodes.num_episodes > 0
    assert list(episodes.worker_ids) == ["node-a-trainer-0"]
    assert set(open_dataset(uri).to_table(columns=["node"])["node"].to_pylist()) == {"node-a"}


# -- deploy/kubernetes/daemonset.yaml: one sidecar per node -----------------------------------
DAEMONSET_FILE = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
K8S_VARIABLE = re.compile(r"\$\((\w+)\)")


@pytest.fixture(scope="module")
def daemonset() -> dict:
    documents = list(yaml.safe_load_all(DAEMONSET_FILE.read_text()))
    assert len(documents) == 1, "one DaemonSet"
    return documents[0]


def recorder_container(daemonset: dict) -> dict:
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    return container


def header_trainer_env() -> list[dict]:
    """The trainer `env:` snippet in the file's header comment, parsed."""
    lines, inside = [], False
    for line in DAEMONSET_FILE.read_text().splitlines():
        if line.startswith("#   env:"):
            inside = True
        elif inside and not line.startswith("#   "):
            break
        if inside:
            lines.append(line[1:])
    return yaml.safe_load("\n".join(lines))["env"]


def image_uid(dockerfile: list[Instruction]) -> int:
    [uid] = [
        int(m.group(1))
        for i in dockerfile
        if i.keyword == "RUN"
        for m in [re.search(r"useradd .*--uid (\d+)", i.args)]
        if m
    ]
    return uid


def test_daemonset_is_coherent(daemonset, dockerfile):
    from recorder_server.cli.main import build_parser

    assert (daemonset["apiVersion"], daemonset["kind"]) == ("apps/v1", "DaemonSet")
    spec = daemonset["spec"]
    template = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert spec["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0  # one pod per directory
    pod = template["spec"]
    container = recorder_container(daemonset)
    argv = container["command"] + container["args"]
    assert argv[:2] == ["rollout-recorder", "serve"]
    args = build_parser().parse_args(argv[1:])
    host, _, port = args.listen.rpartition(":")
    assert host == "0.0.0.0"
    [grpc_port] = container["ports"]
    assert grpc_port["containerPort"] == grpc_port["hostPort"] == int(port)
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[name]
        command = probe["exec"]["command"]
        assert command[:4] == ["rollout-recorder", "health", "--target", f"127.0.0.1:{port}"]
        assert float(flag(command, "--timeout")) < probe["timeoutSeconds"], name

    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert args.node_id == "$(NODE_NAME)"
    assert args.dataset_uri == "$(RECORDER_DATASET_URI)"
    assert env["RECORDER_DATASET_URI"]["value"].startswith("s3://")
    for arg in argv:
        for name in K8S_VARIABLE.findall(arg):
            assert name in env, f"{arg}: ${name} is not in the container's env"
    assert [e["secretRef"]["name"] for e in container["envFrom"]] == ["rollout-recorder-aws"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    data = mounts[args.data_dir]
    assert data["hostPath"]["type"] == "DirectoryOrCreate"  # outlives the pod (see header)
    token_dir, _, key = args.token_file.rpartition("/")
    assert "secretName" in mounts[token_dir]["secret"] and key
    uid = image_uid(dockerfile)
    assert container["securityContext"]["runAsUser"] == uid
    [init] = pod["initContainers"]
    assert init["command"] == ["chown", f"{uid}:{uid}", args.data_dir]
    assert [m["name"] for m in init["volumeMounts"]] == [
        m["name"] for m in container["volumeMounts"] if m["mountPath"] == args.data_dir
    ]
    assert pod["terminationGracePeriodSeconds"] > stop_takes_at_most(argv[1:])

    # The header's trainer snippet reaches this port on its node, with this token.
    trainer = {e["name"]: e for e in header_trainer_env()}
    assert trainer["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert trainer["ROLLOUT_RECORDER_TARGET"]["value"] == f"$(HOST_IP):{port}"
    assert trainer[TOKEN_FILE_ENV]["value"] == args.token_file


def test_daemonset_container_runs_as_a_local_process(daemonset, tmp_path):
    """The container's command with the kubelet's values (node name, volumes under tmp_path,
    a local dataset), its probes, and a trainer configured as the header says."""
    container = recorder_container(daemonset)
    node = "node-b"
    uri = str(tmp_path / "dataset")
    values = {}
    for e in container["env"]:
        if "valueFrom" in e:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            values[e["name"]] = node
        else:
            values[e["name"]] = e["value"]
    values["RECORDER_DATASET_URI"] = uri
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in container["volumeMounts"]}
    token = (REPO / "deploy" / "recorder_token.example").read_text().strip()

    def local(arg: str) -> str:
        arg = K8S_VARIABLE.sub(lambda m: values[m.group(1)], arg)
        if arg == "0.0.0.0:50051":
            return "127.0.0.1:0"
        for path, directory in mounts.items():
            if arg == path or arg.startswith(path + "/"):
                return str(directory) + arg[len(path) :]
        return arg

    argv = [local(a) for a in container["command"] + container["args"]]
    token_file = Path(flag(argv, "--token-file"))
    token_file.parent.mkdir(parents=True)
    token_file.write_text(token + "\n")
    server = ServerProcess(command=local_argv(argv, {}), env=process_env(values))
    try:
        address = server.address
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[name]["exec"]["command"]
            check = local_argv(command, {"127.0.0.1:50051": address})
            out = subprocess.run(
                check, env=process_env({}), capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0 and out.stdout.startswith("SERVING"), out.stdout
        trainer = {}
        for e in header_trainer_env():
            if "valueFrom" in e:
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
                trainer[e["name"]] = "127.0.0.1"
            else:
                trainer[e["name"]] = local(K8S_VARIABLE.sub(lambda m: trainer[m[1]], e["value"]))
        assert trainer["ROLLOUT_RECORDER_TARGET"] == "127.0.0.1:50051"
        trainer["ROLLOUT_RECORDER_TARGET"] = address
        out = subprocess.run(
            local_argv(
                ["rollout-recorder", "demo-worker", "--session", "k8s", "--worker-id", "t0"], {}
            ),
            env=process_env(trainer),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        assert server.stop() == 0  # SIGTERM: the sidecar writes what it has left first
    episodes = read_episodes(uri, "k8s")
    assert episodes.num_episodes > 0 and list(episodes.worker_ids) == ["t0"]
    assert set(open_dataset(uri).to_table(columns=["node"])["node"].to_pylist()) == {node}
