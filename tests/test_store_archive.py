"""Store introspection: the archive as columns (`archive_table`), computed by hand on a small
scripted scenario."""

from __future__ import annotations

import numpy as np

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.store import EpisodeArrays
from recorder_server.store.processor import TrajectoryCaptureProcessor, build_store

CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("pos", (0,), name="x"),
        CellField("pos", (1,), bucket=2, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.5),),
    selection_power=1.0,
)


class _Metrics:
    def log_many(self, values: dict[str, float], step: int) -> None:
        pass


def _episode(xy: list[tuple[int, int]], rewards: list[float]) -> EpisodeArrays:
    return EpisodeArrays(
        actions=np.zeros(len(xy), dtype=np.int8),
        rewards=np.asarray(rewards, dtype=np.float32),
        states={"pos": np.asarray(xy, dtype=np.int32)},
    )


def scripted() -> TrajectoryCaptureProcessor:
    """Two episodes over cells (x, y // 2); comments give each step's cell and cumulative
    reward."""
    processor = TrajectoryCaptureProcessor(CONFIG, _Metrics(), build_store(CONFIG, seed=0))
    # Episode 0 (id 0), WIN, step 100: A=(0,0) 1, B=(1,0) 1, B 3, C=(1,1) 3.
    processor.record_episode(
        _episode([(0, 0), (1, 0), (1, 1), (1, 3)], [1.0, 0.0, 2.0, 0.0]),
        {},
        100,
        outcome=EpisodeOutcome.WIN,
    )
    # Episode 1 (id 1), LOSS, step 200: B 5, D=(2,1) 4.
    processor.record_episode(
        _episode([(1, 0), (2, 2)], [5.0, -1.0]), {}, 200, outcome=EpisodeOutcome.LOSS
    )
    return processor


def test_archive_table_equals_a_hand_computation():
    processor = scripted()
    table = processor.archive_table()
    assert table is not None
    # First-seen order: A, B, C (episode 0), D (episode 1).
    np.testing.assert_array_equal(table["cell:x"], [0, 1, 1, 2])
    np.testing.assert_array_equal(table["cell:y"], [0, 0, 1, 1])
    np.testing.assert_array_equal(table["visits"], [1, 3, 1, 1])
    np.testing.assert_array_equal(table["first_seen_step"], [100, 100, 100, 200])
    np.testing.assert_array_equal(table["times_chosen"], [0, 0, 0, 0])
    # Best references: A by (0, 0) with return 1; B by episode 1's step 0 with 5 (beats
    # episode 0's step 2 with 3); C by (0, 3) with 3; D by (1, 1) with 4.
    np.testing.assert_array_equal(table["best_trajectory_id"], [0, 1, 0, 1])
    np.testing.assert_array_equal(table["best_step"], [0, 0, 3, 1])
    np.testing.assert_array_equal(table["best_length"], [1, 1, 4, 2])
    np.testing.assert_allclose(table["best_return"], [1.0, 5.0, 3.0, 4.0])
    np.testing.assert_allclose(table["selection_probability"], [0.25] * 4)
    # win_proximity, gamma 0.5: episode 0 (WIN) adds 0.5**3, 0.5**2 + 0.5**1, 0.5**0 to
    # A, B, C; episode 1 (LOSS) adds -0.5**1 to B and -0.5**0 to D.
    expected = np.array([0.125, (0.25 + 0.5 - 0.5) / 3, 1.0, -1.0])
    np.testing.assert_allclose(table["utility:win_proximity"], expected)
    assert set(table) == {
        "cell:x",
        "cell:y",
        "visits",
        "times_chosen",
        "first_seen_step",
        "best_return",
        "best_length",
        "best_trajectory_id",
        "best_step",
        "midpoint_starts",
        "selection_probability",
        "utility:win_proximity",
    }


def test_selection_probability_follows_times_chosen():
    processor = scripted()
    ref, _ = processor.sample_start()
    table = processor.archive_table()
    chosen = np.flatnonzero(table["times_chosen"])
    assert chosen.size == 1 and table["times_chosen"][chosen[0]] == 1
    # selection_power 1: weight 1/2 for the chosen cell, 1 for the others.
    expected = np.ones(4)
    expected[chosen[0]] = 0.5
    np.testing.assert_allclose(table["selection_probability"], expected / expected.sum())
    assert (ref.trajectory_id, ref.step) == (
        table["best_trajectory_id"][chosen[0]],
        table["best_step"][chosen[0]],
    )


def test_archive_table_is_none_without_a_store():
    assert TrajectoryCaptureProcessor(None, _Metrics(), None).archive_table() is None


def test_archive_table_of_an_empty_store_has_every_column():
    processor = TrajectoryCaptureProcessor(CONFIG, _Metrics(), build_store(CONFIG, seed=0))
    table = processor.archive_table()
    assert all(col.shape == (0,) for col in table.values())
    assert table["cell:x"].dtype == np.int64 and table["best_return"].dtype == np.float64
