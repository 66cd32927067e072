"""Property tests: the remote recorder equals the reference model bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import wait_for
from hypothesis import HealthCheck, given, settings
from reference_model import ReferenceMultiWorker, ReferenceRecorder
from strategies import multi_worker_scenarios, scenarios

from recorder_client import RolloutRecorder
from recorder_server import ServerOptions, start_server
from recorder_server.sessions import ServiceLimits

_names = itertools.count()


@pytest.fixture(scope="module")
def prop_target(tmp_path_factory):
    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path_factory.mktemp("prop")),
            limits=ServiceLimits(max_sessions=100_000),
        )
    )
    yield running.address
    running.stop(grace=0)


META = ("lengths", "episode_env", "episode_start", "episode_done")


def assert_bit_identical(got, expected: dict, with_worker: bool = False) -> None:
    fields = got.fields
    array_keys = {k for k in expected if k not in META and k != "episode_worker"}
    assert set(fields) == array_keys
    for key in array_keys:
        a, b = fields[key], expected[key]
        assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
        assert a.shape == b.shape, (key, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), key
    assert np.array_equal(got.lengths, expected["lengths"])
    assert np.array_equal(got.episode_env, expected["episode_env"])
    assert np.array_equal(got.episode_start, expected["episode_start"])
    assert np.array_equal(got.episode_done, expected["episode_done"])
    if with_worker:
        assert np.array_equal(got.episode_worker, expected["episode_worker"])


def outcome(fn):
    try:
        return "ok", fn()
    except ValueError as exc:
        return "error", str(exc)


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(scenario=scenarios(consistent_states=True))
def test_single_worker_bit_identical(prop_target, scenario):
    ref = ReferenceRecorder(**scenario.config())
    with RolloutRecorder(
        **scenario.config(), target=prop_target, session=f"p{next(_names)}"
    ) as rec:
        for trajectories, env_states in scenario.calls():
            ref.record(trajectories, env_states)
            rec.record(trajectories, env_states)
        assert rec.num_recorded_steps == ref.num_recorded_steps
        assert rec.is_full == ref.is_full
        kind, expected = outcome(lambda: ref.finish(scenario.pad_incomplete))
        if kind == "error":
            with pytest.raises(ValueError) as info:
                rec.finish(scenario.pad_incomplete)
            assert str(info.value) == expected
        else:
            assert_bit_identical(rec.finish(scenario.pad_incomplete), expected)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(scenario=multi_worker_scenarios(consistent_states=True))
def test_many_workers_match_reference_in_join_order(prop_target, scenario):
    """Workers join in index order; the global order of chunks is fixed by flushing each."""
    session = f"m{next(_names)}"
    config = scenario.config()
    ref = ReferenceMultiWorker(len(scenario.workers), **config)
    recorders = [
        RolloutRecorder(**config, target=prop_target, session=session, worker_id=f"w{i}")
        for i in range(len(scenario.workers))
    ]
    try:
        for worker, trajectories, env_states in scenario.interleaved_calls():
            ref.record(worker, trajectories, env_states)
            recorders[worker].record(trajectories, env_states)
            recorders[worker].flush()
        # Answered in each client: another worker's last chunks arrive with an update.
        expected = (ref.num_recorded_steps, ref.is_full)
        assert wait_for(
            lambda: (recorders[0].num_recorded_steps, recorders[-1].is_full) == expected, 2, 0.002
        ), ((recorders[0].num_recorded_steps, recorders[-1].is_full), expected)
        kind, expected = outcome(lambda: ref.finish(scenario.pad_incomplete))
        if kind == "error":
            with pytest.raises(ValueError) as info:
                recorders[-1].finish(scenario.pad_incomplete)
            assert str(info.value) == expected
        else:
            assert_bit_identical(
                recorders[0].finish(scenario.pad_incomplete), expected, with_worker=True
            )
    finally:
        for rec in recorders:
            rec.close()
