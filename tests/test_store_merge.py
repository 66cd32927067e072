"""Merging trajectory-store checkpoints (server/store/merge.py): shards of a run merged against
one store fed every episode, commutativity and associativity, refused inputs, and
`rollout-recorder store merge` as a real process."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import WIN, episode
from strategies import store_step_st

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
    TrajectoryCaptureProcessor,
    TrajectoryStore,
    build_store,
    encode_checkpoint_state,
)
from recorder_server.store.merge import (
    merge_archives,
    merge_checkpoints,
    merge_sources,
    read_checkpoint_state,
    trajectory_source,
)

CELLS = (CellField("s", (0,), name="a"), CellField("s", (1,), bucket=2, name="b"))
CONFIGS = (
    TrajectoryTrainingConfiguration(
        cell_fields=CELLS,
        utilities=(UtilityConfig("w", gamma=0.75), UtilityConfig("l", 1.0, ("LOSS",), ("WIN",))),
    ),
    # A tiny repository (the shards evict) and an outcome rule.
    TrajectoryTrainingConfiguration(
        cell_fields=CELLS,
        utilities=(UtilityConfig("w", gamma=0.0), UtilityConfig("one", gamma=1.0)),
        outcome_rule=OutcomeRule("reward_sign", threshold=0.5),
        repository_capacity_bytes=600,
    ),
)

# Few cells and few reward values: cells shared between shards, ties on return and step.
episode_st = st.tuples(
    st.lists(store_step_st, min_size=0, max_size=8), st.sampled_from(list(EpisodeOutcome))
)


def as_episode(steps, index: int) -> EpisodeArrays:
    """An episode over the (N, 2) state ``s``; its actions name it (``index``)."""
    s = np.array([[a, b] for a, b, _ in steps], dtype=np.int64).reshape(len(steps), 2)
    rewards = np.array([r for _, _, r in steps], dtype=np.float64)
    actions = np.arange(len(steps), dtype=np.int64) + 1000 * index
    return EpisodeArrays(actions, rewards, {"s": s})


def checkpoint(store: TrajectoryStore, compress: bool = False) -> bytes:
    return encode_checkpoint_state(store.checkpoint_state(), compress)


def prefix(store: TrajectoryStore, trajectory_id: int, step: int) -> tuple[float, int]:
    """(return, length) of a stored trajectory's prefix up to ``step``."""
    trajectory = store.trajectory(trajectory_id)
    assert trajectory is not None and step < trajectory.length
    return float(np.cumsum(trajectory.rewards, dtype=np.float64)[step]), step + 1


def same_episode(a: EpisodeArrays, b: EpisodeArrays) -> bool:
    return (
        np.array_equal(a.actions, b.actions)
        and np.array_equal(a.rewards, b.rewards)
        and a.states.keys() == b.states.keys()
        and all(np.array_equal(a.states[k], b.states[k]) for k in a.states)
    )


def assert_like_one_store(
    merged: dict, one: TrajectoryStore, shards: dict[str, TrajectoryStore]
) -> None:
    """The merge holds what ``one`` holds (every episode has its own step), up to which of
    equally good trajectories a best reference names; times chosen are the shards' sums."""
    config = one.configuration
    got, want = merged["arrays"], one.checkpoint_state()["arrays"]
    for name in ("keys", "visits", "first_seen_step", "first_seen_offset"):
        np.testing.assert_array_equal(got[f"archive/{name}"], want[f"archive/{name}"], name)
    for name in ("best_step", "best_return"):
        np.testing.assert_array_equal(got[f"archive/{name}"], want[f"archive/{name}"], name)
    chosen: dict[tuple[int, ...], int] = {}
    for shard in shards.values():
        columns = shard.archive_columns()
        for key, n in zip(map(tuple, columns["keys"].tolist()), columns["times_chosen"].tolist()):
            chosen[key] = chosen.get(key, 0) + n
    keys = list(map(tuple, got["archive/keys"].tolist()))
    assert got["archive/times_chosen"].tolist() == [chosen[k] for k in keys]
    for u in config.utilities:  # the same sums, added in another order
        name = f"utility/{u.name}"
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12)
    assert merged["counters"]["episodes"] == one.checkpoint_state()["counters"]["episodes"]
    assert merged["counters"]["steps"] == one.checkpoint_state()["counters"]["steps"]
    assert got["repository/counters"][0] == want["repository/counters"][0]  # ids handed out

    # It loads (refcounts checked); every reference resolves to a prefix as good as one's,
    # reaching its cell, and to the very episode its source store holds.
    restored = TrajectoryStore(config)
    restored.load_checkpoint_state(merged)
    for i, key in enumerate(keys):
        tid, step = int(got["archive/best_trajectory"][i]), int(got["archive/best_step"][i])
        one_tid = int(want["archive/best_trajectory"][i])
        assert prefix(restored, tid, step) == prefix(one, one_tid, step)
        trajectory = restored.trajectory(tid)
        assert tuple(restored.step_columns(trajectory.states, trajectory.length)[:, step]) == key
        source, original = trajectory_source(merged, tid)
        assert same_episode(shards[source.name].trajectory(original), trajectory)
    for u in config.utilities:
        assert restored.snapshot_potential(u.name, ["b"]) == pytest.approx(
            one.snapshot_potential(u.name, ["b"]), rel=1e-12, abs=1e-12
        )


def assert_same_up_to_rounding(a: dict, b: dict) -> None:
    """Equal checkpoint states, but for utility sums added in another grouping."""
    assert {k: v for k, v in a.items() if k != "arrays"} == {
        k: v for k, v in b.items() if k != "arrays"
    }
    assert a["arrays"].keys() == b["arrays"].keys()
    for name, value in a["arrays"].items():
        if name.startswith("utility/"):
            np.testing.assert_allclose(value, b["arrays"][name], rtol=1e-12, atol=1e-12)
        else:
            np.testing.assert_array_equal(value, b["arrays"][name], name)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(CONFIGS),
    st.lists(episode_st, min_size=1, max_size=10),
    st.integers(1, 4),
    st.data(),
)
def test_merged_shards_hold_what_one_store_fed_everything_holds(config, episodes, k, data):
    shard_of = data.draw(
        st.lists(st.integers(0, k - 1), min_size=len(episodes), max_size=len(episodes))
    )
    starts = data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k))
    one = TrajectoryStore(config)
    names = [f"node{j}" for j in range(k)]
    shards = {name: TrajectoryStore(config, seed=j) for j, name in enumerate(names)}
    for i, (steps, outcome) in enumerate(episodes):
        one.record_episode(as_episode(steps, i), step=10 * i, outcome=outcome)
        shard = shards[names[shard_of[i]]]
        shard.record_episode(as_episode(steps, i), step=10 * i, outcome=outcome)
    for shard, count in zip(shards.values(), starts):
        for _ in range(count):
            shard.sample_start()  # counts a choice (None while the shard has no cells)
    files = [checkpoint(shards[name]) for name in names]

    merged_file = merge_archives(files, sources=names, compress=False)
    merged = read_checkpoint_state(merged_file)
    assert [s.name for s in merge_sources(merged)] == names
    assert_like_one_store(merged, one, shards)
    # Exact ties go to the first source by name, then its earliest trajectory: one store's
    # own choice when there is one source.
    for key, tid in zip(
        map(tuple, merged["arrays"]["archive/keys"].tolist()),
        merged["arrays"]["archive/best_trajectory"].tolist(),
    ):
        cells = [(name, shard.cell(key)) for name, shard in shards.items()]
        name, info = min(
            ((n, c) for n, c in cells if c is not None),
            key=lambda nc: (-nc[1].best_return, nc[1].best_reference.step, nc[0]),
        )
        source, original = trajectory_source(merged, tid)
        assert (source.name, original) == (name, info.best_reference.trajectory_id)

    # Commutative: any order of the shards gives the same bytes.
    order = data.draw(st.permutations(range(k)))
    shuffled = merge_archives(
        [files[j] for j in order], sources=[names[j] for j in order], compress=False
    )
    assert shuffled == merged_file
    # Associative: merges of merges, however grouped (their labels are kept: None).
    if k >= 3:
        left = merge_archives(
            [merge_archives(files[:2], sources=names[:2]), *files[2:]],
            sources=[None, *names[2:]],
            compress=False,
        )
        right = merge_archives(
            [files[0], merge_archives(files[1:], sources=names[1:])],
            sources=[names[0], None],
            compress=False,
        )
        assert_same_up_to_rounding(read_checkpoint_state(left), read_checkpoint_state(right))
        assert_same_up_to_rounding(read_checkpoint_state(left), merged)


def test_the_order_of_inputs_never_changes_a_bit():
    """Utility sums are added in one order (by source name) whatever order the inputs come in:
    0.1 + 0.2 + 0.3 rounds differently from 0.3 + 0.2 + 0.1."""
    files = []
    for value in (0.1, 0.2, 0.3):
        store = TrajectoryStore(CONFIGS[0])
        store.record_episode(as_episode([(0, 0, 1.0)], 0), step=0, outcome=WIN)
        state = store.checkpoint_state()
        state["arrays"]["utility/w"] = np.array([value])
        files.append(encode_checkpoint_state(state, False))
    names = ["a", "b", "c"]
    merged = {
        merge_archives([files[j] for j in order], sources=[names[j] for j in order])
        for order in itertools.permutations(range(3))
    }
    assert len(merged) == 1
    (sums,) = {read_checkpoint_state(m)["arrays"]["utility/w"][0] for m in merged}
    assert sums == (0.1 + 0.2) + 0.3


def test_midpoint_starts_and_their_counters_add():
    config = CONFIGS[0]
    stores = {"a": TrajectoryStore(config, seed=1), "b": TrajectoryStore(config, seed=2)}
    expected: dict[tuple[int, ...], int] = {}
    for n, store in enumerate(stores.values()):
        store.record_episode(as_episode([(0, 0, 1.0), (1, 2, 0.0)], n), step=0, outcome=WIN)
        for _ in range(2):
            ref, _ = store.sample_start()
            expected[ref.cell] = expected.get(ref.cell, 0) + 1
            store.record_episode(
                as_episode([(2, 2, 0.0)], n), step=1, outcome=WIN, start_reference=ref
            )
        # A reference to no stored trajectory: an unresolved midpoint start.
        made_up = TrajectorySliceReference(999, 0)
        store.record_episode(as_episode([(2, 2, 0.0)], n), step=2, start_reference=made_up)
    merged = merge_checkpoints([checkpoint(s) for s in stores.values()], sources=list(stores))
    restored = TrajectoryStore(config)
    restored.load_checkpoint_state(merged)
    assert restored.midpoint_start_counts() == expected
    assert merged["counters"]["unresolved_midpoint_starts"] == 2
    assert merged["counters"]["episodes"] == 8


def _other(config: TrajectoryTrainingConfiguration, **changes) -> TrajectoryTrainingConfiguration:
    return dataclasses.replace(config, **changes)


@pytest.mark.parametrize(
    ("field", "config"),
    [
        (
            "cell_fields",
            _other(CONFIGS[0], cell_fields=(CELLS[0], dataclasses.replace(CELLS[1], bucket=3))),
        ),
        ("utilities", _other(CONFIGS[0], utilities=(UtilityConfig("w", gamma=0.5),))),
        ("outcome_rule", _other(CONFIGS[0], outcome_rule=OutcomeRule("reward_sign"))),
        ("repository_capacity_bytes", _other(CONFIGS[0], repository_capacity_bytes=10_000)),
    ],
)
def test_inputs_of_other_configurations_are_refused_by_field(field, config):
    a, b = TrajectoryStore(CONFIGS[0]), TrajectoryStore(config)
    for store in (a, b):
        store.record_episode(as_episode([(0, 0, 1.0)], 0), step=0)
    with pytest.raises(ValueError, match=rf"input1: configuration\.{field} differs from input0"):
        merge_archives([checkpoint(a), checkpoint(b)])


def test_refused_inputs_and_labels():
    store = TrajectoryStore(CONFIGS[0])
    store.record_episode(as_episode([(0, 0, 1.0)], 0), step=0)
    good = checkpoint(store)
    state = store.checkpoint_state()
    other_version = encode_checkpoint_state(
        {**state, "format": "recorder.trajectory_store.v0"}, False
    )
    with pytest.raises(ValueError, match=r"input1: format: expected .*v1.*got .*v0"):
        merge_archives([good, other_version])
    with pytest.raises(ValueError, match="input0: not a trajectory store checkpoint"):
        merge_archives([b"not a checkpoint"])
    with pytest.raises(ValueError, match="'n' names two stores"):
        merge_archives([good, good], sources=["n", "n"])
    twice = merge_archives([good, good], sources=["x", "y"])
    with pytest.raises(ValueError, match="already merges sources"):
        merge_archives([twice, good], sources=["z", "w"])
    with pytest.raises(ValueError, match="sources: expected 2 labels"):
        merge_archives([good, good], sources=["x"])


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60)


def _checkpoint_file(config, positions, rewards, compress: bool) -> bytes:
    """A store checkpoint file's bytes, as the processor writes them."""
    processor = TrajectoryCaptureProcessor(config, _NoMetrics(), build_store(config))
    processor.record_episode(episode(positions, rewards), {}, 0, outcome=WIN)
    return processor.trajectory_store_checkpoint_file(compress, checkpoint_step=1).data


class _NoMetrics:
    def log_many(self, values: dict[str, float], step: int) -> None:
        pass


POS = TrajectoryTrainingConfiguration(
    cell_fields=(CellField("pos"),), utilities=(UtilityConfig("w", gamma=0.9),)
)


def test_cli_merges_files_atomically_and_summarises(tmp_path):
    a, b = tmp_path / "a.bin.zst", tmp_path / "b.bin"
    a.write_bytes(_checkpoint_file(POS, [0, 1, 2], [0.0, 1.0, 0.0], compress=True))
    b.write_bytes(_checkpoint_file(POS, [2, 3], [2.0, 0.0], compress=False))
    out = tmp_path / "merged.bin.zst"
    done = _run("recorder_server", "store", "merge", str(a), str(b), "-o", str(out),
                "--source", "node-a", "--source", "node-b")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and done.stderr == ""
    assert "4 cells, 5 visits" in done.stdout and "2 sources (node-a, node-b)" in done.stdout
    assert out.read_bytes() == merge_archives([a, b], sources=["node-a", "node-b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin.zst", "b.bin", "merged.bin.zst"]
    merged = read_checkpoint_state(out.read_bytes())
    # Cell 2: node-b reached it with return 2.0 (its step 0), node-a with 1.0.
    store = TrajectoryStore(POS)
    store.load_checkpoint_state(merged)
    best = store.cell((2,)).best_reference
    assert trajectory_source(merged, best.trajectory_id)[0].name == "node-b"
    # The merge merged again: it keeps its labels ('-'); the new file is labelled by its path.
    c, again = tmp_path / "c.bin", tmp_path / "again.bin"
    c.write_bytes(_checkpoint_file(POS, [5], [0.0], compress=False))
    done = _run("recorder_server", "store", "merge", str(out), str(c), "-o", str(again),
                "--source", "-", "--source", "-")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "5 cells, 6 visits" in done.stdout
    names = [s.name for s in merge_sources(read_checkpoint_state(again.read_bytes()))]
    assert names == sorted(["node-a", "node-b", str(c)])


def test_cli_refuses_incompatible_and_unreadable_files(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(_checkpoint_file(POS, [0, 1], [0.0, 1.0], compress=False))
    bucketed = _other(POS, cell_fields=(CellField("pos", bucket=2),))
    b.write_bytes(_checkpoint_file(bucketed, [0, 1], [0.0, 1.0], compress=False))
    out = tmp_path / "out.bin"
    # Through `python -m recorder_server.store` too: with arguments it is `store ...`.
    done = _run("recorder_server.store", "merge", str(a), str(b), "-o", str(out))
    assert done.returncode == 2
    assert "configuration.cell_fields differs" in done.stderr and "bucket" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    (tmp_path / "junk.bin").write_bytes(b"junk")
    for bad in ("junk.bin", "missing.bin"):
        done = _run(
            "recorder_server", "store", "merge", str(a), str(tmp_path / bad), "-o", str(out)
        )
        assert done.returncode == 2 and bad in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
