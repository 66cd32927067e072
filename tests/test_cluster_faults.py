"""Many nodes under real network faults (tests/cluster/): each node a real `serve` started with
deploy/compose.cluster.yml's flags, two trainer processes per node, one S3 endpoint (moto),
and a fault proxy on every path. The five faults run at once, one node each, so that the
module fits its time (the faults are independent: each has its own node, trainers and paths):

- ``s3cut``: the node's path to S3 cut for 30 s while its trainers record;
- ``s3hole``: the same path blackholed for 30 s (S3 timeouts turn it into a retry);
- ``front``: its trainers' path to the sidecar cut for 30 s, then (after 10 s of service, so
  that a live stream meets it) blackholed for 30 s; one trainer blocks at its in-flight cap,
  the other drops; keepalive 5 s, so a blackhole must be seen within 10 s;
- ``lost``: the sidecar and its trainers killed (-9) together, the sidecar restarted from its
  data directory;
- ``s3503``: every S3 request of the node answered 503 for 60 s (by the proxy).

Each test checks its node: every acknowledged episode is in the dataset exactly once (read
with `read_episodes` and with DuckDB, through the reader's proxy), nothing is there that was
not recorded, and the merged archive of all nodes equals one store fed the union.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from cluster import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RECORD_S = 80.0  # trainers record this long
FAULT_AT = 5.0  # seconds after the trainers start
CUT_S = 30.0
HOLE_AT = FAULT_AT + CUT_S + 10.0  # front: the blackhole, after 10 s of service
ERRORS_S = 60.0
KILL_AT, RESTART_AT = 12.0, 17.0
KEEPALIVE_S = 5.0
CATCH_UP_S = 30.0
NODES = ("s3cut", "s3hole", "front", "lost", "s3503")


@dataclass
class NodeResult:
    name: str
    heal_at: float | None = None  # unix time the fault ended
    lag: list[tuple[float, float]] = field(default_factory=list)  # (unix time, lag seconds)
    truths: list = field(default_factory=list)

    def caught_up_after_heal(self) -> float | None:
        """Seconds from the heal to the first flush that left nothing waiting."""
        for t, lag in self.lag:
            if t > self.heal_at and lag == 0:
                return t - self.heal_at
        return None

    def max_lag(self) -> float:
        return max((lag for _, lag in self.lag), default=0.0)


@dataclass
class Run:
    nodes: dict[str, NodeResult]
    dataset: Counter
    duck: Counter
    cells: int
    hole_at: float


def _monitor(cluster: harness.Cluster, results: dict[str, NodeResult], stop: threading.Event):
    while not stop.wait(0.5):
        for name, node in cluster.nodes.items():
            lag = node.metric("dataset_lag_seconds")
            if lag is not None:
                results[name].lag.append((time.time(), lag))


@pytest.fixture(scope="module")
def run(tmp_path_factory, s3) -> Run:
    root = tmp_path_factory.mktemp("cluster")
    cluster = harness.Cluster(root, s3, "cluster-faults")
    results = {name: NodeResult(name) for name in NODES}
    stop = threading.Event()
    try:
        fast = ["--dataset-flush-seconds", "1"]  # the harness's only flag beyond compose's
        for name in NODES:
            cluster.add_node(name, *fast)
        starters = [threading.Thread(target=n.start) for n in cluster.nodes.values()]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        assert all(n.process is not None for n in cluster.nodes.values())
        seed = 1
        trainers: dict[str, list[harness.Trainer]] = {}
        for name, node in cluster.nodes.items():
            for k in range(2):
                options = {}
                if name == "front":
                    options.update(
                        on_backpressure=("block", "drop")[k],
                        max_bytes_in_flight=24 << 10,
                        keepalive=KEEPALIVE_S,
                    )
                worker = f"{name}-t{k}"
                trainers.setdefault(name, []).append(
                    cluster.add_trainer(node, worker, seed, **options)
                )
                seed += 1
        t0 = cluster.go(RECORD_S)
        monitor = threading.Thread(target=_monitor, args=(cluster, results, stop), daemon=True)
        monitor.start()
        nodes = cluster.nodes

        def at(offset: float) -> None:
            time.sleep(max(0.0, t0 + offset - time.time()))

        at(FAULT_AT)
        nodes["s3cut"].s3.set_mode("cut")
        nodes["s3hole"].s3.set_mode("blackhole")
        nodes["s3503"].s3.set_mode("http503")
        nodes["front"].front.set_mode("cut")
        at(KILL_AT)
        for trainer in trainers["lost"]:
            trainer.kill()
        nodes["lost"].kill()
        results["lost"].heal_at = time.time()
        at(RESTART_AT)
        nodes["lost"].start()
        at(FAULT_AT + CUT_S)
        for name in ("s3cut", "s3hole"):
            nodes[name].s3.set_mode("pass")
            results[name].heal_at = time.time()
        nodes["front"].front.set_mode("pass")
        at(HOLE_AT)
        nodes["front"].front.set_mode("blackhole")
        hole_at = time.time()
        at(FAULT_AT + ERRORS_S)
        nodes["s3503"].s3.set_mode("pass")
        results["s3503"].heal_at = time.time()
        at(HOLE_AT + CUT_S)
        nodes["front"].front.set_mode("pass")
        results["front"].heal_at = time.time()
        for name, group in trainers.items():
            if name != "lost":
                for trainer in group:
                    assert trainer.wait(120) == 0, (root / f"{trainer.worker}.log").read_text()
        for name, group in trainers.items():
            results[name].truths = [t.truth() for t in group]
        acked = Counter()
        for result in results.values():
            for truth in result.truths:
                acked += truth.episodes()[1]

        def complete() -> bool:
            try:
                got = harness.dataset_episodes(cluster)
            except (FileNotFoundError, KeyError):
                return False
            return all(got[key] >= 1 for key in acked)

        assert harness.wait_until(complete, CATCH_UP_S + 30, 2.0) is not None, "not caught up"
        stop.set()
        dataset, duck = harness.dataset_episodes(cluster), harness.duckdb_episodes(cluster)
        merged = harness.merge(cluster, harness.store_files(cluster))
        cells = harness.assert_merge_equals_union(merged, harness.union_store(cluster))
        return Run(results, dataset, duck, cells, hole_at)
    finally:
        stop.set()
        cluster.close()


def check_node(run: Run, name: str) -> dict:
    """Every acknowledged episode of the node's trainers in the dataset exactly once (both
    readers), nothing there that was not recorded; the counts, for the report."""
    result = run.nodes[name]
    recorded, acked, possible = Counter(), Counter(), Counter()
    for truth in result.truths:
        r, a = truth.episodes()
        recorded += r
        acked += a
        possible += truth.episodes(possible=True)[0]
    workers = {t.worker for t in result.truths}
    mine = Counter({k: n for k, n in run.dataset.items() if k[0] in workers})
    duplicated = sum(n - 1 for n in mine.values() if n > 1)
    missing = sum(1 for k in acked if mine[k] == 0)
    phantom = sum(1 for k in mine if k not in possible)
    duck = Counter({k: n for k, n in run.duck.items() if k[0] in workers})
    assert duck == Counter({k[:4]: 1 for k in mine}), "DuckDB reads other episodes"
    assert (duplicated, missing, phantom) == (0, 0, 0), (duplicated, missing, phantom)
    assert run.cells > 0
    return {
        "recorded": sum(recorded.values()),
        "acknowledged": sum(acked.values()),
        "in_dataset": sum(mine.values()),
        "duplicated": duplicated,
        "missing": missing,
    }


def report(name: str, counts: dict, **extra) -> None:
    fields = ", ".join(f"{k} {v}" for k, v in {**counts, **extra}.items())
    print(f"\n[{harness.MODE}] {name}: {fields}")


def catch_up(result: NodeResult) -> float:
    took = result.caught_up_after_heal()
    assert took is not None and took <= CATCH_UP_S, (took, result.lag[-5:])
    return round(took, 1)


def s3_outage(run, node: str, outage_s: float, label: str) -> None:
    """The node whose S3 path failed for ``outage_s`` lost nothing (`check_node`); its backlog
    waited on disk, and the lag metric said so (it moves at each retry, 8 s apart)."""
    counts = check_node(run, node)
    result = run.nodes[node]
    assert result.max_lag() >= outage_s - 10
    report(label, counts, catch_up_s=catch_up(result), max_lag_s=result.max_lag())


def test_a_node_cut_from_s3_for_30_s_catches_up_within_30_s_of_the_heal(run):
    s3_outage(run, "s3cut", CUT_S, "s3 path cut 30 s")


def test_a_node_blackholed_from_s3_for_30_s_catches_up_within_30_s_of_the_heal(run):
    s3_outage(run, "s3hole", CUT_S, "s3 path blackholed 30 s")


def test_trainers_cut_then_blackholed_from_their_sidecar_block_or_drop(run):
    counts = check_node(run, "front")
    block, drop = run.nodes["front"].truths
    assert block.ended and drop.ended
    assert not block.dropped and block.longest_record_s > 5  # held at the cap, then resumed
    assert drop.dropped and drop.longest_record_s < 5  # dropped, never held
    seen = [t - run.hole_at for t in block.stream_ended + drop.stream_ended if t > run.hole_at]
    assert seen, "the blackhole was never detected"
    detected = min(seen)
    assert detected <= 2 * KEEPALIVE_S, detected
    report(
        "trainers -> sidecar cut 30 s, blackholed 30 s",
        counts,
        block_longest_record_s=round(block.longest_record_s, 1),
        drop_dropped_chunks=len(drop.dropped),
        blackhole_detected_s=round(detected, 1),
        bound_s=2 * KEEPALIVE_S,
    )


def test_a_node_lost_to_kill_9_restarts_from_its_data_dir_losing_nothing(run):
    counts = check_node(run, "lost")
    assert counts["acknowledged"] > 0
    report("sidecar and trainers killed -9, restarted", counts)


def test_s3_answering_503_for_60_s_loses_nothing_and_catches_up(run):
    s3_outage(run, "s3503", ERRORS_S, "s3 answers 503 for 60 s")


def test_the_merged_archive_equals_one_store_fed_the_union(run):
    assert run.cells > 0
    print(f"\n[{harness.MODE}] merged archive of {len(NODES)} nodes: {run.cells} cells, equal")
