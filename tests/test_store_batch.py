"""Batch recording (TrajectoryStore.record) against one record_episode call per episode.

The hypothesis test in test_store_model.py compares random batches with sequential calls;
these are the hand-worked cases (ties and supersession inside one batch, evictions in order),
every source type, the grouping fallbacks, the archive's id table, validation, and the capture
processor's batch twin.
"""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import DRAW, FORMS, LOSS, WIN, as_form, episode

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    OutcomeRule,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.store import (
    EpisodeArrays,
    EpisodeBatch,
    EpisodeColumns,
    EpisodeList,
    EpisodeSource,
    EpisodeWindow,
    TrajectoryCaptureProcessor,
    TrajectoryStore,
    build_store,
)
from recorder_server.store import archive as archive_mod
from recorder_server.store import batch as batch_mod
from recorder_server.store.archive import CellArchive
from recorder_server.store.repository import encode_episode


def config_1d(**kwargs) -> TrajectoryTrainingConfiguration:
    return TrajectoryTrainingConfiguration(
        cell_fields=(CellField("pos"),),
        utilities=(UtilityConfig("w", gamma=0.5), UtilityConfig("l", 1.0, ("LOSS",), ())),
        **kwargs,
    )


def best(store: TrajectoryStore, cell: int) -> tuple[int, int, float]:
    info = store.cell((cell,))
    return info.best_reference.trajectory_id, info.best_reference.step, info.best_return


def state(store: TrajectoryStore) -> dict:
    s = store.checkpoint_state()
    return {
        "counters": s["counters"],
        "arrays": {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in s["arrays"].items()},
        "cells": [store.cell(k) for k in store.cell_keys()],
        "metrics": store.metrics(),
        "ids": store.trajectory_ids(),
        "midpoints": store.midpoint_start_counts(),
    }


def record_both(config, episodes, steps, outcomes, refs=None):
    """(sequential store, batch store, sequential records, batch records)."""
    one, many = TrajectoryStore(config, seed=0), TrajectoryStore(config, seed=0)
    refs = refs or [None] * len(episodes)
    expected = [
        one.record_episode(e, step=s, outcome=o, start_reference=r)
        for e, s, o, r in zip(episodes, steps, outcomes, refs, strict=True)
    ]
    got = many.record(episodes, steps=steps, outcomes=outcomes, start_references=refs).records()
    return one, many, expected, got


def test_ties_inside_one_batch_keep_the_earlier_episode():
    episodes = [
        episode([0, 1], [0, 1]),  # A (id 0): cumulative [0, 1]
        episode([1, 0], [1, 0]),  # B (id 1): cumulative [1, 1]
        episode([1], [1]),  # C (id 2): cumulative [1]
        episode([0, 0], [0.5, 0.5]),  # D (id 3): cumulative [0.5, 1]
    ]
    one, many, expected, got = record_both(
        config_1d(), episodes, [10, 20, 30, 40], [WIN, LOSS, DRAW, WIN]
    )
    assert got == expected
    # Cell 1: A reaches it with 1 at step 1; B with 1 at step 0 (tie, shorter prefix: B wins);
    # C with 1 at step 0 (a full tie with B: the earlier episode, B, stays).
    # Cell 0: A has 0 at step 0; B has 1 at step 1 (higher: B wins); D's best step there is
    # step 1 with 1.0 (the earliest of its maximum), a full tie with B: B stays.
    assert best(many, 1) == (1, 0, 1.0)
    assert best(many, 0) == (1, 1, 1.0)
    assert [(r.trajectory_id, r.stored, r.new_cells, r.improved_cells) for r in got] == [
        (0, True, 2, 2),
        (1, True, 0, 2),
        (2, False, 0, 0),
        (3, False, 0, 0),
    ]
    # A was stored, then superseded in the same batch: kept, unreferenced.
    assert many.trajectory_ids() == [0, 1]
    m = many.metrics()
    assert (m["repository_unreferenced"], m["repository_discarded"]) == (1, 2)
    assert (many.cell((0,)).first_seen_step, many.cell((0,)).first_seen_offset) == (10, 0)
    assert (many.cell((1,)).first_seen_step, many.cell((1,)).first_seen_offset) == (10, 1)
    assert many.cell((0,)).visits == 1 + 1 + 2 and many.cell((1,)).visits == 3
    assert state(many) == state(one)
    again = TrajectoryStore(config_1d(), seed=0)
    result = again.record(episodes, steps=[10, 20, 30, 40], outcomes=[WIN, LOSS, DRAW, WIN])
    assert len(result) == 4 and result.first_trajectory_id == 0
    assert result.codes.tolist() == [WIN, LOSS, DRAW, WIN] and result.codes.dtype == np.int64
    assert result.new_cells.tolist() == [2, 0, 0, 0]
    assert result.improved_cells.tolist() == [2, 2, 0, 0]
    assert result.records() == expected


def test_later_episode_in_the_batch_beats_an_earlier_one():
    episodes = [
        episode([5, 6], [1, 0]),  # id 0: cell 6 at (1.0, step 1)
        episode([6], [1]),  # id 1: cell 6 at (1.0, step 0): shorter prefix wins
        episode([7, 6], [1, 0.5]),  # id 2: cell 6 at (1.5, step 1): higher return wins
        episode([6], [1.5]),  # id 3: cell 6 at (1.5, step 0): shorter again
        episode([6, 6], [1.5, 0]),  # id 4: a full tie with id 3: id 3 stays
    ]
    one, many, expected, got = record_both(config_1d(), episodes, [0] * 5, [WIN] * 5)
    assert got == expected
    assert best(many, 6) == (3, 0, 1.5)
    assert [r.improved_cells for r in got] == [2, 1, 2, 1, 0]
    assert state(many) == state(one)


def test_evictions_happen_in_sequence_order_inside_a_batch():
    a = episode([0, 1], [0, 0])
    b = episode([0, 1], [1, 1])  # takes both of A's cells: A unreferenced
    c = episode([0, 1], [2, 2])  # takes both of B's cells: B unreferenced
    d = episode(np.arange(100, 160), np.ones(60))  # 60 new cells, a big blob
    sa, sb, sc, sd = (len(encode_episode(e)) for e in (a, b, c, d))
    config = config_1d(repository_capacity_bytes=sb + sc + sd)
    one, many, expected, got = record_both(config, [a, b, c, d], [0, 1, 2, 3], [WIN] * 4)
    assert got == expected
    # Adding D goes over the cap: A (the oldest unreferenced) goes, then it fits.
    assert many.trajectory_ids() == [1, 2, 3]
    m = many.metrics()
    assert (m["repository_evictions"], m["repository_bytes"]) == (1, sb + sc + sd)
    assert state(many) == state(one)


def test_start_references_resolve_against_the_state_of_their_turn():
    config = config_1d()
    one, many = TrajectoryStore(config, seed=4), TrajectoryStore(config, seed=4)
    first = [episode([5, 6, 7], [0, 1, 0])]
    one.record_episode(first[0], step=0)
    many.record(first, steps=0, outcomes=EpisodeOutcome.UNKNOWN)
    ref = one.sample_start()[0]
    assert many.sample_start()[0] == ref
    episodes = [episode([8]), episode([8]), episode([9]), episode([9])]
    refs = [ref, ref, TrajectorySliceReference(0, 2), TrajectorySliceReference(99, 0)]
    for e, r in zip(episodes, refs, strict=True):
        one.record_episode(e, step=1, start_reference=r)
    many.record(episodes, steps=1, outcomes=0, start_references=refs)
    assert many.midpoint_start_counts() == one.midpoint_start_counts()
    assert many.metrics()["curriculum_unresolved_midpoint_starts"] == 1
    assert state(many) == state(one)


def test_episode_batch_and_mixed_dtypes():
    rng = np.random.default_rng(5)
    episodes = [episode(rng.integers(0, 9, n), rng.choice([0.0, 1.0], n)) for n in (3, 0, 7, 1)]
    one, many, expected, got = record_both(config_1d(), episodes, [1, 2, 3, 4], [WIN] * 4)
    concatenated = TrajectoryStore(config_1d(), seed=0)
    batch = EpisodeBatch.from_episodes(episodes)
    assert len(batch) == 4 and batch.offsets.tolist() == [0, 3, 3, 10, 11]
    np.testing.assert_array_equal(batch.episode(2).states["pos"], episodes[2].states["pos"])
    assert concatenated.record(batch, steps=[1, 2, 3, 4], outcomes=WIN).records() == got
    assert state(concatenated) == state(many) == state(one)
    # Different dtypes per episode: keyed episode by episode, stored as given.
    mixed = [
        EpisodeArrays(np.zeros(2), np.ones(2), {"pos": np.array([1.5, 2.0])}),
        EpisodeArrays(np.zeros(2, np.int8), np.ones(2, np.int64), {"pos": np.array([1, 3])}),
    ]
    one, many, expected, got = record_both(config_1d(), mixed, [0, 1], [LOSS, WIN])
    assert got == expected and state(many) == state(one)
    with pytest.raises(ValueError, match=r"episodes\[1\]: dtypes"):
        EpisodeBatch.from_episodes(mixed)


def test_invalid_batch_records_nothing():
    store = TrajectoryStore(config_1d())
    good = episode([0, 1])
    bad = EpisodeArrays(np.zeros(2), np.zeros(2), {"x": np.zeros(2)})
    with pytest.raises(ValueError, match="'pos' is missing"):
        store.record([good, good, bad], steps=0, outcomes=WIN)
    with pytest.raises(ValueError, match="non-finite"):
        store.record([good, episode([0, 1], [0, np.inf])], steps=0, outcomes=WIN)
    with pytest.raises(ValueError, match="outcomes: expected 2"):
        store.record([good, good], steps=0, outcomes=[WIN])
    with pytest.raises(ValueError, match=r"steps\[1\]"):
        store.record([good, good], steps=[0, "1"], outcomes=WIN)
    with pytest.raises(ValueError, match="start_reference"):
        store.record([good], steps=0, outcomes=WIN, start_references=[(0, 0)])
    with pytest.raises(ValueError, match="single episode"):
        store.record(good, steps=0, outcomes=WIN)
    with pytest.raises(ValueError, match="expected an EpisodeSource or a sequence"):
        store.record(3, steps=0, outcomes=WIN)
    columns = EpisodeColumns(np.zeros(2), np.zeros((2, 2), np.int64), [2], lambda i: good)
    with pytest.raises(ValueError, match=r"columns: expected 1 rows .*got 2"):
        store.record(columns, steps=0, outcomes=WIN)
    ring = np.zeros((2, 1, 4), np.int64)
    window = EpisodeWindow(ring, np.zeros((1, 4)), [0], [0], [2], lambda i: None)
    with pytest.raises(ValueError, match=r"key_ring: expected 1 rows .*got 2"):
        store.record(window, steps=0, outcomes=WIN)
    with pytest.raises(ValueError, match="defer: expected a callable"):
        EpisodeWindow(ring[:1], np.zeros((1, 4)), [0], [0], [2], None)
    assert len(store) == 0 and store.metrics()["store_episodes"] == 0
    empty = store.record([], steps=0, outcomes=[])
    assert len(empty) == 0 and empty.records() == []
    assert store.record_episode(good, step=0).trajectory_id == 0  # no id was used up


RULED = TrajectoryTrainingConfiguration(
    cell_fields=(CellField("p", (0,), bucket=3, name="x"), CellField("p", (1,), name="y")),
    utilities=(UtilityConfig("w", gamma=0.9), UtilityConfig("l", 1.0, ("LOSS",), ("WIN",))),
    outcome_rule=OutcomeRule("reward_sign", 0.5),
    repository_capacity_bytes=3000,
)


def source_batches(seed: int, wide: bool = False) -> list[list[EpisodeArrays]]:
    rng = np.random.default_rng(seed)

    def ep(n):
        high = 2**40 if wide else 6
        p = rng.integers(-high, high, (n, 2)).astype(np.int64)
        rewards = rng.choice([-1.0, 0.0, 0.5, 1.0], n).astype(np.float32)
        return EpisodeArrays(rng.integers(0, 4, n).astype(np.int8), rewards, {"p": p})

    return [[ep(int(n)) for n in rng.integers(0, 25, 7)] for _ in range(5)]


@pytest.mark.parametrize("capacity", [RULED.repository_capacity_bytes, 1 << 30])
@pytest.mark.parametrize("grouping", ["dense", "fallback", "wide"])
def test_every_source_type_gives_the_same_store(monkeypatch, capacity, grouping):
    """record() with a list, an EpisodeBatch, an EpisodeColumns and an EpisodeWindow of the
    same episodes: the same results and store as one record_episode call per episode. A
    window's episodes are deferred: with room in the repository none is read before a
    checkpoint asks for the blobs."""
    import dataclasses

    config = dataclasses.replace(RULED, repository_capacity_bytes=capacity)
    if grouping == "fallback":  # the window's dense pass gives up: grouped from as_columns()
        monkeypatch.setattr(batch_mod, "_DENSE_MIN", 0)
        monkeypatch.setattr(batch_mod, "_DENSE_FACTOR", 0)
    batches = source_batches(21, wide=grouping == "wide")
    one = TrajectoryStore(config, seed=0)
    expected = []
    for b, batch in enumerate(batches):
        outcomes = [EpisodeOutcome(i % 5) for i in range(len(batch))]
        expected.append([one.record_episode(e, step=b, outcome=o) for e, o in zip(batch, outcomes)])
    reference = state(one)
    evicted = reference["metrics"]["repository_evictions"] > 0
    assert evicted == (capacity < 1 << 20 and grouping != "wide")  # wide: every step a new cell
    for form in FORMS:
        store, fetches = TrajectoryStore(config, seed=0), []
        for b, batch in enumerate(batches):
            outcomes = [EpisodeOutcome(i % 5) for i in range(len(batch))]
            source = as_form(form, batch, store, fetches)
            assert isinstance(source, EpisodeSource) == (form != "list")
            result = store.record(source, steps=b, outcomes=outcomes)
            assert result.records() == expected[b], form
        if form == "window" and capacity > 1 << 20:
            assert fetches == [] and store.metrics()["repository_deferred"] > 0
        if form == "columns":
            assert 0 < len(fetches) < sum(map(len, batches))  # only the stored ones
        assert state(store) == reference, form


@pytest.mark.parametrize(
    "limits",
    [
        {"_DENSE_MIN": 0, "_DENSE_FACTOR": 0},  # np.unique codes
        {"_CODE_LIMIT": 0},  # keys as bytes
    ],
)
def test_grouping_fallbacks_give_the_same_store(monkeypatch, limits):
    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("p", (0,), bucket=3, name="x"), CellField("p", (1,), name="y")),
        utilities=(UtilityConfig("w", gamma=0.9),),
        outcome_rule=OutcomeRule("reward_sign", 0.0),
        repository_capacity_bytes=2000,
    )
    rng = np.random.default_rng(11)

    def ep(n, wide):
        high = 2**62 if wide else 6
        p = rng.integers(-high, high, (n, 2))
        return EpisodeArrays(np.zeros(n), rng.choice([-1.0, 0.0, 1.0], n), {"p": p})

    batches = [[ep(int(n), wide) for n in rng.integers(0, 30, 8)] for wide in (0, 0, 1, 0)]
    fast = TrajectoryStore(config, seed=0)
    for b in batches:
        fast.record(b, steps=1, outcomes=EpisodeOutcome.UNKNOWN)
    for name, value in limits.items():
        monkeypatch.setattr(batch_mod, name, value)
    slow, one = TrajectoryStore(config, seed=0), TrajectoryStore(config, seed=0)
    for b in batches:
        slow.record(b, steps=1, outcomes=EpisodeOutcome.UNKNOWN)
        for e in b:
            one.record_episode(e, step=1)
    assert state(slow) == state(fast) == state(one)


# -- the archive's id table -----------------------------------------------------------------------


def apply_batches(archive: CellArchive, config, batches, tid: int = 0) -> list:
    """Each batch grouped as the store groups it and folded into the archive (trajectory ids
    from ``tid`` on); the updates."""
    updates = []
    for b in batches:
        cells = EpisodeList(b).group(config.cell_fields, lambda n: np.ones((0, n))).cells
        updates.append(archive.apply_batch(cells, tid, np.ones(len(b), dtype=np.int64)))
        tid += len(b)
    return updates


def test_archive_id_table_gives_the_ids_of_the_key_dict(monkeypatch):
    """Keys that drift outward (the table's box regrows), then jump far (the table is given up
    for the dict): the same archive updates and store as with the dict alone, and every cell
    found by key."""
    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("p", (0,), name="x"), CellField("p", (1,), bucket=2, name="y")),
        utilities=(UtilityConfig("w", gamma=0.9),),
        outcome_rule=OutcomeRule("reward_sign", 0.0),
    )
    rng = np.random.default_rng(5)

    def batch(spread, shift=0):
        return [
            EpisodeArrays(
                np.zeros(n),
                rng.choice([-1.0, 0.0, 1.0], n),
                {"p": rng.integers(-spread, spread + 1, (n, 2)) + shift},
            )
            for n in rng.integers(1, 20, 6)
        ]

    batches = [batch(s) for s in (1, 2, 5, 40, 300)] + [batch(3, 1 << 40), batch(7)]
    table = CellArchive(2)
    grown = apply_batches(table, config, batches[:5])
    assert table.id_table is not None and not table.id_table_given_up
    updates = grown + apply_batches(table, config, batches[5:], sum(map(len, batches[:5])))
    assert table.id_table_given_up and table.id_table is None  # the far jump gave it up
    table_store = TrajectoryStore(config, seed=0)
    for b in batches:
        table_store.record(b, steps=1, outcomes=EpisodeOutcome.UNKNOWN)
    monkeypatch.setattr(archive_mod, "_TABLE_LIMIT", 0)
    plain = CellArchive(2)
    plain_updates = apply_batches(plain, config, batches)
    assert plain.id_table is None
    plain_store = TrajectoryStore(config, seed=0)
    for b in batches:
        plain_store.record(b, steps=1, outcomes=EpisodeOutcome.UNKNOWN)
    for got, want in zip(updates, plain_updates, strict=True):
        for name in ("cell_ids", "new_cells", "improved", "released_tid", "released_count"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    for name, column in table.state_arrays().items():
        np.testing.assert_array_equal(column, plain.state_arrays()[name])
    assert state(table_store) == state(plain_store)
    keys = table_store.cell_keys()
    assert len(keys) == len(set(keys)) > 100
    assert all(table_store.cell(k) is not None for k in keys)
    assert [table.lookup(k) for k in keys] == list(range(len(keys)))


def test_archive_id_table_stays_on_while_keys_fit():
    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("p", (0,), name="x"), CellField("p", (1,), name="y")),
    )
    archive = CellArchive(2)
    rng = np.random.default_rng(6)
    for spread in (1, 4, 16, 64):
        p = rng.integers(-spread, spread + 1, (50, 2))
        apply_batches(archive, config, [[EpisodeArrays(np.zeros(50), np.ones(50), {"p": p})]])
    assert archive.id_table is not None and not archive.id_table_given_up
    lows, highs, strides, table = archive.id_table
    keys = archive.view("keys")
    np.testing.assert_array_equal(table[(keys - lows) @ strides], np.arange(len(archive)))
    assert (table >= 0).sum() == len(archive)
    # Room to grow, but no more than twice the keys' extent per field.
    assert ((highs - lows + 1) <= 2 * (keys.max(axis=0) - keys.min(axis=0) + 1)).all()


# -- the capture processor ------------------------------------------------------------------------

CAPTURE_CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0,), bucket=2, name="x"),
        CellField("player_positions", (1,), bucket=2, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.9),),
    outcome_rule=OutcomeRule("reward_sign", 0.5),
)


class NullMetrics:
    def log_many(self, values, step):
        pass


def capture_episodes(seed: int, count: int) -> list[EpisodeArrays]:
    rng = np.random.default_rng(seed)
    out = []
    for n in rng.integers(0, 40, count):
        out.append(
            EpisodeArrays(
                actions=rng.integers(0, 5, n).astype(np.int16),
                rewards=rng.choice([0.0, 0.5, 1.0, -1.0], n).astype(np.float32),
                states={"player_positions": rng.integers(0, 12, (n, 2)).astype(np.int32)},
            )
        )
    return out


@pytest.mark.parametrize("with_store", [True, False])
@pytest.mark.parametrize("form", FORMS)
def test_processor_batch_matches_sequential(with_store, form):
    config = CAPTURE_CONFIG if with_store else None

    def processor() -> TrajectoryCaptureProcessor:
        return TrajectoryCaptureProcessor(config, NullMetrics(), build_store(config, seed=2))

    one, many = processor(), processor()
    episodes = capture_episodes(3, 12)
    outcomes = [EpisodeOutcome(i % 5) for i in range(12)]
    refs = [None if i % 4 else TrajectorySliceReference(i, 0) for i in range(12)]
    for i, (e, o, r) in enumerate(zip(episodes, outcomes, refs, strict=True)):
        one.record_episode(e, {"i": float(i)}, 7, outcome=o, start_reference=r)
    keyer = TrajectoryStore(CAPTURE_CONFIG)  # keys the columns and rings of the source
    many.record_episodes(
        as_form(form, episodes, keyer), 7, outcomes=outcomes, start_references=refs
    )
    assert many.runtime_state_dict() == one.runtime_state_dict()
    if with_store:
        assert state(many.store) == state(one.store)
    # Outcome codes as an int array, one step per episode.
    again = processor()
    codes = np.array([int(o) for o in outcomes], dtype=np.int8)
    again.record_episodes(
        as_form(form, episodes, keyer), [7] * 12, outcomes=codes, start_references=refs
    )
    assert again.runtime_state_dict() == one.runtime_state_dict()


@pytest.mark.parametrize("form", FORMS)
def test_processor_without_store_applies_the_rule_to_unknown_outcomes(form):
    """A configuration without a store: UNKNOWN outcomes still go through the rule."""
    one = TrajectoryCaptureProcessor(CAPTURE_CONFIG, NullMetrics(), None)
    many = TrajectoryCaptureProcessor(CAPTURE_CONFIG, NullMetrics(), None)
    episodes = capture_episodes(8, 9)
    for e in episodes:
        one.record_episode(e, {}, 1, outcome=EpisodeOutcome.UNKNOWN)
    source = as_form(form, episodes, TrajectoryStore(CAPTURE_CONFIG))
    many.record_episodes(source, 1, outcomes=0)
    counters = many.runtime_state_dict()["counters"]
    assert counters == one.runtime_state_dict()["counters"]
    assert counters["outcome_unknown"] == 0
    returns = [float(np.sum(e.rewards, dtype=np.float64)) for e in episodes]
    assert counters["outcome_win"] == sum(r > 0.5 for r in returns)


def test_processor_without_store_counts_only_and_validates():
    proc = TrajectoryCaptureProcessor(None, NullMetrics(), None)
    episodes = capture_episodes(4, 5)
    proc.record_episodes(episodes, 3, outcomes=np.array([1, 1, 2, 0, 4]))
    counters = proc.runtime_state_dict()["counters"]
    assert counters["episodes_captured"] == 5
    assert counters["steps_captured"] == sum(e.length for e in episodes)
    assert (counters["outcome_win"], counters["outcome_loss"]) == (2, 1)
    assert (counters["outcome_unknown"], counters["outcome_incomplete"]) == (1, 1)
    before = proc.runtime_state_dict()
    with pytest.raises(ValueError, match="unknown code 7"):
        proc.record_episodes(episodes, 3, outcomes=np.array([1, 1, 7, 0, 4]))
    with pytest.raises(ValueError, match="step"):
        proc.record_episodes(episodes, "3", outcomes=WIN)
    with pytest.raises(ValueError, match="single episode"):
        proc.record_episodes(episodes[0], 3, outcomes=WIN)
    with pytest.raises(ValueError, match="start_references"):
        proc.record_episodes(episodes, 3, outcomes=WIN, start_references=[None])
    with pytest.raises(ValueError, match="episode_data"):
        proc.record_episode(episodes[0], [1.0], 3, outcome=WIN)
    assert proc.runtime_state_dict() == before
