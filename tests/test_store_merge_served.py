"""The archive merged from three sidecars, read back through a running server, equals one
server fed the union: each sidecar (a `serve` process) records its part of the episodes, their
store checkpoints are downloaded as clients get them and merged with `rollout-recorder store
merge`, and the merged file is loaded with `capture.load_trajectory_store_checkpoint_data`
into a session of a running server; its `archive()` and `snapshot_potential` match, cell for
cell, those of one server that recorded every part, in the sources' order.

A store stamps each episode with its server session's env-step count (first-seen step). For
that column to be comparable, each sidecar's count starts where the union server's stood when
its part began: a "clock" worker first records that many steps of one episode that never ends,
which no store ever takes (stores keep finished episodes only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import ServerProcess
from store_helpers import CELL_STATS, store_merge

from recorder_client import (
    CellField,
    OutcomeRule,
    RolloutRecorder,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)

pytestmark = pytest.mark.timeout(240)

CAPTURE = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0, 0), bucket=8, name="x"),
        CellField("player_positions", (0, 1), bucket=8, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.9), UtilityConfig("steps", gamma=1.0)),
    outcome_rule=OutcomeRule("reward_sign"),
)
NODES = ("node-a", "node-b", "node-c")
PARTS = (5, 8, 6)  # chunks each node's worker records
T, N = 16, 3


def chunk(worker: int, index: int, *, ends: bool = True) -> tuple[dict, dict]:
    """Chunk ``index`` of ``worker`` (the same arrays every call). One episode ends in it,
    so every episode gets its own step: a store orders the cells one episode finds by key,
    and the merge can order cells only by step and key."""
    rng = np.random.default_rng([worker, index])
    done = np.zeros((T, N), dtype=bool)
    done[rng.integers(T), index % N] = ends
    arrays = {
        "action": rng.integers(0, 16, (T, N)),
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "done": done,
    }
    return arrays, {"player_positions": rng.integers(0, 64, (T, N, 1, 2)).astype(np.int32)}


def part_chunks(node: int):
    """The chunks of node ``node``'s part."""
    return [chunk(node, i) for i in range(PARTS[node])]


def recorder(address: str, worker: str) -> RolloutRecorder:
    return RolloutRecorder(
        record_states=True, capture=CAPTURE, target=address, session="run", worker_id=worker
    )


def record_part(address: str, node: int) -> RolloutRecorder:
    rec = recorder(address, f"w{node}")
    for arrays, states in part_chunks(node):
        rec.record(arrays, states)
    rec.flush()
    return rec


def lead_in(address: str, steps: int) -> RolloutRecorder:
    """``steps`` env steps of one never-finished episode per env: the session's clock moves,
    the store takes nothing."""
    rec = recorder(address, "clock")
    assert steps % (T * N) == 0
    for i in range(steps // (T * N)):
        rec.record(*chunk(99, i, ends=False))
    rec.flush()
    return rec


def assert_same_archive(got, want) -> None:
    assert got.key_names == want.key_names and len(got) > 20
    np.testing.assert_array_equal(got.keys, want.keys)  # same cells, in the same order
    for name in CELL_STATS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
    # Utility sums: the same terms, added per store and then across stores.
    np.testing.assert_allclose(got.selection_probability, want.selection_probability, rtol=1e-12)
    assert got.utilities.keys() == want.utilities.keys()
    for name in want.utilities:
        np.testing.assert_allclose(got.utilities[name], want.utilities[name], rtol=1e-12)


def test_three_sidecars_merged_by_the_cli_load_into_a_server_equal_to_one_fed_the_union(
    tmp_path: Path,
):
    servers = [ServerProcess(tmp_path / node) for node in NODES]
    union = ServerProcess(tmp_path / "union")
    recs: list[RolloutRecorder] = []
    try:
        files, steps_before = [], 0
        for k, server in enumerate(servers):
            if steps_before:
                recs.append(lead_in(server.address, steps_before))
            rec = record_part(server.address, k)
            recs.append(rec)
            one = record_part(union.address, k)  # the union, part after part
            recs.append(one)
            steps_before += PARTS[k] * T * N
            file = rec.capture.trajectory_store_checkpoint_file(compress=k != 1)
            path = tmp_path / file.name.replace("trajectory_store", NODES[k])
            path.write_bytes(file.data)
            files.append(path)
        merged = tmp_path / "merged.bin.zst"
        said = store_merge(files, merged, list(NODES), timeout=60)
        assert "3 sources (node-a, node-b, node-c)" in said

        reader = RolloutRecorder(
            record_states=True,
            capture=CAPTURE,
            target=union.address,
            session="merged",
            worker_id="reader",
        )
        recs.append(reader)
        reader.capture.load_trajectory_store_checkpoint_data(merged)  # the file as is

        got, want = reader.capture.archive(), one.capture.archive()
        assert_same_archive(got, want)
        assert int(got.visits.sum()) == sum(PARTS) * T * N - _open_steps()
        for utility in ("win_proximity", "steps"):
            for fields in (["x"], ["y"], ["x", "y"]):
                potential = reader.capture.snapshot_potential(utility, fields)
                expected = one.capture.snapshot_potential(utility, fields)
                assert potential.keys() == expected.keys()
                for key, value in expected.items():
                    assert potential[key] == pytest.approx(value, rel=1e-12, abs=1e-12)
    finally:
        for rec in recs:
            rec.close()
        for server in (*servers, union):
            server.stop()


def _open_steps() -> int:
    """Steps of the episodes each part leaves unfinished (no store took them)."""
    total = 0
    for k in range(len(NODES)):
        done = np.concatenate([a["done"] for a, _ in part_chunks(k)])
        for env in range(N):
            ends = np.flatnonzero(done[:, env])
            total += done.shape[0] - (int(ends[-1]) + 1 if ends.size else 0)
    return total
