"""The client's public surface and its import footprint."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

import recorder_client

EXPECTED = {
    "ArchiveColumns",
    "AuthenticationError",
    "CellField",
    "CheckpointFile",
    "Episode",
    "EpisodeOutcome",
    "OutcomeRule",
    "RemoteCapture",
    "TrajectoryKey",
    "TrajectorySliceReference",
    "TrajectoryTrainingConfiguration",
    "UtilityConfig",
    "InvalidChunkError",
    "NoDataError",
    "RecorderError",
    "RecorderUnavailableError",
    "ResourceExhaustedError",
    "RolloutRecorder",
    "SessionMismatchError",
    "SessionStatus",
    "StreamStats",
    "Trajectory",
    "WorkerStatus",
    "__version__",
    "DataLossError",
    "InvalidNameError",
    "InvalidQueryError",
    "StoreNotConfiguredError",
    "UnknownSessionError",
    "SessionDroppedError",
    "WorkerIdInUseError",
    "drop_session",
    "fetch_episodes",
    "list_sessions",
    "open_dataset",
    "read_episodes",
    "unflatten",
}


def test_exported_names_are_pinned():
    assert set(recorder_client.__all__) == EXPECTED
    for name in recorder_client.__all__:
        assert hasattr(recorder_client, name)


def test_errors_are_the_python_exceptions_users_catch():
    assert issubclass(recorder_client.NoDataError, ValueError)
    assert issubclass(recorder_client.InvalidNameError, ValueError)
    assert not issubclass(recorder_client.InvalidNameError, recorder_client.InvalidChunkError)
    assert issubclass(recorder_client.UnknownSessionError, LookupError)
    assert issubclass(recorder_client.DataLossError, recorder_client.RecorderError)
    assert issubclass(recorder_client.InvalidChunkError, ValueError)
    assert issubclass(recorder_client.SessionMismatchError, ValueError)
    assert issubclass(recorder_client.RecorderUnavailableError, ConnectionError)
    assert issubclass(recorder_client.InvalidQueryError, ValueError)
    assert not issubclass(recorder_client.InvalidQueryError, recorder_client.InvalidChunkError)
    assert issubclass(recorder_client.StoreNotConfiguredError, recorder_client.RecorderError)


def test_an_unknown_data_loss_policy_is_refused_before_connecting():
    expected = "on_data_loss: expected 'raise' or 'continue', got 'ignore'"
    with pytest.raises(ValueError, match=expected):
        recorder_client.RolloutRecorder(target="127.0.0.1:1", session="s", on_data_loss="ignore")
    with pytest.raises(ValueError, match=expected):
        recorder_client.fetch_episodes("127.0.0.1:1", "s", on_data_loss="ignore")


_MODULES = "import sys, json; {imports}; print(json.dumps(sorted(sys.modules)))"


def _loaded(imports: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _MODULES.format(imports=imports)],
        check=True,
        capture_output=True,
        text=True,
    )
    return set(json.loads(out.stdout))


def test_import_loads_only_the_four_dependencies():
    """The client loads what grpcio, protobuf, numpy, zstandard load, and itself."""
    baseline = _loaded("import grpc, google.protobuf, numpy, zstandard")
    client = _loaded("import recorder_client; from recorder_client import *")
    assert not any(m.startswith("recorder_server") for m in client)
    dists = importlib.metadata.packages_distributions()
    allowed = {"grpcio", "protobuf", "numpy", "zstandard"}

    def ok(module: str) -> bool:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "recorder_client":
            return True
        return bool(allowed & set(dists.get(top, ())))

    stray = sorted(m for m in client - baseline if not ok(m))
    assert stray == [], f"recorder_client imports beyond its dependencies: {stray}"
