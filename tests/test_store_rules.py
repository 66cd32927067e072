"""Trajectory store rules, each checked against values worked out by hand."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from store_helpers import DRAW, LOSS, WIN, episode

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.store import EpisodeArrays, TrajectoryStore
from recorder_server.store.curriculum import draw, entropy
from recorder_server.store.repository import encode_episode


def store_1d(**kwargs) -> TrajectoryStore:
    return TrajectoryStore(
        TrajectoryTrainingConfiguration(cell_fields=(CellField("pos"),), **kwargs), seed=0
    )


def best(store: TrajectoryStore, cell: int) -> tuple[int, int]:
    ref = store.cell((cell,)).best_reference
    return ref.trajectory_id, ref.step


# -- cells and replacement ------------------------------------------------------------------------


def test_cell_key_uses_index_and_bucket():
    config = TrajectoryTrainingConfiguration(
        cell_fields=(
            CellField("player_positions", (0,), bucket=4),
            CellField("player_positions", (1,), bucket=4),
            CellField("flag"),
        )
    )
    store = TrajectoryStore(config)
    positions = np.array([[0, 3], [5, 7], [8, -1]], dtype=np.int64)
    store.record_episode(
        EpisodeArrays(np.zeros(3), np.zeros(3), {"player_positions": positions, "flag": [1, 0, 1]}),
        step=0,
    )
    # 0//4, 3//4 -> (0, 0); 5//4, 7//4 -> (1, 1); 8//4, -1//4 -> (2, -1)
    assert store.cell_keys() == [(0, 0, 1), (1, 1, 0), (2, -1, 1)]
    assert store.key_names == ("player_positions[0]", "player_positions[1]", "flag")


def test_replacement_prefers_higher_return_then_shorter_prefix():
    store = store_1d()
    # A (id 0): cumulative [0, 1, 1]
    store.record_episode(episode([0, 1, 2], [0, 1, 0]), step=100)
    assert [best(store, c) for c in (0, 1, 2)] == [(0, 0), (0, 1), (0, 2)]
    # B (id 1): cumulative [0, 2, 2]. Cell 0: tie at the same step -> A stays.
    # Cell 2: 2 > 1 at step 1 -> B. Cell 1: 2 > 1 at step 2 -> B.
    store.record_episode(episode([0, 2, 1], [0, 2, 0]), step=200)
    assert [best(store, c) for c in (0, 1, 2)] == [(0, 0), (1, 2), (1, 1)]
    # C (id 2): cumulative [2, 2, 2]. Cell 1: tie 2 == 2, step 0 < 2 -> C.
    # Cell 2: best in C is step 1 (earliest of the tie); tie with B at step 1 -> B stays.
    store.record_episode(episode([1, 2, 2], [2, 0, 0]), step=300)
    assert [best(store, c) for c in (0, 1, 2)] == [(0, 0), (2, 0), (1, 1)]
    # D (id 3): cumulative [1, 2, 2]: cell 1 ties at step 2 > 0 -> C stays (longer prefix loses).
    store.record_episode(episode([3, 3, 1], [1, 1, 0]), step=400)
    assert best(store, 1) == (2, 0)
    # E (id 4): cumulative [-1]: lower return never replaces.
    store.record_episode(episode([2], [-1]), step=500)
    assert best(store, 2) == (1, 1)
    # F (id 5): cumulative [1, 0, 1] within one cell: best is the first step with the max.
    store.record_episode(episode([4, 4, 4], [1, -1, 1]), step=600)
    assert best(store, 4) == (5, 0) and store.cell((4,)).best_return == 1.0

    info = store.cell((2,))
    assert info.visits == 1 + 1 + 2 + 1  # A, B, C twice, E
    assert (info.first_seen_step, info.first_seen_offset) == (100, 2)
    assert store.cell((3,)).first_seen_step == 400 and store.cell((3,)).first_seen_offset == 0
    assert store.cell((1,)).best_return == 2.0
    # Stored: A (cell 0), B (cell 2), C (cell 1), D (cell 3), F (cell 4); E improved nothing.
    assert store.trajectory_ids() == [0, 1, 2, 3, 5]
    assert store.metrics()["repository_discarded"] == 1.0
    assert store.metrics()["repository_unreferenced"] == 0.0
    np.testing.assert_array_equal(store.trajectory(2).states["pos"], [1, 2, 2])


def test_new_cells_and_outcome_rule_in_metrics():
    from recorder_client.capture_types import OutcomeRule

    store = store_1d(outcome_rule=OutcomeRule("reward_sign", threshold=0.5))
    rec = store.record_episode(episode([0, 1, 1], [0, 1, 0]), step=0)
    assert (rec.new_cells, rec.improved_cells, rec.outcome) == (2, 2, WIN)
    rec = store.record_episode(episode([1, 2], [-0.25, -0.5]), step=0)
    assert (rec.new_cells, rec.improved_cells, rec.outcome) == (1, 1, LOSS)
    rec = store.record_episode(episode([2], [0.5]), step=0, outcome=EpisodeOutcome.UNKNOWN)
    assert (rec.new_cells, rec.improved_cells, rec.outcome) == (0, 1, DRAW)
    # An explicit outcome is never overridden.
    rec = store.record_episode(episode([2], [5.0]), step=0, outcome=EpisodeOutcome.INCOMPLETE)
    assert rec.outcome is EpisodeOutcome.INCOMPLETE
    m = store.metrics()
    assert m["archive_cells"] == 3 and m["archive_new_cells_last_episode"] == 0


def test_bad_episodes_are_rejected_and_leave_the_store_unchanged():
    store = store_1d()
    with pytest.raises(ValueError, match="'pos' is missing"):
        store.record_episode(EpisodeArrays(np.zeros(2), np.zeros(2), {"x": np.zeros(2)}), step=0)
    with pytest.raises(ValueError, match="non-finite"):
        store.record_episode(episode([0, 1], [0, np.nan]), step=0)
    with pytest.raises(ValueError, match="leading length 2"):
        EpisodeArrays(np.zeros(3), np.zeros(2))
    assert len(store) == 0 and store.metrics()["store_episodes"] == 0


# -- repository -----------------------------------------------------------------------------------


def test_eviction_under_byte_cap_oldest_unreferenced_first():
    a = episode([0, 1], [0, 0])
    b = episode([0, 1], [1, 1])  # improves both of A's cells -> A unreferenced
    c = episode([0, 1], [2, 2])  # improves both of B's cells -> B unreferenced
    d = episode(np.arange(100, 160), np.ones(60))  # 60 new cells, much bigger blob
    sa, sb, sc, sd = (len(encode_episode(e)) for e in (a, b, c, d))
    assert sd > sa
    store = store_1d(repository_capacity_bytes=sb + sc + sd)
    for i, e in enumerate((a, b, c)):
        store.record_episode(e, step=i)
    # sa + sb + sc <= cap: nothing evicted yet although A and B are unreferenced.
    assert store.trajectory_ids() == [0, 1, 2]
    assert store.metrics()["repository_unreferenced"] == 2
    store.record_episode(d, step=3)
    # sa + sb + sc + sd > cap -> evict A (oldest unreferenced) -> sb + sc + sd == cap: stop.
    m = store.metrics()
    assert store.trajectory_ids() == [1, 2, 3]
    assert (m["repository_evictions"], m["repository_bytes"]) == (1, sb + sc + sd)
    assert store.trajectory(0) is None
    # Another big referenced episode: B is evicted; C and D are referenced and stay even though
    # the total is now over the cap.
    e = episode(np.arange(200, 260), np.ones(60))
    store.record_episode(e, step=4)
    m = store.metrics()
    assert store.trajectory_ids() == [2, 3, 4]
    assert m["repository_evictions"] == 2 and m["repository_over_capacity"] == 1
    assert m["repository_bytes"] == sc + sd + len(encode_episode(e))
    # Every cell's best reference is still stored, so every start decodes.
    for _ in range(20):
        ref, prefix = store.sample_start()
        assert ref.trajectory_id in (2, 3, 4) and prefix.length == ref.step + 1


# -- utilities ------------------------------------------------------------------------------------


def utility_store(cell_fields: tuple[CellField, ...] = ()) -> TrajectoryStore:
    config = TrajectoryTrainingConfiguration(
        cell_fields=cell_fields or (CellField("pos"),),
        utilities=(
            UtilityConfig("win_proximity", gamma=0.5),
            UtilityConfig("loss_proximity", 1.0, ("LOSS",), ()),
        ),
    )
    return TrajectoryStore(config)


def test_utilities_three_episodes_by_hand():
    store = utility_store()
    store.record_episode(episode([0, 1, 2]), step=0, outcome=WIN)  # k = 2, 1, 0
    store.record_episode(episode([0, 1]), step=0, outcome=LOSS)  # k = 1, 0
    store.record_episode(episode([0, 0, 3]), step=0, outcome=DRAW)  # adds 0
    # win_proximity sums: cell0 0.25 - 0.5 = -0.25 over 4 visits; cell1 0.5 - 1 = -0.5 over 2;
    # cell2 1 over 1; cell3 0 over 1.
    assert store.snapshot_potential("win_proximity", ["pos"]) == {
        (0,): -0.0625,
        (1,): -0.25,
        (2,): 1.0,
        (3,): 0.0,
    }
    # loss_proximity (gamma 1, LOSS +1): cell0 1/4, cell1 1/2, others 0.
    assert store.snapshot_potential("loss_proximity", ["pos"]) == {
        (0,): 0.25,
        (1,): 0.5,
        (2,): 0.0,
        (3,): 0.0,
    }
    m = store.metrics()
    assert m["utility/win_proximity/mean"] == pytest.approx((-0.0625 - 0.25 + 1.0) / 4)
    assert m["utility/win_proximity/max"] == 1.0


def test_snapshot_aggregates_dropped_fields_weighted_by_visits():
    store = utility_store((CellField("p", (0,), name="x"), CellField("p", (1,), name="y")))

    def ep(cells):
        return EpisodeArrays(np.zeros(len(cells)), np.zeros(len(cells)), {"p": np.array(cells)})

    store.record_episode(ep([(0, 0), (0, 1), (1, 1)]), step=0, outcome=WIN)  # .25, .5, 1
    store.record_episode(ep([(0, 1), (0, 0)]), step=0, outcome=LOSS)  # -.5, -1
    # Per cell: (0,0) (0.25 - 1)/2; (0,1) (0.5 - 0.5)/2; (1,1) 1/1.
    assert store.snapshot_potential("win_proximity", ["x", "y"]) == {
        (0, 0): -0.375,
        (0, 1): 0.0,
        (1, 1): 1.0,
    }
    assert store.snapshot_potential("win_proximity", ["y", "x"]) == {
        (0, 0): -0.375,
        (1, 0): 0.0,
        (1, 1): 1.0,
    }
    # Drop y: x=0 merges (0,0),(0,1): (-0.75 + 0) / 4 visits.
    assert store.snapshot_potential("win_proximity", ["x"]) == {(0,): -0.1875, (1,): 1.0}
    # Drop x: y=1 merges (0,1),(1,1): (0 + 1) / 3 visits (not the mean of 0 and 1).
    assert store.snapshot_potential("win_proximity", ["y"]) == {(0,): -0.375, (1,): 1 / 3}
    assert store.snapshot_potential("win_proximity", []) == {(): 0.25 / 5}
    snap = store.snapshot_potential("win_proximity", ["x"])
    snap[(0,)] = 99.0  # a plain copy: the store is unaffected
    assert store.snapshot_potential("win_proximity", ["x"])[(0,)] == -0.1875
    with pytest.raises(ValueError, match=r"'z'.*\['x', 'y'\]"):
        store.snapshot_potential("win_proximity", ["z"])
    with pytest.raises(ValueError, match=r"'nope'.*\['win_proximity', 'loss_proximity'\]"):
        store.snapshot_potential("nope", ["x"])


def test_snapshots_are_consistent_while_a_writer_runs():
    # gamma 1 and only WINs: every cell's net value is exactly 1 in any consistent snapshot.
    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("pos"),), utilities=(UtilityConfig("w", gamma=1.0),)
    )
    store = TrajectoryStore(config)
    rng = np.random.default_rng(1)
    episodes = [episode(rng.integers(0, 50, 40)) for _ in range(300)]
    bad: list[dict] = []

    def reader():
        while not done.is_set():
            snap = store.snapshot_potential("w", ["pos"])
            if any(v != 1.0 for v in snap.values()):
                bad.append(snap)

    done = threading.Event()
    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i, e in enumerate(episodes):
        store.record_episode(e, step=i, outcome=WIN)
    done.set()
    for t in threads:
        t.join()
    assert not bad
    assert store.snapshot_potential("w", ["pos"]) == {(c,): 1.0 for c in range(50)}


# -- curriculum -----------------------------------------------------------------------------------

CHI2_P001 = {3: 16.266, 4: 18.467}  # chi-square critical values at p = 0.001


def chi_square(observed: np.ndarray, probabilities: np.ndarray) -> float:
    expected = probabilities * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def test_start_weights_chi_square():
    times = np.array([0, 1, 3, 8, 24])
    p = np.array([1, 1 / np.sqrt(2), 1 / 2, 1 / 3, 1 / 5])
    p /= p.sum()
    rng = np.random.default_rng(12345)
    draws = np.array([draw(times, 0.5, rng) for _ in range(20_000)])
    observed = np.bincount(draws, minlength=5)
    assert chi_square(observed, p) < CHI2_P001[4]
    # The same draws are far from uniform, so the test can fail.
    assert chi_square(observed, np.full(5, 0.2)) > CHI2_P001[4]
    assert entropy(times, 0.5) == pytest.approx(-(p * np.log(p)).sum())


def test_sample_start_counts_choices_and_updates_weights():
    store = store_1d()
    assert store.sample_start() is None
    store.record_episode(episode([0, 1], [1, 1]), step=0)
    assert store.start_probabilities() == {(0,): 0.5, (1,): 0.5}
    picks = [store.sample_start()[0] for _ in range(3)]
    n0 = sum(ref.step == 0 for ref in picks)
    assert store.cell((0,)).times_chosen == n0 and store.cell((1,)).times_chosen == 3 - n0
    w0, w1 = 1 / np.sqrt(n0 + 1), 1 / np.sqrt(3 - n0 + 1)
    assert store.start_probabilities()[(0,)] == pytest.approx(w0 / (w0 + w1))
    assert store.metrics()["curriculum_starts"] == 3


def test_sample_start_through_the_store_chi_square():
    # selection_power 0: weights do not depend on past choices, so draws are i.i.d. uniform.
    store = store_1d(selection_power=0.0)
    store.record_episode(episode([0, 1, 2, 3], [1, 1, 1, 1]), step=0)
    steps = np.array([store.sample_start()[0].step for _ in range(10_000)])
    assert chi_square(np.bincount(steps, minlength=4), np.full(4, 0.25)) < CHI2_P001[3]


def test_sample_start_returns_recorded_prefix():
    store = store_1d()
    e = episode([5, 6, 7], [0, 1, 0])
    store.record_episode(e, step=0)
    for _ in range(10):
        ref, prefix = store.sample_start()
        assert ref.trajectory_id == 0
        np.testing.assert_array_equal(prefix.actions, e.actions[: ref.step + 1])
        np.testing.assert_array_equal(prefix.rewards, e.rewards[: ref.step + 1])
        np.testing.assert_array_equal(prefix.states["pos"], e.states["pos"][: ref.step + 1])
        assert prefix.actions.dtype == np.int32 and prefix.rewards.dtype == np.float32


def test_midpoint_start_counts():
    store = store_1d()
    store.record_episode(episode([5, 6, 7], [0, 1, 0]), step=0)
    ref, _ = store.sample_start()
    cell = (5 + ref.step,)
    store.record_episode(episode([8]), step=1, start_reference=ref)  # from the pending start
    store.record_episode(episode([8]), step=2, start_reference=ref)  # decoded from repository
    other = TrajectorySliceReference(0, 2)  # never handed out: decoded -> cell (7,)
    store.record_episode(episode([8]), step=3, start_reference=other)
    expected = {cell: 2}
    expected[(7,)] = expected.get((7,), 0) + 1
    assert store.midpoint_start_counts() == expected
    assert store.cell(cell).midpoint_starts == expected[cell]
    # A reference to a trajectory that was never stored cannot be credited to a cell.
    store.record_episode(episode([8]), step=4, start_reference=TrajectorySliceReference(99, 0))
    assert store.midpoint_start_counts() == expected
    m = store.metrics()
    assert m["curriculum_unresolved_midpoint_starts"] == 1
    assert m["curriculum_midpoint_starts"] == 3
