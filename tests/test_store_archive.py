"""Store introspection: the archive as columns (`archive_table`), computed by hand on a small
scripted scenario."""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import CELL_STATS

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
        *CELL_STATS,
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


# -- through a real server ---------------------------------------------------------------------

REMOTE = TrajectoryTrainingConfiguration(
    cell_fields=(CellField("pos", (0,), name="x"), CellField("pos", (1,), name="y")),
    utilities=(UtilityConfig("win_proximity", gamma=0.5),),
)


def _walk_chunk(xs: list[int], rewards: list[float], dones: list[int], codes: list[int]):
    """One (T, 1) chunk of a scripted walk along x (y stays 0)."""
    T = len(xs)
    done = np.zeros((T, 1), bool)
    done[dones, 0] = True
    outcome = np.zeros((T, 1), np.int8)
    outcome[dones, 0] = codes
    pos = np.zeros((T, 1, 2), np.int32)
    pos[:, 0, 0] = xs
    trajectories = {
        "action": np.zeros((T, 1), np.int32),
        "reward": np.asarray(rewards, np.float32).reshape(T, 1),
        "done": done,
    }
    return trajectories, {"pos": pos}, outcome


def test_remote_archive_equals_a_hand_computation_and_sample_start_names_its_cell(target):
    from recorder_client import (
        ArchiveColumns,
        InvalidQueryError,
        RolloutRecorder,
        StoreNotConfiguredError,
    )

    with RolloutRecorder(
        target=target, session="walk", record_states=True, state_fields=["pos"], capture=REMOTE
    ) as rec:
        assert rec.capture.enabled
        # Chunk 1 (env steps 0..3): episode 0, WIN: x 0 1 1 2, cumulative reward 1 1 3 3.
        t, s, o = _walk_chunk([0, 1, 1, 2], [1, 0, 2, 0], [3], [EpisodeOutcome.WIN])
        rec.record(t, s, outcome=o)
        # Chunk 2 (env steps 4..7): episode 1, LOSS: x 2 3, cumulative 5 5; episode 2, DRAW:
        # x 3 0, cumulative 0 0.
        t, s, o = _walk_chunk(
            [2, 3, 3, 0], [5, 0, 0, 0], [1, 3], [EpisodeOutcome.LOSS, EpisodeOutcome.DRAW]
        )
        rec.record(t, s, outcome=o)
        archive = rec.capture.archive()
        assert isinstance(archive, ArchiveColumns) and len(archive) == 4
        assert archive.key_names == ("x", "y")
        np.testing.assert_array_equal(archive.cells["x"], [0, 1, 2, 3])
        np.testing.assert_array_equal(archive.cells["y"], [0, 0, 0, 0])
        np.testing.assert_array_equal(archive.visits, [2, 2, 2, 2])
        # The step a cell is first seen at is the session's env steps before its chunk.
        np.testing.assert_array_equal(archive.first_seen_step, [0, 0, 0, 4])
        np.testing.assert_array_equal(archive.times_chosen, [0, 0, 0, 0])
        # (2, 0): episode 1's step 0 (return 5) beats episode 0's step 3 (return 3).
        np.testing.assert_array_equal(archive.best_trajectory_id, [0, 0, 1, 1])
        np.testing.assert_array_equal(archive.best_step, [0, 2, 0, 1])
        np.testing.assert_array_equal(archive.best_reference, [[0, 0], [0, 2], [1, 0], [1, 1]])
        np.testing.assert_array_equal(archive.best_length, [1, 3, 1, 2])
        np.testing.assert_allclose(archive.best_return, [1, 3, 5, 5])
        np.testing.assert_allclose(archive.selection_probability, [0.25] * 4)
        # gamma 0.5: episode 0 (WIN) adds 1/8, 1/4 + 1/2, 1 at x = 0, 1, 2; episode 1 (LOSS)
        # adds -1/2 at x = 2 and -1 at x = 3; episode 2 (DRAW) adds nothing.
        np.testing.assert_allclose(
            archive.utilities["win_proximity"], [0.125 / 2, 0.75 / 2, 0.5 / 2, -1 / 2]
        )
        np.testing.assert_array_equal(archive.midpoint_starts, [0, 0, 0, 0])
        assert archive.index((2, 0)) == 2 and archive.index((9, 9)) is None

        ref, prefix = rec.capture.sample_start()
        row = archive.index(ref.cell)
        assert row is not None
        assert archive.reference(row) == ref
        assert tuple(int(v) for v in prefix.states["pos"][-1]) == ref.cell
        after = rec.capture.archive()
        np.testing.assert_array_equal(after.times_chosen, np.eye(4, dtype=np.int64)[row])

        # Query misuse names the argument, as a ValueError made for queries.
        with pytest.raises(InvalidQueryError, match="nope"):
            rec.capture.snapshot_potential("nope", ["x"])
        with pytest.raises(InvalidQueryError, match="field_names"):
            rec.capture.snapshot_potential("win_proximity", ["z"])

    with RolloutRecorder(target=target, session="nostore") as rec:
        assert not rec.capture.enabled
        with pytest.raises(StoreNotConfiguredError, match="nostore"):
            rec.capture.archive()
        # The seed's verbs keep the seed's no-store answers.
        assert rec.capture.trajectory_store_checkpoint_file() is None
        assert rec.capture.snapshot_potential("win_proximity", ["x"]) == {}


def test_status_shows_workers_and_a_heatmap_of_the_archive(target):
    import json
    import subprocess
    import sys

    from recorder_client import RolloutRecorder

    with RolloutRecorder(
        target=target,
        session="walk",
        worker_id="w-walk",
        record_states=True,
        state_fields=["pos"],
        capture=REMOTE,
    ) as rec:
        t, s, o = _walk_chunk([0, 1, 1, 2], [1, 0, 2, 0], [3], [EpisodeOutcome.WIN])
        rec.record(t, s, outcome=o)
        t, s, o = _walk_chunk([2, 3, 3, 0], [5, 0, 0, 0], [1, 3], [EpisodeOutcome.LOSS, 3])
        rec.record(t, s, outcome=o)
        rec.capture.archive()  # every chunk reached the store
        cli = [sys.executable, "-m", "recorder_server", "status", "--target", target]
        out = subprocess.run([*cli, "--once"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        print(out.stdout)
        lines = out.stdout.splitlines()
        assert any("w-walk" in line and " True" in line for line in lines)
        assert any(line.lstrip().startswith("archive: 4 cells over x") for line in lines)
        # Cells (0..3, 0), two visits each: one row of four equal shades.
        rows = [line.strip() for line in lines if line.strip().startswith("|")]
        assert len(rows) == 1 and len(rows[0]) == 6 and len(set(rows[0][1:-1])) == 1
        assert " " not in rows[0]
        js = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
        data = json.loads(js.stdout)
        session = next(s for s in data["sessions"] if s["session"] == "walk")
        assert session["store"] is True and session["archive_cells"] == 4
        assert session["chunks_stored"] == 2 and session["chunks_dropped"] == 0
        assert session["workers"][0]["sequences_lost"] == 0
