"""The vectorised store against a step-by-step reference model (property-based)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import FORMS, as_form
from strategies import store_step_st

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    OutcomeRule,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.store import EpisodeArrays, TrajectoryStore

UTILITIES = (UtilityConfig("w", gamma=0.75), UtilityConfig("l", 1.0, ("LOSS", "DRAW"), ("WIN",)))
CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(CellField("s", (0,), name="a"), CellField("s", (1,), bucket=2, name="b")),
    utilities=UTILITIES,
)

step_st = st.tuples(st.integers(0, 2), st.integers(-2, 3), st.sampled_from([-1.0, 0.0, 0.5, 1.0]))
episode_st = st.tuples(
    st.lists(step_st, min_size=1, max_size=8), st.sampled_from(list(EpisodeOutcome))
)


def model(episodes):
    """One step at a time, straight from the rules in DESIGN.md."""
    cells: dict[tuple[int, int], dict] = {}
    stored = []
    for tid, (steps, outcome) in enumerate(episodes):
        cumulative, improved = 0.0, False
        for t, (a, b, r) in enumerate(steps):
            cumulative += r
            key = (a, b // 2)
            c = cells.setdefault(key, {"visits": 0, "best": None, "first": (tid * 10, t)})
            c["visits"] += 1
            c.setdefault("sums", [0.0] * len(UTILITIES))
            k = len(steps) - 1 - t
            for u, config in enumerate(UTILITIES):
                c["sums"][u] += config.sign(outcome) * config.gamma**k
            if (
                c["best"] is None
                or cumulative > c["best"][2]
                or (cumulative == c["best"][2] and t < c["best"][1])
            ):
                c["best"] = (tid, t, cumulative)
                improved = True
        if improved:
            stored.append(tid)
    return cells, stored


@settings(max_examples=60, deadline=None)
@given(st.lists(episode_st, min_size=1, max_size=6))
def test_store_matches_model(episodes):
    store = TrajectoryStore(CONFIG)
    for tid, (steps, outcome) in enumerate(episodes):
        s = np.array([[a, b] for a, b, _ in steps], dtype=np.int64)
        rewards = np.array([r for _, _, r in steps])
        store.record_episode(
            EpisodeArrays(np.zeros(len(steps)), rewards, {"s": s}), step=tid * 10, outcome=outcome
        )
    cells, stored = model(episodes)
    assert sorted(store.cell_keys()) == sorted(cells)
    assert store.trajectory_ids() == stored
    for key, c in cells.items():
        info = store.cell(key)
        assert info.visits == c["visits"]
        assert (info.first_seen_step, info.first_seen_offset) == c["first"]
        assert (info.best_reference.trajectory_id, info.best_reference.step) == c["best"][:2]
        assert info.best_return == c["best"][2]
    for u, config in enumerate(UTILITIES):
        snap = store.snapshot_potential(config.name, ["a", "b"])
        expected = {k: c["sums"][u] / c["visits"] for k, c in cells.items()}
        assert snap == pytest.approx(expected)
        merged: dict[tuple[int], list[float]] = {}
        for (a, _), c in cells.items():
            total = merged.setdefault((a,), [0.0, 0.0])
            total[0] += c["sums"][u]
            total[1] += c["visits"]
        assert store.snapshot_potential(config.name, ["a"]) == pytest.approx(
            {k: s / v for k, (s, v) in merged.items()}
        )


# -- batches: record against one record_episode call per episode ------------------------------

BATCH_CONFIGS = (
    CONFIG,
    # A tiny repository (evictions inside a batch) and an outcome rule.
    TrajectoryTrainingConfiguration(
        cell_fields=CONFIG.cell_fields,
        utilities=(UtilityConfig("w", gamma=0.0), UtilityConfig("one", gamma=1.0)),
        outcome_rule=OutcomeRule("reward_sign", threshold=0.5),
        repository_capacity_bytes=600,
    ),
)

batch_episode_st = st.tuples(
    st.lists(store_step_st, min_size=0, max_size=10),
    st.sampled_from(list(EpisodeOutcome)),
    st.integers(0, 3),  # start: 0 none, 1 sampled from the store, 2 made up, 3 none
)


def store_state(store: TrajectoryStore) -> dict:
    """Everything observable about a store, as plain comparable values (arrays as bytes)."""
    state = store.checkpoint_state()
    arrays = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in state["arrays"].items()}
    snapshots = {
        (u, tuple(fields)): store.snapshot_potential(u, fields)
        for u in store.utility_names
        for fields in (["a", "b"], ["b"], [])
    }
    return {
        "counters": state["counters"],
        "arrays": arrays,
        "cells": [store.cell(k) for k in store.cell_keys()],
        "ids": store.trajectory_ids(),
        "metrics": store.metrics(),
        "midpoints": store.midpoint_start_counts(),
        "starts": store.start_probabilities(),
        "snapshots": snapshots,
    }


def as_episode(steps) -> EpisodeArrays:
    s = np.array([[a, b] for a, b, _ in steps], dtype=np.int64).reshape(len(steps), 2)
    rewards = np.array([r for _, _, r in steps], dtype=np.float64)
    return EpisodeArrays(np.arange(len(steps), dtype=np.int16), rewards, {"s": s})


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(BATCH_CONFIGS),
    st.lists(st.lists(batch_episode_st, min_size=1, max_size=7), min_size=1, max_size=4),
    st.sampled_from(FORMS),
)
def test_batches_match_sequential_calls(config, batches, form):
    """record, from any source type, gives exactly what one record_episode call per episode,
    in order, gives: records, archive, references, repository, utilities."""
    one, many = TrajectoryStore(config, seed=3), TrajectoryStore(config, seed=3)
    step = 0
    for batch in batches:
        episodes, outcomes, refs = [], [], []
        for steps, outcome, start in batch:
            episodes.append(as_episode(steps))
            outcomes.append(outcome)
            ref = None
            if start == 1 and len(one):
                ref = one.sample_start()[0]
                assert many.sample_start()[0] == ref
            elif start == 2:
                ref = TrajectorySliceReference(len(refs) * 2, 1)
            refs.append(ref)
        steps_ = list(range(step, step + len(batch)))
        step += len(batch)
        expected = [
            one.record_episode(e, step=s, outcome=o, start_reference=r)
            for e, s, o, r in zip(episodes, steps_, outcomes, refs, strict=True)
        ]
        got = many.record(
            as_form(form, episodes, many), steps=steps_, outcomes=outcomes, start_references=refs
        )
        assert got.records() == expected
        assert store_state(many) == store_state(one)
