"""The reference model against factoriax's real in-process recorder, and on its own."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

from factoriax_reference import (
    factoriax_state_fields,
    load_factoriax_recorder,
    trajectory_arrays,
)
from reference_model import (
    NO_DATA_MESSAGE,
    NO_EPISODES_MESSAGE,
    ReferenceMultiWorker,
    ReferenceRecorder,
)
from strategies import (
    FACTORIAX_STATE_FIELDS,
    Chunk,
    Scenario,
    multi_worker_scenarios,
    scenarios,
)

FACTORIAX = load_factoriax_recorder()
needs_factoriax = pytest.mark.skipif(FACTORIAX is None, reason="factoriax==0.1.0 not installed")

EXTRA_KEYS = ("lengths", "episode_env", "episode_start", "episode_done", "episode_worker")

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- helpers


def finish_outcome(recorder, pad_incomplete: bool):
    """("ok", {name: array}) or ("error", message) for one finish() call."""
    try:
        with np.errstate(all="ignore"):  # float64 -> float32 overflow warnings
            result = recorder.finish(pad_incomplete=pad_incomplete)
    except ValueError as exc:
        return "error", str(exc)
    if not isinstance(result, dict):
        result = trajectory_arrays(result)
    return "ok", result


def drive(recorder, scenario: Scenario, style: str | None = None):
    """Feed every chunk; return the (is_full, num_recorded_steps) trace and two finishes."""
    trace = [(recorder.is_full, recorder.num_recorded_steps)]
    for trajectories, env_states in scenario.calls(style):
        recorder.record(trajectories, env_states)
        trace.append((recorder.is_full, recorder.num_recorded_steps))
    first = finish_outcome(recorder, scenario.pad_incomplete)
    second = finish_outcome(recorder, scenario.pad_incomplete)
    trace.append((recorder.is_full, recorder.num_recorded_steps))
    return trace, first, second


def assert_bit_identical(got: dict, want: dict, ignore: tuple = ()) -> None:
    got = {k: v for k, v in got.items() if k not in ignore}
    want = {k: v for k, v in want.items() if k not in ignore}
    assert sorted(got) == sorted(want)
    for key in want:
        a, b = got[key], want[key]
        assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
        assert a.shape == b.shape, (key, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), key


def assert_same_outcome(got, want, ignore: tuple = ()) -> None:
    assert got[0] == want[0], (got[0], want[0], got[1] if got[0] == "error" else want[1])
    if want[0] == "error":
        assert got[1] == want[1]
    else:
        assert_bit_identical(got[1], want[1], ignore)


def stored_chunks(scenario: Scenario) -> list[Chunk]:
    """The chunks a recorder keeps: each is dropped when sum(done) so far >= max_episodes."""
    kept, count = [], 0
    for chunk in scenario.chunks:
        if scenario.max_episodes is not None and count >= scenario.max_episodes:
            continue
        kept.append(chunk)
        count += int(chunk.done.sum())
    return kept


def ns(**kw):
    return types.SimpleNamespace(**kw)


def chunk(actions, dones, reward_values=None, **states):
    """(trajectories, env_states) as SimpleNamespaces; rewards default to 0.5, 1.5, ..."""
    actions = np.asarray(actions)
    dones = np.asarray(dones, dtype=bool)
    if reward_values is None:
        reward_values = np.arange(dones.size, dtype=np.float64).reshape(dones.shape) + 0.5
    return ns(action=actions, reward=np.asarray(reward_values), done=dones), ns(**states)


# --------------------------------------------------------------------------- against factoriax


@needs_factoriax
def test_strategy_field_list_matches_installed_factoriax():
    assert frozenset(FACTORIAX_STATE_FIELDS) == factoriax_state_fields()


def _compare_with_factoriax(scenario: Scenario) -> None:
    FxRecorder, _ = FACTORIAX
    fx = drive(FxRecorder(**scenario.config()), scenario)
    ref = drive(ReferenceRecorder(**scenario.config()), scenario)
    assert ref[0] == fx[0]  # is_full / num_recorded_steps after every call
    assert_same_outcome(ref[1], fx[1], ignore=EXTRA_KEYS)
    assert_same_outcome(ref[2], fx[2], ignore=EXTRA_KEYS)
    assert_same_outcome(ref[2], ref[1])  # finish() twice gives the same result


@needs_factoriax
@SETTINGS
@given(scenarios(factoriax_compatible=True))
def test_matches_factoriax(scenario):
    _compare_with_factoriax(scenario)


@needs_factoriax
@settings(SETTINGS, max_examples=100)
@given(scenarios(factoriax_compatible=True, mixed_dtypes=True))
def test_matches_factoriax_with_mixed_chunk_dtypes(scenario):
    _compare_with_factoriax(scenario)


# --------------------------------------------------------------------------- model on its own


@settings(SETTINGS, max_examples=200)
@given(scenarios())
def test_attribute_and_mapping_inputs_agree(scenario):
    a = drive(ReferenceRecorder(**scenario.config()), scenario, "attribute")
    m = drive(ReferenceRecorder(**scenario.config()), scenario, "mapping")
    assert a[0] == m[0]
    assert_same_outcome(m[1], a[1])


@settings(SETTINGS, max_examples=200)
@given(scenarios())
def test_metadata_describes_the_recorded_steps(scenario):
    """lengths/episode_* re-derived from the raw chunks, independently of the model."""
    rec = ReferenceRecorder(**scenario.config())
    for trajectories, env_states in scenario.calls():
        rec.record(trajectories, env_states)
    kept = stored_chunks(scenario)
    assert rec.num_recorded_steps == sum(c.done.shape[0] for c in kept)
    if not kept:
        with pytest.raises(ValueError, match="^No data recorded"):
            rec.finish(scenario.pad_incomplete)
        return
    actions = np.concatenate([c.action for c in kept])
    dones = np.concatenate([c.done for c in kept]).astype(bool)
    total, n_envs = dones.shape
    expected = []  # (env, start, length, done)
    for env in range(n_envs):
        start = 0
        for t in range(total):
            if dones[t, env]:
                expected.append((env, start, t + 1 - start, True))
                start = t + 1
        if scenario.pad_incomplete and (start < total or not dones[:, env].any()):
            expected.append((env, start, total - start, False))
    if not expected:
        with pytest.raises(ValueError, match="^No complete episodes found"):
            rec.finish(scenario.pad_incomplete)
        return
    if scenario.max_episodes is not None:
        expected = expected[: scenario.max_episodes]
    with np.errstate(all="ignore"):
        out = rec.finish(scenario.pad_incomplete)
    got = list(
        zip(
            out["episode_env"].tolist(),
            out["episode_start"].tolist(),
            out["lengths"].tolist(),
            out["episode_done"].tolist(),
        )
    )
    assert got == expected
    for key, dtype in [
        ("lengths", np.int64),
        ("episode_env", np.int64),
        ("episode_start", np.int64),
        ("episode_done", np.bool_),
    ]:
        assert out[key].dtype == dtype and out[key].shape == (len(expected),)
    assert out["actions"].shape[:2] == (len(expected), max(e[2] for e in expected))
    for i, (env, start, length, _) in enumerate(expected):
        assert (
            out["actions"][i, :length].tobytes() == actions[start : start + length, env].tobytes()
        )
        assert not out["actions"][i, length:].any()
        assert not out["rewards"][i, length:].any()


@settings(SETTINGS, max_examples=150)
# Two names for one trajectory field (positions / player_positions) make the
# in-process "later field wins" rule depend on which worker recorded first; the
# product refuses such state_fields, and the single-worker tests cover the rule.
@given(multi_worker_scenarios(consistent_states=True))
def test_multi_worker_is_per_worker_split_then_global_cut(scenario):
    model = ReferenceMultiWorker.replay(
        scenario.worker_calls(), scenario.order, **scenario.config()
    )
    with np.errstate(all="ignore"):
        try:
            got = model.finish(scenario.pad_incomplete)
        except ValueError as exc:
            got = exc

    # Which chunks are kept depends on the global order (is_full is global).
    kept: list[list] = [[] for _ in scenario.workers]
    count, position = 0, [0] * len(scenario.workers)
    for w in scenario.order:
        c = scenario.workers[w][position[w]]
        position[w] += 1
        if scenario.max_episodes is not None and count >= scenario.max_episodes:
            continue
        kept[w].append(c)
        count += int(c.done.sum())
    assert model.is_full == (scenario.max_episodes is not None and count >= scenario.max_episodes)
    assert model.num_recorded_steps == sum(c.done.shape[0] for w in kept for c in w)

    # Expected: each worker alone (no limit), concatenated worker by worker, then cut.
    rows = []  # (worker, env, start, length, done, actions_row, {field: row})
    for w, chunks in enumerate(kept):
        if not chunks:
            continue
        single = ReferenceRecorder(None, scenario.record_states, scenario.state_fields)
        for c in chunks:
            single.record(c.trajectories(), c.env_states())
        try:
            with np.errstate(all="ignore"):
                res = single.finish(scenario.pad_incomplete)
        except ValueError as exc:
            assert str(exc) == NO_EPISODES_MESSAGE
            continue
        fields = [k for k in res if k not in ("actions", *EXTRA_KEYS)]
        for i in range(len(res["lengths"])):
            n = int(res["lengths"][i])
            rows.append(
                (
                    w,
                    int(res["episode_env"][i]),
                    int(res["episode_start"][i]),
                    n,
                    bool(res["episode_done"][i]),
                    res["actions"][i, :n],
                    {f: res[f][i, :n] for f in fields},
                )
            )
    if not any(kept):
        assert isinstance(got, ValueError) and str(got) == NO_DATA_MESSAGE
        return
    if not rows:
        assert isinstance(got, ValueError) and str(got) == NO_EPISODES_MESSAGE
        return
    if scenario.max_episodes is not None:
        rows = rows[: scenario.max_episodes]
    assert not isinstance(got, ValueError), got
    assert got["episode_worker"].tolist() == [r[0] for r in rows]
    assert got["episode_env"].tolist() == [r[1] for r in rows]
    assert got["episode_start"].tolist() == [r[2] for r in rows]
    assert got["lengths"].tolist() == [r[3] for r in rows]
    assert got["episode_done"].tolist() == [r[4] for r in rows]
    longest = max(r[3] for r in rows)
    assert got["actions"].shape[:2] == (len(rows), longest)
    for i, r in enumerate(rows):
        n = r[3]
        assert got["actions"][i, :n].tobytes() == r[5].tobytes()
        assert not got["actions"][i, n:].any()
        for f, row in r[6].items():
            assert got[f][i, :n].tobytes() == row.tobytes(), f
            assert not got[f][i, n:].any()


@settings(SETTINGS, max_examples=100)
@given(multi_worker_scenarios(same_time_axes=True))
def test_multi_worker_equals_one_wide_worker(scenario):
    """Workers with equal time axes, glued along the env axis, make one wide run."""
    config = {**scenario.config(), "max_episodes": None}
    multi = ReferenceMultiWorker.replay(scenario.worker_calls(), scenario.order, **config)
    wide = ReferenceRecorder(**config)
    for k in range(len(scenario.workers[0])):
        parts = [w[k] for w in scenario.workers]
        states = {
            name: np.concatenate([p.states[name] for p in parts], axis=1)
            for name in parts[0].states
        }
        wide.record(
            ns(
                **{
                    f: np.concatenate([getattr(p, f) for p in parts], axis=1)
                    for f in ("action", "reward", "done")
                }
            ),
            ns(**states),
        )
    m = finish_outcome(multi, scenario.pad_incomplete)
    w = finish_outcome(wide, scenario.pad_incomplete)
    assert_same_outcome(m, w, ignore=("episode_env", "episode_worker"))
    if m[0] == "ok":
        n_envs = scenario.workers[0][0].done.shape[1]
        assert (m[1]["episode_worker"] * n_envs + m[1]["episode_env"]).tolist() == w[1][
            "episode_env"
        ].tolist()


@settings(SETTINGS, max_examples=100)
@given(scenarios())
def test_one_worker_session_equals_single_recorder(scenario):
    multi = ReferenceMultiWorker.replay([scenario.calls()], **scenario.config())
    single = ReferenceRecorder(**scenario.config())
    for trajectories, env_states in scenario.calls():
        single.record(trajectories, env_states)
    m = finish_outcome(multi, scenario.pad_incomplete)
    s = finish_outcome(single, scenario.pad_incomplete)
    assert_same_outcome(m, s, ignore=("episode_worker",))
    if m[0] == "ok":
        assert not m[1]["episode_worker"].any()


# --------------------------------------------------------------------------- hand-written cases


def test_worked_example():
    rec = ReferenceRecorder(record_states=True, state_fields=["player_positions", "map", "hp"])
    # env 0: done at t=1 and t=4; env 1: done at t=2 only. Two chunks of T=3.
    d = np.zeros((6, 2), dtype=bool)
    d[1, 0] = d[4, 0] = d[2, 1] = True
    acts = np.arange(12, dtype=np.int16).reshape(6, 2) + 1
    pos = np.arange(24, dtype=np.int32).reshape(6, 2, 2)
    hp = np.arange(12, dtype=np.uint8).reshape(6, 2)
    rew = np.arange(12, dtype=np.float64).reshape(6, 2) + 0.5
    for s in (slice(0, 3), slice(3, 6)):
        rec.record(*chunk(acts[s], d[s], rew[s], player_positions=pos[s], hp=hp[s]))
    assert rec.num_recorded_steps == 6 and not rec.is_full
    out = rec.finish()
    assert out["lengths"].tolist() == [2, 3, 1, 3, 3]
    assert out["episode_env"].tolist() == [0, 0, 0, 1, 1]
    assert out["episode_start"].tolist() == [0, 2, 5, 0, 3]
    assert out["episode_done"].tolist() == [True, True, False, True, False]
    assert out["actions"].dtype == np.int16
    assert out["actions"].tolist() == [[1, 3, 0], [5, 7, 9], [11, 0, 0], [2, 4, 6], [8, 10, 12]]
    assert out["rewards"].dtype == np.float32
    assert out["rewards"][1].tolist() == [4.5, 6.5, 8.5]
    assert sorted(out) == sorted(
        [
            "actions",
            "rewards",
            "positions",
            "hp",
            "lengths",
            "episode_env",
            "episode_start",
            "episode_done",
        ]
    )  # "map" was requested but absent: skipped
    assert out["positions"].shape == (5, 3, 2) and out["positions"].dtype == np.int32
    assert out["positions"][4].tolist() == pos[3:6, 1].tolist()
    assert out["hp"][2].tolist() == [10, 0, 0] and out["hp"].dtype == np.uint8

    cut = ReferenceRecorder(max_episodes=2)
    for s in (slice(0, 3), slice(3, 6)):
        cut.record(*chunk(acts[s], d[s]))
    assert cut.is_full  # 2 dones in the first chunk: the second chunk was dropped
    assert cut.num_recorded_steps == 3
    assert cut.finish()["lengths"].tolist() == [2, 1]  # env 0's open tail comes before env 1
    assert cut.finish(pad_incomplete=False)["lengths"].tolist() == [2, 3]


def test_errors():
    rec = ReferenceRecorder()
    with pytest.raises(ValueError, match="^No data recorded"):
        rec.finish()
    rec.record(*chunk(np.zeros((4, 2), np.int32), np.zeros((4, 2))))
    with pytest.raises(ValueError, match="^No complete episodes found"):
        rec.finish(pad_incomplete=False)
    assert rec.finish()["lengths"].tolist() == [4, 4]


def test_max_episodes_zero_records_nothing():
    rec = ReferenceRecorder(max_episodes=0)
    assert rec.is_full
    assert rec.record(*chunk(np.ones((3, 1), np.int32), np.ones((3, 1)))) is False
    assert rec.num_recorded_steps == 0
    with pytest.raises(ValueError, match="^No data recorded"):
        rec.finish()


def test_finish_twice_and_reset_keep_configuration():
    rec = ReferenceRecorder(max_episodes=3, record_states=True, state_fields=["foo_bar"])
    rec.record(*chunk(np.ones((5, 2), np.int8), np.eye(5, 2), foo_bar=np.ones((5, 2, 3))))
    first, second = rec.finish(), rec.finish()
    assert_bit_identical(first, second)
    assert rec.num_recorded_steps == 5 and not rec.is_full
    rec.reset()
    assert (rec.max_episodes, rec.record_states, rec.state_fields) == (3, True, ("foo_bar",))
    assert rec.num_recorded_steps == 0 and not rec.is_full
    with pytest.raises(ValueError, match="^No data recorded"):
        rec.finish()
    rec.record(*chunk(np.ones((5, 2), np.int8), np.eye(5, 2), foo_bar=np.ones((5, 2, 3))))
    assert_bit_identical(rec.finish(), first)


def test_empty_time_axis_gives_empty_episodes():
    rec = ReferenceRecorder()
    rec.record(*chunk(np.zeros((0, 3, 2), np.float16), np.zeros((0, 3))))
    out = rec.finish()
    assert out["actions"].shape == (3, 0, 2) and out["actions"].dtype == np.float16
    assert out["rewards"].shape == (3, 0)
    assert out["lengths"].tolist() == [0, 0, 0]
    assert out["episode_done"].tolist() == [False] * 3
    with pytest.raises(ValueError, match="^No complete episodes found"):
        rec.finish(pad_incomplete=False)


def test_state_field_missing_from_some_chunks_is_misaligned_like_factoriax():
    rec = ReferenceRecorder(record_states=True, state_fields=["timesteps"])
    rec.record(*chunk(np.ones((2, 1), np.int32), np.zeros((2, 1))))  # no timesteps here
    rec.record(*chunk(np.ones((2, 1), np.int32), [[0], [1]], timesteps=np.array([[7], [8]])))
    out = rec.finish()
    assert out["lengths"].tolist() == [4]
    assert out["timesteps"].tolist() == [[7, 8, 0, 0]]  # joined state axis is only 2 long


def test_mapping_inputs_and_arbitrary_names():
    rec = ReferenceRecorder(record_states=True, state_fields=["map", "items", "foo_bar"])
    rec.record(
        {
            "action": np.ones((2, 1), np.int64),
            "reward": np.ones((2, 1), np.int32),
            "done": np.array([[True], [False]]),
        },
        {"map": np.ones((2, 1, 2, 2), np.uint8), "items": np.ones((2, 1), np.float64)},
    )
    out = rec.finish()
    assert out["block_map"].shape == (2, 1, 2, 2) and out["items"].shape == (2, 1)
    assert "foo_bar" not in out and "map" not in out


def test_later_field_wins_on_a_trajectory_name_collision():
    rec = ReferenceRecorder(record_states=True, state_fields=["positions", "player_positions"])
    rec.record(
        *chunk(
            np.ones((2, 1), np.int32),
            np.zeros((2, 1)),
            positions=np.full((2, 1), 1),
            player_positions=np.full((2, 1), 2),
        )
    )
    assert rec.finish()["positions"].ravel().tolist() == [2, 2]


def test_reserved_trajectory_name_is_an_error():
    rec = ReferenceRecorder(record_states=True, state_fields=["rewards"])
    rec.record(*chunk(np.ones((2, 1), np.int32), np.zeros((2, 1)), rewards=np.ones((2, 1))))
    with pytest.raises(ValueError, match="reserved"):
        rec.finish()


def test_duplicate_state_fields_are_read_once():
    rec = ReferenceRecorder(record_states=True, state_fields=["timesteps", "timesteps"])
    rec.record(
        *chunk(np.ones((3, 1), np.int32), [[0], [1], [0]], timesteps=np.arange(3).reshape(3, 1))
    )
    assert rec.finish()["timesteps"].tolist() == [[0, 1], [2, 0]]


def test_multi_worker_drop_depends_on_interleaving():
    w0 = [
        chunk(np.ones((1, 2), np.int32), [[True, True]]),
        chunk(np.ones((1, 2), np.int32), [[0, 0]]),
    ]
    w1 = [chunk(np.full((2, 1), 5, np.int32), [[False], [True]])]
    first = ReferenceMultiWorker.replay([w0, w1], [0, 0, 1], max_episodes=2)
    assert first.is_full and first.num_recorded_steps == 1  # only worker 0's 1st chunk kept
    assert first.finish()["episode_worker"].tolist() == [0, 0]
    second = ReferenceMultiWorker.replay([w0, w1], [1, 0, 0], max_episodes=2)
    assert second.is_full and second.num_recorded_steps == 3  # worker 0's 2nd chunk dropped
    out = second.finish()
    # Output is worker by worker (join order), not arrival order, then cut to 2.
    assert out["episode_worker"].tolist() == [0, 0]
    assert out["episode_env"].tolist() == [0, 1]
    third = ReferenceMultiWorker.replay([w0, w1], [1, 0, 0], max_episodes=None)
    assert third.finish()["episode_worker"].tolist() == [0, 0, 0, 0, 1]


# --------------------------------------------------------------------------- factoriax quirks


@needs_factoriax
def test_factoriax_quirks_that_the_model_deliberately_does_not_share():
    FxRecorder, _ = FACTORIAX
    # Names outside its fixed list, and "rewards", are rejected by Trajectory(...).
    for name in ("foo_bar", "rewards"):
        fx = FxRecorder(record_states=True, state_fields=[name])
        fx.record(*chunk(np.ones((2, 1), np.int32), np.zeros((2, 1)), **{name: np.ones((2, 1))}))
        with pytest.raises(TypeError):
            fx.finish()
    # Duplicate state fields are stored twice per chunk.
    fx = FxRecorder(record_states=True, state_fields=["timesteps", "timesteps"])
    fx.record(
        *chunk(np.ones((3, 1), np.int32), [[0], [1], [0]], timesteps=np.arange(3).reshape(3, 1))
    )
    with pytest.raises(ValueError, match="broadcast"):
        fx.finish()
    # Mapping-style env states are read with getattr: keys are invisible, and a
    # dict method name ("items") is picked up as a 0-d object array.
    trajectories, _ = chunk(np.ones((2, 1), np.int32), np.zeros((2, 1)))
    fx = FxRecorder(record_states=True, state_fields=["timesteps", "items"])
    fx.record(trajectories, {"timesteps": np.ones((2, 1))})
    with pytest.raises(ValueError, match="zero-dimensional"):
        fx.finish()
    fx = FxRecorder(record_states=True, state_fields=["timesteps"])
    fx.record(trajectories, {"timesteps": np.ones((2, 1))})
    assert fx.finish().timesteps is None
    # Mapping-style trajectories are not accepted at all.
    with pytest.raises(AttributeError):
        FxRecorder().record(
            {"action": np.ones((1, 1)), "reward": np.ones((1, 1)), "done": np.ones((1, 1))}
        )
