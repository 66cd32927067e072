"""capture_types (validation, JSON transport, outcome codes) and the store's public names."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    OutcomeRule,
    TrajectorySliceReference,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)


def test_configuration_json_round_trip():
    config = TrajectoryTrainingConfiguration(
        cell_fields=(CellField("player_positions", [0], 4), CellField("level")),
        outcome_rule=OutcomeRule("reward_sign", 0.5),
        utilities=(UtilityConfig("win_proximity"), UtilityConfig("l", 0.5, ["LOSS"], [])),
        repository_capacity_bytes=1 << 20,
        selection_power=1,
    )
    assert config.cell_fields[0].index == (0,)
    assert config.key_names == ("player_positions[0]", "level")
    again = TrajectoryTrainingConfiguration.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and hash(again) == hash(config)
    default = TrajectoryTrainingConfiguration(cell_fields=(CellField("x"),))
    assert default.repository_capacity_bytes == 256 * 1024 * 1024
    assert default.selection_power == 0.5 and default.outcome_rule.kind == "none"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CellField(""), "CellField.state_field.*''"),
        (lambda: CellField("x", (-1,)), "CellField.index.*-1"),
        (lambda: CellField("x", bucket=0), "CellField.bucket.*0"),
        (lambda: UtilityConfig("u", gamma=1.5), "UtilityConfig.gamma.*1.5"),
        (lambda: UtilityConfig("u", positive_outcomes=("WON",)), "positive_outcomes.*'WON'"),
        (lambda: UtilityConfig("u", 0.9, ("WIN",), ("WIN",)), "both positive and negative"),
        (lambda: OutcomeRule("sign"), "OutcomeRule.kind.*'sign'"),
        (lambda: OutcomeRule("reward_sign", -1.0), "OutcomeRule.threshold.*-1.0"),
        (lambda: TrajectoryTrainingConfiguration(cell_fields=()), "cell_fields"),
        (
            lambda: TrajectoryTrainingConfiguration(cell_fields=(CellField("x"), CellField("x"))),
            r"duplicate key names \['x'\]",
        ),
        (
            lambda: TrajectoryTrainingConfiguration(
                cell_fields=(CellField("x"),), repository_capacity_bytes=0
            ),
            "repository_capacity_bytes.*0",
        ),
        (
            lambda: TrajectoryTrainingConfiguration(
                cell_fields=(CellField("x"),), selection_power=float("nan")
            ),
            "selection_power.*nan",
        ),
        (
            lambda: TrajectoryTrainingConfiguration.from_dict({"cell_fields": [], "colour": 1}),
            r"unknown keys \['colour'\]",
        ),
        (lambda: TrajectorySliceReference(0, -2), "step.*-2"),
    ],
)
def test_validation_names_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_outcome_codes():
    assert [int(o) for o in EpisodeOutcome] == [0, 1, 2, 3, 4]
    assert [o.name for o in EpisodeOutcome] == ["UNKNOWN", "WIN", "LOSS", "DRAW", "INCOMPLETE"]
    assert EpisodeOutcome.from_step_codes([0, 0, 2]) is EpisodeOutcome.LOSS
    assert EpisodeOutcome.from_step_codes([0, 1, 0]) is EpisodeOutcome.WIN
    assert EpisodeOutcome.from_step_codes([]) is EpisodeOutcome.UNKNOWN
    assert EpisodeOutcome.coerce("draw") is EpisodeOutcome.DRAW
    with pytest.raises(ValueError, match="unknown code 5"):
        EpisodeOutcome.from_step_codes([5])


def test_outcome_rule():
    rule = OutcomeRule("reward_sign", threshold=1.0)
    assert rule.resolve(EpisodeOutcome.UNKNOWN, 1.5) is EpisodeOutcome.WIN
    assert rule.resolve(EpisodeOutcome.UNKNOWN, -1.5) is EpisodeOutcome.LOSS
    assert rule.resolve(EpisodeOutcome.UNKNOWN, 1.0) is EpisodeOutcome.DRAW
    assert rule.resolve(EpisodeOutcome.INCOMPLETE, 9.0) is EpisodeOutcome.INCOMPLETE
    assert OutcomeRule().resolve(EpisodeOutcome.UNKNOWN, 9.0) is EpisodeOutcome.UNKNOWN


def test_store_exports_and_no_grpc():
    """The store package's public names, pinned; importing it loads no gRPC or protobuf."""
    code = (
        "import sys, recorder_server.store as s; print(sorted(s.__all__)); "
        "print(sorted(m for m in sys.modules if m.startswith(('grpc', 'google.protobuf'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == str(
        [
            "BatchResult",
            "CHECKPOINT_FORMAT",
            "CellInfo",
            "EpisodeArrays",
            "EpisodeBatch",
            "EpisodeColumns",
            "EpisodeList",
            "EpisodeRecord",
            "EpisodeSource",
            "EpisodeWindow",
            "TrajectoryCaptureProcessor",
            "TrajectoryStore",
            "build_store",
            "decode_checkpoint_state",
            "encode_checkpoint_state",
            "find_state",
        ]
    )
    assert out[1] == "[]"


def test_find_state_takes_either_spelling():
    from recorder_server.store import find_state

    positions = np.zeros((3, 2), np.int32)
    assert find_state({"positions": positions}, "player_positions") is positions
    assert find_state({"player_positions": positions}, "positions") is positions
    assert find_state({"positions": positions, "player_positions": 1}, "positions") is positions
    assert find_state({"pos": positions}, "player_positions") is None
    assert find_state({}, "pos") is None
