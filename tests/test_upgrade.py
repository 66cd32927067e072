"""Data directories written by the previous format versions: read as they are, and converted
in place by `rollout-recorder upgrade`. The fixture (tests/fixtures/datadir-v1) was written by
the code before the current versions (tests/fixtures/make_datadir.py); its chunks.npz holds
the chunks it recorded, the truth here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import RestartableServer
from reference_model import ReferenceRecorder

from recorder_client import RolloutRecorder
from recorder_server.durability import snapshot
from recorder_server.durability.upgrade import inspect

FIXTURE = Path(__file__).parent / "fixtures" / "datadir-v1"
STATES = ["player_positions"]


def truth() -> dict:
    chunks = np.load(FIXTURE / "chunks.npz")
    ref = ReferenceRecorder(record_states=True, state_fields=STATES)
    for i in range(chunks["action"].shape[0]):
        ref.record(
            {k: chunks[k][i] for k in ("action", "reward", "done")},
            {"player_positions": chunks["player_positions"][i]},
        )
    return ref.finish()


def finish_matches_truth(address: str) -> None:
    with RolloutRecorder(
        target=address,
        session="fixture",
        worker_id="w0",
        record_states=True,
        state_fields=STATES,
        connect_timeout=30,
    ) as rec:
        assert rec.status().chunks_stored == 6
        out = rec.finish()
    exp = truth()
    assert out.num_episodes == exp["actions"].shape[0]
    assert out.actions.tobytes() == exp["actions"].tobytes()
    assert out.rewards.tobytes() == exp["rewards"].tobytes()
    assert out.fields["positions"].tobytes() == exp["positions"].tobytes()
    assert out.lengths.tolist() == exp["lengths"].tolist()


@pytest.fixture
def old_dir(tmp_path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", data)
    before = inspect(data)
    # The fixture is of the previous session state format, and nothing else is newer.
    assert set(before.states.values()) == {"recorder.session_state.v2"} != {snapshot.FORMAT}
    assert set(before.payloads.values()) == {"recorder.checkpoint.v1"}
    assert not before.current and not before.unreadable
    return data


def upgrade(data: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recorder_server", "upgrade", "--data-dir", str(data), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def serves_the_truth(data_dir: Path, replayed: int) -> None:
    """A server started on ``data_dir`` replays ``replayed`` log records and finishes the
    session as the truth has it."""
    server = RestartableServer(data_dir, "--checkpoint-every", "0").start()
    try:
        finish_matches_truth(server.address)
        assert f"replayed {replayed} log records" in server.log()
    finally:
        server.stop()


def test_the_server_reads_a_data_dir_of_the_previous_format_as_it_is(old_dir):
    serves_the_truth(old_dir, replayed=4)


def test_upgrade_converts_in_place_after_a_backup(old_dir):
    original = {p.relative_to(old_dir): p.read_bytes() for p in old_dir.rglob("*.*") if p.is_file()}
    original.pop(Path("wal/wal.lock"), None)
    assert upgrade(old_dir, "--check").returncode == 1
    done = upgrade(old_dir)
    assert done.returncode == 0, done.stderr
    assert "before: session states: recorder.session_state.v2 (1)" in done.stdout
    after = inspect(old_dir)
    assert after.current and set(after.states.values()) == {snapshot.FORMAT}
    assert set(after.payloads.values()) == {snapshot.CHECKPOINT_FORMAT}
    # The files as they were, byte for byte, in the backup.
    (backup,) = old_dir.glob("backup-*")
    for relative, data in original.items():
        assert (backup / relative).read_bytes() == data, relative
    assert upgrade(old_dir, "--check").returncode == 0
    again = upgrade(old_dir)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert len(list(old_dir.glob("backup-*"))) == 1
    serves_the_truth(old_dir, replayed=0)


def test_upgrade_refuses_while_a_server_runs_and_changes_nothing(old_dir):
    server = RestartableServer(old_dir, "--checkpoint-every", "0").start()
    try:
        before = sorted(p.name for p in old_dir.rglob("*"))
        refused = upgrade(old_dir)
        assert refused.returncode == 1
        assert "a server is running on it" in refused.stderr and "stop it first" in refused.stderr
        assert sorted(p.name for p in old_dir.rglob("*")) == before
    finally:
        server.stop()


def test_upgrade_of_something_that_is_not_a_data_dir_says_so(tmp_path):
    refused = upgrade(tmp_path / "nowhere")
    assert refused.returncode == 1
    assert "--data-dir: expected a data directory" in refused.stderr
