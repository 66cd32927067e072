"""TrajectoryCaptureProcessor: disabled store, metrics, runtime state and checkpoint round trip."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.store import EpisodeArrays, decode_checkpoint_state
from recorder_server.store.processor import TrajectoryCaptureProcessor, build_store

CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0,), bucket=2, name="x"),
        CellField("player_positions", (1,), bucket=2, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.9), UtilityConfig("any_end", 0.5, ("WIN",))),
)


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_many(self, values: dict[str, float], step: int) -> None:
        self.calls.append((dict(values), step))


def random_episode(rng: np.random.Generator, length: int) -> EpisodeArrays:
    steps = rng.integers(-1, 2, size=(length, 2))
    return EpisodeArrays(
        actions=rng.integers(0, 5, size=(length, 2)).astype(np.int16),
        rewards=rng.choice([0.0, 0.5, 1.0], size=length).astype(np.float32),
        states={
            "player_positions": (np.cumsum(steps, axis=0) + 8).astype(np.int32),
            "map": rng.integers(0, 3, size=(length, 4, 4)).astype(np.int8),
        },
    )


def test_disabled_store_still_counts_and_emits_capture_metrics():
    metrics = RecordingMetrics()
    proc = TrajectoryCaptureProcessor(None, metrics, None)
    assert proc.store is None
    rng = np.random.default_rng(0)
    proc.record_episode(random_episode(rng, 5), {"return": 1.0}, 10, outcome=EpisodeOutcome.WIN)
    proc.record_episode(random_episode(rng, 7), {}, 20, outcome=EpisodeOutcome.INCOMPLETE)
    assert proc.snapshot_potential("win_proximity", ["x"]) == {}
    assert proc.sample_start() is None
    assert proc.trajectory_store_checkpoint_file(True, checkpoint_step=3) is None
    proc.load_trajectory_store_checkpoint_data({"format": "ignored"})  # no store: ignored
    proc.log_metrics(42)
    values, step = metrics.calls[-1]
    assert step == 42
    assert values["Trajectories/episodes_captured"] == 2
    assert values["Trajectories/steps_captured"] == 12
    assert values["Trajectories/outcome_win"] == 1
    assert values["Trajectories/outcome_incomplete"] == 1
    assert values["Trajectories/store_enabled"] == 0
    assert all(k.startswith("Trajectories/") for k in values)
    assert "Trajectories/archive_cells" not in values
    state = json.loads(json.dumps(proc.runtime_state_dict()))
    fresh = TrajectoryCaptureProcessor(None, RecordingMetrics(), None)
    fresh.load_state_dict(state)
    assert fresh.runtime_state_dict() == proc.runtime_state_dict()


def test_enabled_store_metrics_tags():
    metrics = RecordingMetrics()
    proc = TrajectoryCaptureProcessor(CONFIG, metrics, build_store(CONFIG, seed=1))
    proc.log_metrics(0)  # before any episode
    rng = np.random.default_rng(1)
    proc.record_episode(random_episode(rng, 30), {}, 30, outcome=EpisodeOutcome.WIN)
    proc.log_metrics(30)
    empty, values = metrics.calls[0][0], metrics.calls[1][0]
    assert empty["Trajectories/archive_cells"] == 0
    assert empty["Trajectories/curriculum_start_entropy"] == 0
    for tag in (
        "episodes_captured",
        "steps_captured",
        "archive_cells",
        "archive_new_cells_last_episode",
        "curriculum_starts",
        "curriculum_start_entropy",
        "repository_trajectories",
        "repository_bytes",
        "repository_evictions",
        "utility/win_proximity/mean",
        "utility/win_proximity/max",
        "utility/any_end/mean",
    ):
        assert "Trajectories/" + tag in values, tag
    n = values["Trajectories/archive_cells"]
    assert n == values["Trajectories/archive_new_cells_last_episode"] > 0
    assert values["Trajectories/curriculum_start_entropy"] == pytest.approx(np.log(n))
    assert values["Trajectories/repository_trajectories"] == 1
    snapshot = proc.snapshot_potential("win_proximity", ["x", "y"])
    assert values["Trajectories/utility/win_proximity/max"] == max(snapshot.values())
    assert values["Trajectories/utility/win_proximity/mean"] == pytest.approx(
        np.mean(list(snapshot.values()))
    )


def test_large_archive_gauges_refresh_at_most_once_per_period(monkeypatch):
    """Above the cell threshold the O(cells) gauges are repeated within a period, while the
    counters stay current; below it (and once the period has passed) they are recomputed."""
    from recorder_server.store import store as store_mod

    store = build_store(CONFIG, seed=1)
    rng = np.random.default_rng(4)
    store.record_episode(random_episode(rng, 40), step=0, outcome=EpisodeOutcome.WIN)
    first = store.metrics()
    monkeypatch.setattr(store_mod, "_GAUGE_CELLS", 1)
    monkeypatch.setattr(store_mod, "_GAUGE_PERIOD", 3600.0)
    store.metrics()  # computed now: the cache is this call's
    store.record_episode(random_episode(rng, 40), step=40, outcome=EpisodeOutcome.LOSS)
    stale = store.metrics()
    assert stale["store_episodes"] == first["store_episodes"] + 1  # counters: current
    assert stale["utility/win_proximity/mean"] == first["utility/win_proximity/mean"]
    assert stale["curriculum_start_entropy"] == first["curriculum_start_entropy"]
    monkeypatch.setattr(store_mod, "_GAUGE_PERIOD", 0.0)
    current = store.metrics()
    assert current["utility/win_proximity/mean"] < first["utility/win_proximity/mean"]
    monkeypatch.setattr(store_mod, "_GAUGE_PERIOD", 3600.0)
    monkeypatch.setattr(store_mod, "_GAUGE_CELLS", 10_000)
    store.record_episode(random_episode(rng, 40), step=80, outcome=EpisodeOutcome.LOSS)
    small = store.metrics()  # a small archive: always recomputed
    assert small["utility/win_proximity/mean"] < current["utility/win_proximity/mean"]


def test_processor_rejects_mismatched_store():
    other = dataclasses.replace(CONFIG, selection_power=1.0)
    with pytest.raises(ValueError, match="differs"):
        TrajectoryCaptureProcessor(other, RecordingMetrics(), build_store(CONFIG))
    proc = TrajectoryCaptureProcessor(None, RecordingMetrics(), build_store(CONFIG))
    assert proc.configuration == CONFIG
    assert build_store(None) is None


def filled_processor(seed: int = 7) -> TrajectoryCaptureProcessor:
    proc = TrajectoryCaptureProcessor(CONFIG, RecordingMetrics(), build_store(CONFIG, seed=seed))
    rng = np.random.default_rng(seed)
    outcomes = [EpisodeOutcome.WIN, EpisodeOutcome.LOSS, EpisodeOutcome.DRAW]
    for i in range(25):
        start = proc.sample_start() if i % 3 == 2 else None
        proc.record_episode(
            random_episode(rng, int(rng.integers(5, 40))),
            {},
            i * 100,
            outcome=outcomes[i % 3],
            start_reference=None if start is None else start[0],
        )
    return proc


def assert_same_store(a: TrajectoryCaptureProcessor, b: TrajectoryCaptureProcessor) -> None:
    for utility in ("win_proximity", "any_end"):
        for fields in (["x", "y"], ["y", "x"], ["x"], ["y"]):
            assert a.snapshot_potential(utility, fields) == b.snapshot_potential(utility, fields)
    sa, sb = a.store, b.store
    assert sa.start_probabilities() == sb.start_probabilities()
    assert sa.midpoint_start_counts() == sb.midpoint_start_counts()
    assert [sa.cell(k) for k in sa.cell_keys()] == [sb.cell(k) for k in sb.cell_keys()]
    assert sa.trajectory_ids() == sb.trajectory_ids()
    assert sa.metrics() == sb.metrics()


@pytest.mark.parametrize("compress", [True, False])
def test_checkpoint_round_trip(compress, tmp_path):
    a = filled_processor()
    assert sum(a.store.midpoint_start_counts().values()) > 0
    file = a.trajectory_store_checkpoint_file(compress, checkpoint_step=2500)
    assert file.name == "trajectory_store-step000000002500.bin" + (".zst" if compress else "")
    assert file.size == len(file.data) and file.sha256 == hashlib.sha256(file.data).hexdigest()
    assert file.data.startswith(b"\x28\xb5\x2f\xfd") == compress

    runtime = json.loads(json.dumps(a.runtime_state_dict()))
    loaders = {
        "file": file,
        "bytes": file.data,
        "dict": decode_checkpoint_state(file.data),
        "path": dataclasses.replace(file, data=None, path=str(tmp_path / file.name)),
    }
    (tmp_path / file.name).write_bytes(file.data)
    for how, payload in loaders.items():
        b = TrajectoryCaptureProcessor(CONFIG, RecordingMetrics(), build_store(CONFIG, seed=99))
        b.load_state_dict(runtime)
        b.load_trajectory_store_checkpoint_data(payload)
        assert_same_store(a, b)
        assert b.runtime_state_dict() == a.runtime_state_dict(), how
    # Identical start sequences (same generator state, same weights, same prefixes).
    for _ in range(30):
        (ra, pa), (rb, pb) = a.sample_start(), b.sample_start()
        assert ra == rb
        np.testing.assert_array_equal(pa.actions, pb.actions)
        np.testing.assert_array_equal(pa.states["map"], pb.states["map"])
    assert_same_store(a, b)


def test_checkpoint_midpoint_override_and_errors():
    a = filled_processor()
    file = a.trajectory_store_checkpoint_file(
        False, checkpoint_step=1, midpoint_start_episode_cell_counts={(5, 6): 7}
    )
    b = TrajectoryCaptureProcessor(CONFIG, RecordingMetrics(), build_store(CONFIG))
    b.load_trajectory_store_checkpoint_data(file.data)
    assert b.store.midpoint_start_counts() == {(5, 6): 7}
    assert b.store.metrics()["curriculum_midpoint_starts"] == 7
    with pytest.raises(ValueError, match="midpoint_start_episode_cell_counts"):
        a.trajectory_store_checkpoint_file(
            False, checkpoint_step=1, midpoint_start_episode_cell_counts={(5,): 1}
        )
    with pytest.raises(ValueError, match="sha256"):
        b.load_trajectory_store_checkpoint_data(dataclasses.replace(file, sha256="0" * 64))
    other = TrajectoryTrainingConfiguration(cell_fields=(CellField("player_positions", (0,)),))
    c = TrajectoryCaptureProcessor(other, RecordingMetrics(), build_store(other))
    with pytest.raises(ValueError, match="cell_fields"):
        c.load_trajectory_store_checkpoint_data(file.data)
    with pytest.raises(ValueError, match="magic"):
        c.load_trajectory_store_checkpoint_data(b"not a checkpoint")
    with pytest.raises(ValueError, match="format"):
        c.load_state_dict({"format": "other"})


def test_checkpoint_into_smaller_capacity_evicts_unreferenced():
    a = filled_processor()
    m = a.store.metrics()
    assert m["repository_unreferenced"] > 0
    referenced = m["repository_trajectories"] - m["repository_unreferenced"]
    small = dataclasses.replace(CONFIG, repository_capacity_bytes=1)
    b = TrajectoryCaptureProcessor(small, RecordingMetrics(), build_store(small))
    b.load_trajectory_store_checkpoint_data(
        a.trajectory_store_checkpoint_file(True, checkpoint_step=0)
    )
    assert b.store.metrics()["repository_trajectories"] == referenced
    assert b.store.start_probabilities() == a.store.start_probabilities()
    assert b.snapshot_potential("win_proximity", ["x"]) == a.snapshot_potential(
        "win_proximity", ["x"]
    )
