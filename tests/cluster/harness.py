"""The cluster harness: nodes (a real `rollout-recorder serve` each, started with the flags of
deploy/compose.cluster.yml), trainer processes, one S3 endpoint (moto in server mode), and a
fault proxy on every path: trainers -> sidecar, sidecar -> S3, reader -> S3.

Truth is what each trainer recorded and got acknowledged, kept by the trainer itself
(tests/cluster/trainer.py). The aggregator reads the dataset through the reader's proxy with
`read_episodes` and with DuckDB, and merges the nodes' trajectory-store archives with
`rollout-recorder store merge`.

Mode: every path goes through a userland proxy (no root, no kernel features); this harness
does not use network namespaces.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from conftest import free_port

from recorder_client._launch import ServerProcess

from .proxy import FaultProxy
from .trainer import N, chunk

MODE = "proxy"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COMPOSE = REPO / "deploy" / "compose.cluster.yml"
SESSION = "run"
TOKEN = "cluster-harness-token"


def sidecar_argv(uri: str, node: str, listen: str, data_dir: Path, token_file: Path) -> list[str]:
    """The recorder service's command of deploy/compose.cluster.yml, as a local process."""
    from test_deploy import interpolate, local_argv

    service = yaml.safe_load(COMPOSE.read_text())["services"]["recorder"]
    command = interpolate(
        service["command"], {"RECORDER_DATASET_URI": uri, "RECORDER_NODE_ID": node}
    )
    replace = {
        "0.0.0.0:50051": listen,
        "/data": str(data_dir),
        "/run/secrets/recorder_token": str(token_file),
    }
    return local_argv(command, replace)


class Node:
    """One node: its sidecar on a fixed port (a restart keeps the address), the proxy its
    trainers reach it through, and the proxy it reaches S3 through."""

    def __init__(self, cluster: Cluster, name: str, extra: list[str]) -> None:
        self.cluster, self.name, self.extra = cluster, name, extra
        self.port, self.metrics_port = free_port(), free_port()
        self.data_dir = cluster.root / name
        self.log_path = cluster.root / f"{name}.log"
        self.s3 = FaultProxy(cluster.s3_hostport, name=f"{name} -> s3")
        self.front = FaultProxy(f"127.0.0.1:{self.port}", name=f"trainers -> {name}")
        self.process: ServerProcess | None = None

    @property
    def target(self) -> str:
        """Where trainers reach this node's sidecar: through its proxy."""
        return self.front.address

    def start(self) -> None:
        argv = sidecar_argv(
            self.cluster.uri,
            self.name,
            f"127.0.0.1:{self.port}",
            self.data_dir,
            self.cluster.token_file,
        )
        argv += ["--metrics-listen", f"127.0.0.1:{self.metrics_port}", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(self.cluster.aws, AWS_ENDPOINT_URL=f"http://{self.s3.address}")
        with open(self.log_path, "a") as log:
            self.process = ServerProcess(command=argv, env=env, stderr=log, startup_timeout=90)

    def kill(self) -> None:
        """SIGKILL, as a node lost."""
        assert self.process is not None
        self.process.process.send_signal(signal.SIGKILL)
        self.process.process.wait(10)

    def stop(self) -> int | None:
        return None if self.process is None else self.process.stop(45)

    def metric(self, name: str) -> float | None:
        """A Prometheus value of session "run" (name without the rollout_recorder_ prefix)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.metrics_port}/metrics",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        try:
            text = urllib.request.urlopen(request, timeout=5).read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(f"rollout_recorder_{name}{{") and f'session="{SESSION}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return None


@dataclass
class Truth:
    """What one trainer's own file says."""

    worker: str
    seed: int
    kept: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    acked: int = 0
    longest_record_s: float = 0.0
    stream_ended: list[float] = field(default_factory=list)
    ended: bool = False
    ready: bool = False

    def episodes(self, *, possible: bool = False) -> tuple[Counter, Counter]:
        """(recorded, acknowledged) whole finished episodes of the kept chunks, each as
        (worker, env, start, length, reward bytes), on the time axis of the kept chunks;
        acknowledged: its last chunk was acknowledged. Chunks dropped at the in-flight cap
        are a hole: an episode that reaches back to one is not whole (its start was in the
        hole) and is left out. ``possible``: for a killed trainer, also the chunk after its
        last line (record() may have taken it just before the kill)."""
        recorded, acked = Counter(), Counter()
        kept = list(self.kept)
        if possible and not self.ended and not self.dropped:
            kept.append(max(kept, default=-1) + 1)
        if not kept:
            return recorded, acked
        parts = [chunk(self.seed, i)[0] for i in kept]
        lengths = np.cumsum([p["done"].shape[0] for p in parts])
        # Where a kept chunk follows dropped ones: the step its first row takes.
        holes = [0] if kept[0] > 0 else []
        holes += [int(lengths[i - 1]) for i in range(1, len(kept)) if kept[i] != kept[i - 1] + 1]
        done = np.concatenate([p["done"] for p in parts])
        reward = np.concatenate([p["reward"] for p in parts])
        for env in range(N):
            start = 0
            for t in np.flatnonzero(done[:, env]).tolist():
                if not any(start <= hole <= t for hole in holes):
                    key = (
                        self.worker,
                        env,
                        start,
                        t + 1 - start,
                        reward[start : t + 1, env].tobytes(),
                    )
                    recorded[key] += 1
                    if int(np.searchsorted(lengths, t, side="right")) < self.acked:
                        acked[key] += 1
                start = t + 1
        return recorded, acked


class Trainer:
    """A trainer process (tests/cluster/trainer.py) recording to a node through its proxy."""

    def __init__(self, cluster: Cluster, node: Node, worker: str, seed: int, **options) -> None:
        self.worker, self.seed = worker, seed
        self.truth_path = cluster.root / f"{worker}.truth.jsonl"
        argv = [sys.executable, str(HERE / "trainer.py"), "--target", node.target]
        argv += ["--session", SESSION, "--worker", worker, "--seed", str(seed)]
        argv += ["--truth", str(self.truth_path), "--go", str(cluster.go_file)]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "ROLLOUT_RECORDER_TOKEN_FILE": str(cluster.token_file)}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
        self.log = open(cluster.root / f"{worker}.log", "w")  # noqa: SIM115 - closed in wait
        self.process = subprocess.Popen(argv, env=env, stdout=self.log, stderr=self.log)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.log.close()

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self.log.close()
        return code

    def truth(self) -> Truth:
        out = Truth(self.worker, self.seed)
        if not self.truth_path.exists():
            return out
        for line in self.truth_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # the last line of a killed trainer may be cut
                continue
            if "chunk" in entry:
                (out.kept if entry["kept"] else out.dropped).append(entry["chunk"])
                out.longest_record_s = max(out.longest_record_s, entry["took"])
            elif "acked" in entry:
                out.acked = max(out.acked, entry["acked"])
            elif "stream_ended" in entry:
                out.stream_ended.append(entry["t"])
            elif entry.get("end"):
                out.ended = True
            elif entry.get("ready"):
                out.ready = True
        return out


class Cluster:
    """Nodes writing one dataset on one S3 endpoint, and the reader's proxy to it."""

    def __init__(self, root: Path, s3, bucket: str) -> None:
        self.root = root
        self.token_file = root / "recorder_token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.uri = f"{s3.make_bucket(bucket)}/episodes"
        self.s3_hostport = s3.endpoint.removeprefix("http://")
        self.aws = {k: v for k, v in s3.environment.items() if k != "AWS_ENDPOINT_URL"}
        self.reader = FaultProxy(self.s3_hostport, name="reader -> s3")
        self.go_file = root / "go"
        self.nodes: dict[str, Node] = {}
        self.trainers: list[Trainer] = []
        print(f"cluster mode: {MODE} (every path through a fault proxy; no network namespaces)")

    def add_node(self, name: str, *extra: str) -> Node:
        node = self.nodes[name] = Node(self, name, list(extra))
        return node

    def add_trainer(self, node: Node, worker: str, seed: int, **options) -> Trainer:
        trainer = Trainer(self, node, worker, seed, **options)
        self.trainers.append(trainer)
        return trainer

    def go(self, seconds: float, timeout: float = 90.0) -> float:
        """Once every trainer has joined, let them record for ``seconds``; the start time."""
        assert wait_until(lambda: all(t.truth().ready for t in self.trainers), timeout, 0.2)
        start = time.time()
        temp = self.go_file.with_suffix(".tmp")
        temp.write_text(str(start + seconds))
        temp.replace(self.go_file)
        return start

    @property
    def storage_options(self) -> dict:
        return {"client_kwargs": {"endpoint_url": f"http://{self.reader.address}"}}

    def close(self) -> None:
        for trainer in self.trainers:
            if trainer.process.poll() is None:
                trainer.kill()
        for node in self.nodes.values():
            if node.process is not None and node.process.alive():
                node.process.process.kill()
                node.process.process.wait(10)
        for node in self.nodes.values():
            node.front.close()
            node.s3.close()
        self.reader.close()


# -- the aggregator -------------------------------------------------------------------------
def dataset_episodes(cluster: Cluster) -> Counter:
    """Every episode in the dataset, through the reader's proxy, by `read_episodes`, as
    (worker, env, start, length, reward bytes)."""
    from recorder_client.dataset import read_episodes

    got = read_episodes(cluster.uri, SESSION, storage_options=cluster.storage_options)
    out: Counter = Counter()
    for b, n in enumerate(got.lengths.tolist()):
        key = (
            got.worker_ids[int(got.episode_worker[b])],
            int(got.episode_env[b]),
            int(got.episode_start[b]),
            n,
            got.rewards[b, :n].astype(np.float32).tobytes(),
        )
        out[key] += 1
    return out


def duckdb_episodes(cluster: Cluster) -> Counter:
    """The same from DuckDB over the dataset's files: (worker, env, start, length) -> count of
    episode ids (a duplicate shows as 2, or as a doubled length)."""
    import duckdb

    from recorder_client.dataset import open_dataset

    steps = open_dataset(cluster.uri, storage_options=cluster.storage_options)
    con = duckdb.connect()
    con.register("steps", steps)
    # Whole episodes, as read_episodes gives by default (a drop leaves marked pieces).
    whole = (
        "WHERE coalesce(CAST(partial AS VARCHAR), '') = '' "
        if "partial" in steps.schema.names
        else ""
    )
    rows = con.execute(
        "SELECT CAST(worker AS VARCHAR), env, start, count(*) AS length, "
        f"count(DISTINCT episode_id) AS ids FROM steps {whole}GROUP BY ALL"
    ).fetchall()
    return Counter({(w, int(e), int(s), int(n)): int(ids) for w, e, s, n, ids in rows})


def store_files(cluster: Cluster) -> list[Path]:
    """Each node's trajectory-store checkpoint, downloaded as clients get it."""
    from recorder_client import RolloutRecorder

    from .trainer import capture_config

    files = []
    for name, node in cluster.nodes.items():
        rec = RolloutRecorder(
            record_states=True,
            state_fields=("player_positions",),
            capture=capture_config(),
            target=node.target,
            session=SESSION,
            worker_id=f"reader-{name}",
            token=TOKEN,
        )
        try:
            file = rec.capture.trajectory_store_checkpoint_file()
        finally:
            rec.close()
        path = cluster.root / f"{name}-{file.name}"
        path.write_bytes(file.data)
        files.append(path)
    return files


def merge(cluster: Cluster, files: list[Path]) -> dict:
    """`rollout-recorder store merge` of the files, labelled by node; the merged state."""
    from store_helpers import store_merge

    from recorder_server.store.merge import read_checkpoint_state

    out = cluster.root / "merged.bin.zst"
    store_merge(files, out, list(cluster.nodes), timeout=120)
    return read_checkpoint_state(out.read_bytes())


def union_store(cluster: Cluster):
    """One store (the server's own TrajectoryStore) fed every episode of the dataset."""
    from recorder_client.dataset import read_episodes, trajectory_name
    from recorder_server.store import TrajectoryStore
    from recorder_server.store.sources import EpisodeArrays

    from .trainer import capture_config

    got = read_episodes(cluster.uri, SESSION, storage_options=cluster.storage_options)
    store = TrajectoryStore(capture_config())
    positions = got.states[trajectory_name("player_positions")]
    for b, n in enumerate(got.lengths.tolist()):
        episode = EpisodeArrays(
            got.actions[b, :n], got.rewards[b, :n], {"player_positions": positions[b, :n]}
        )
        store.record_episode(episode, step=b)
    return store


def assert_merge_equals_union(merged: dict, union) -> int:
    """Cell for cell, by key: visits, best return and step, utility sums (up to rounding),
    times chosen. (Trajectory ids, first-seen steps and the cell order are each store's own
    clock and numbering.) Returns the number of cells."""
    got, want = merged["arrays"], union.checkpoint_state()["arrays"]
    keys = [tuple(k) for k in got["archive/keys"].tolist()]
    where = {tuple(k): i for i, k in enumerate(want["archive/keys"].tolist())}
    assert sorted(keys) == sorted(where), "the merged archive's cells differ from the union's"
    order = np.array([where[k] for k in keys], dtype=np.int64)
    for name in ("visits", "best_step", "best_return", "times_chosen"):
        np.testing.assert_array_equal(got[f"archive/{name}"], want[f"archive/{name}"][order], name)
    for name in [n for n in want if n.startswith("utility/")]:
        np.testing.assert_allclose(got[name], want[name][order], rtol=1e-9, atol=1e-9)
    assert merged["counters"]["episodes"] == union.checkpoint_state()["counters"]["episodes"]
    return len(keys)


def wait_until(predicate, timeout: float, interval: float = 0.5) -> float | None:
    """Seconds until ``predicate()`` held, or None when it did not within ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None
