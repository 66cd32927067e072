"""Store references resolve into the dataset: each episode's row carries its id in its node's
trajectory store, so a best reference of one store, or of an archive merged from several
sidecars' stores, names an episode of the shared dataset and its prefix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_dataset import chunk, wait_written

from recorder_client import (
    CellField,
    OutcomeRule,
    RolloutRecorder,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_client.dataset import open_dataset
from recorder_server import ServerOptions, start_server
from recorder_server.dataset.sink import DatasetOptions
from recorder_server.store.merge import merge_checkpoints, trajectory_source

CAPTURE = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0, 0), bucket=16, name="x"),
        CellField("player_positions", (0, 1), bucket=16, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.99),),
    outcome_rule=OutcomeRule("reward_sign"),
)


def prefix_return(episodes: dict, node: str, trajectory: int, step: int) -> float:
    """The return of the first step+1 rewards of the dataset episode a reference names."""
    rewards = episodes[(node, trajectory)]
    assert step < rewards.size
    return float(rewards[: step + 1].astype(np.float64).sum())


def dataset_by_store_id(uri: str) -> dict[tuple[str, int], np.ndarray]:
    table = open_dataset(uri).to_table(columns=["node", "store_trajectory", "step", "reward"])
    table = table.sort_by([("store_trajectory", "ascending"), ("step", "ascending")])
    node = np.asarray(table["node"].to_pylist())
    ids = table["store_trajectory"].to_numpy()
    reward = table["reward"].to_numpy()
    out: dict[tuple[str, int], list] = {}
    for n, i, r in zip(node.tolist(), ids.tolist(), reward.tolist()):
        out.setdefault((n, i), []).append(r)
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def test_best_references_of_one_store_and_of_a_merge_name_dataset_episodes(tmp_path: Path):
    uri = str(tmp_path / "dataset")
    servers, recs = [], []
    try:
        for k, node in enumerate(("node-a", "node-b")):
            server = start_server(
                ServerOptions(
                    listen="127.0.0.1:0",
                    data_dir=str(tmp_path / node),
                    dataset=DatasetOptions(uri=uri, node_id=node, flush_seconds=0.2),
                )
            )
            servers.append(server)
            rec = RolloutRecorder(
                record_states=True,
                capture=CAPTURE,
                target=server.address,
                session="run",
                worker_id=f"w{k}",
            )
            recs.append(rec)
            for i in range(25):
                arrays, states = chunk(k, i)
                arrays.pop("outcome")
                arrays["action"] = arrays["action"] & 0xF  # small actions: a store field
                rec.record(arrays, states)
            rec.flush()
        expected = sum(r.finish(pad_incomplete=False).num_episodes for r in recs)
        wait_written(uri, "run", expected)
        episodes = dataset_by_store_id(uri)
        assert (("node-a", -1) not in episodes) and (("node-b", -1) not in episodes)

        # One store: every cell's best reference is a dataset episode of that node.
        files = []
        for node, rec in zip(("node-a", "node-b"), recs):
            archive = rec.capture.archive()
            assert len(archive.best_trajectory_id) > 0
            for tid, step, ret in zip(
                archive.best_trajectory_id.tolist(),
                archive.best_step.tolist(),
                archive.best_return.tolist(),
            ):
                assert prefix_return(episodes, node, tid, step) == pytest.approx(ret, abs=1e-4)
            files.append(rec.capture.trajectory_store_checkpoint_file(compress=False).data)

        # A merge labelled with the node ids: (source, id) is the dataset's (node, store id).
        state = merge_checkpoints(files, sources=["node-a", "node-b"])
        arrays = state["arrays"]
        best = zip(
            arrays["archive/best_trajectory"].tolist(),
            arrays["archive/best_step"].tolist(),
            arrays["archive/best_return"].tolist(),
        )
        for tid, step, ret in best:
            source, local = trajectory_source(state, tid)
            assert prefix_return(episodes, source.name, local, step) == pytest.approx(ret, abs=1e-4)
    finally:
        for rec in recs:
            rec.close()
        for server in servers:
            server.stop(grace=0)
