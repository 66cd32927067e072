"""Errors reach the caller: what the client can check is refused by record() itself.
Real servers on real ports throughout."""

from __future__ import annotations

import numpy as np
import pytest

from recorder_client import (
    InvalidChunkError,
    RolloutRecorder,
)
from recorder_client.capture_types import CellField, TrajectoryTrainingConfiguration


def chunk(t: int = 4, n: int = 3, adtype=np.int32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "action": rng.integers(0, 9, (t, n)).astype(adtype),
        "reward": rng.standard_normal((t, n)).astype(np.float32),
        "done": rng.random((t, n)) < 0.3,
    }


def states(t: int = 4, n: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return {
        "player_positions": rng.integers(0, 64, (t, n, 1, 2)).astype(np.int32),
        "player_inventory": rng.integers(0, 9, (t, n, 1, 4)).astype(np.int16),
    }


# -- record() refuses what the client can know, before anything is queued -----------------

# Each case: the second chunk, recorded right after the first one (before its ack), differs
# from it in a way the server refuses. Expected: (match in the message, chunk, env states).
CHANGES = {
    "action dtype": ("action.dtype: expected int32 .*got int64", chunk(adtype=np.int64), None),
    "reward dtype": (
        "reward.dtype: expected float32 .*got float64",
        {**chunk(), "reward": np.zeros((4, 3))},
        None,
    ),
    "N": ("N: expected 3 environments .*got 5", chunk(n=5), states(n=5)),
    "action trailing shape": (
        r"action.shape: expected trailing shape \(\) .*got \(2,\)",
        {**chunk(), "action": np.zeros((4, 3, 2), np.int32)},
        None,
    ),
    "state field gone": (
        r"state fields \['player_inventory', 'player_positions'\].*got \['player_positions'\]",
        chunk(),
        {"player_positions": states()["player_positions"]},
    ),
    "state dtype": (
        "env_states.player_inventory.dtype: expected int16 .*got int32",
        chunk(),
        {**states(), "player_inventory": np.zeros((4, 3, 1, 4), np.int32)},
    ),
    "state trailing shape": (
        r"env_states.player_positions.shape: expected trailing shape \(1, 2\) .*got \(2, 2\)",
        chunk(),
        {**states(), "player_positions": np.zeros((4, 3, 2, 2), np.int32)},
    ),
    "reward shape": (
        r"trajectories.reward: expected shape \(T, N\) = \(4, 3\), got \(4, 2\)",
        {**chunk(), "reward": np.zeros((4, 2), np.float32)},
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_changed_chunk_raises_at_record_and_nothing_is_recorded(target, case):
    match, second, second_states = CHANGES[case]
    with RolloutRecorder(target=target, session="changes", record_states=True) as rec:
        assert rec.record(chunk(), states())  # no flush: its ack has not come back yet
        with pytest.raises(InvalidChunkError, match=match):
            rec.record(second, second_states if second_states is not None else states())
        rec.flush()  # nothing was queued: nothing is refused later
        assert rec.status().num_recorded_steps == 4
        assert rec.record(chunk(seed=1), states(seed=1))  # the next good chunk records
        rec.flush()
        assert rec.status().num_recorded_steps == 8
        assert rec.stats.chunks_acked == 2 and rec.stats.chunks_sent == 2


def test_a_refused_first_chunk_does_not_fix_the_layout(target):
    """The session's dtype comes from another worker: this worker's first chunk is refused
    by the server, and its next chunk, in the session's dtype, is taken."""
    with RolloutRecorder(target=target, session="firsts", worker_id="a") as a:
        a.record(chunk())
        a.flush()
        with RolloutRecorder(target=target, session="firsts", worker_id="b") as b:
            b.record(chunk(adtype=np.int64))
            with pytest.raises(InvalidChunkError, match="action.dtype: expected int32"):
                b.flush()
            assert b.record(chunk(seed=2))
            b.flush()
            assert b.status().num_recorded_steps == 8


def test_capture_cell_field_missing_raises_at_record(tmp_path):
    from recorder_server import ServerOptions, start_server

    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("player_positions", (0, 0), bucket=8, name="x"),)
    )
    running = start_server(ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "d")))
    try:
        with RolloutRecorder(
            target=running.address, session="cells", record_states=True, capture=config
        ) as rec:
            with pytest.raises(InvalidChunkError, match="cell-key field 'player_positions'"):
                rec.record(chunk(), {"player_inventory": states()["player_inventory"]})
            with pytest.raises(InvalidChunkError, match="cell-key field 'player_positions'"):
                rec.record(chunk())  # no env states at all
            assert rec.record(chunk(), states())
            rec.flush()
            assert rec.status().num_recorded_steps == 4
    finally:
        running.stop(grace=0)
