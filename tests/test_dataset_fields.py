"""Every recorded field reads back, whichever files or nodes hold it: sidecars of one session
(or one node's generations across a restart) that record different state fields give one
Trajectory with the union of their fields, zeros where an episode's file lacks one; a field
recorded with two dtypes or trailing shapes is an error naming it, both specs and two files.

Each step's action carries its identity, (worker << 40) | (env << 32) | step, and the truth
(every field of every episode) comes from the arrays sent.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for
from test_dataset import sink_options

from recorder_client import RolloutRecorder, dataset
from recorder_client.dataset import episode_files, filesystem, read_episodes
from recorder_server import start_server

T, N = 16, 3
OBS = (np.float32, (2,))
POSITIONS = (np.int32, (1, 2))


def chunk(worker: int, index: int, states: dict) -> tuple[dict, dict]:
    """Chunk ``index`` of ``worker``: action, reward, flags, ``obs`` as ``states["obs"]``
    gives it, and the env states ``states`` names besides (``player_positions``)."""
    rng = np.random.default_rng([worker, index, 11])
    steps = np.arange(index * T, (index + 1) * T, dtype=np.int64)[:, None]
    envs = np.arange(N, dtype=np.int64)[None, :]
    ended = rng.random((T, N)) < 0.2
    truncated = ended & (rng.random((T, N)) < 0.4)

    def values(dtype, shape):
        return rng.integers(-100, 100, (T, N, *shape)).astype(dtype)

    arrays = {
        "action": (np.int64(worker) << 40) | (envs << 32) | steps,
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "terminated": ended & ~truncated,
        "truncated": truncated,
        "obs": values(*states["obs"]),
    }
    env_states = {k: values(*spec) for k, spec in states.items() if k != "obs"}
    return arrays, env_states


def sent(worker: int, states: dict, chunks: int) -> dict[tuple, dict]:
    """The finished episodes a worker sent: (worker, env, start) -> trajectory name ->
    (length, *shape) values (rewards included)."""
    parts = [chunk(worker, i, states) for i in range(chunks)]
    joined = {k: np.concatenate([a[k] for a, _ in parts]) for k in parts[0][0]}
    for k in parts[0][1]:
        joined[k] = np.concatenate([s[k] for _, s in parts])
    names = {"obs": "obs", "player_positions": "positions", "reward": "rewards"}
    out = {}
    for env in range(N):
        start = 0
        ends = joined["terminated"][:, env] | joined["truncated"][:, env]
        for t in np.flatnonzero(ends).tolist():
            out[(worker, env, start)] = {
                name: joined[key][start : t + 1, env]
                for key, name in names.items()
                if key in joined
            }
            start = t + 1
    return out


def record_runs(
    tmp_path: Path, uri: str, runs: list[tuple[str, dict]], chunks: int = 4, first_worker: int = 0
) -> dict:
    """One server after another, each with its own data directory, writing session "run"
    of ``uri`` as its node; worker ``first_worker + k`` records the fields ``runs[k]`` names. Returns
    the truth of every finished episode."""
    truth = {}
    fs, root = filesystem(uri)
    for worker, (node, states) in enumerate(runs, first_worker):
        server = start_server(sink_options(tmp_path / f"run{worker}", uri, node=node, flush=0.2))
        try:
            others = tuple(k for k in states if k != "obs")
            rec = RolloutRecorder(
                target=server.address,
                session="run",
                worker_id=f"w{worker}",
                record_states=bool(others),
                state_fields=others or ("player_positions",),
            )
            parts = [chunk(worker, i, states) for i in range(chunks)]
            arrays = {k: np.concatenate([a[k] for a, _ in parts]) for k in parts[0][0]}
            env_states = {k: np.concatenate([s[k] for _, s in parts]) for k in parts[0][1]}
            rec.record(arrays, env_states or None)
            rec.flush()
            rec.close()
            assert wait_for(lambda w=worker: len(episode_files(fs, root)) == w + 1, 20, 0.05)
        finally:
            server.stop(grace=0)
        truth.update(sent(worker, states, chunks))
    return truth


def compare(traj, truth: dict, specs: dict[str, tuple]) -> dict[str, int]:
    """Per field: the episodes whose values read back different from the truth (zeros where
    an episode's worker did not record the field). Asserts every episode is there once."""
    keys = []
    wrong = dict.fromkeys(specs, 0)
    for b, n in enumerate(traj.lengths.tolist()):
        ident = int(traj.actions[b, 0])
        key = (ident >> 40, (ident >> 32) & 0xFF, ident & 0xFFFFFFFF)
        keys.append(key)
        for name, (dtype, shape) in specs.items():
            expected = truth[key].get(name)
            if expected is None:
                expected = np.zeros((n, *shape), dtype=dtype)
            if name == "rewards":
                got = traj.rewards
            elif name in traj.states:
                got = traj.states[name]
            else:
                wrong[name] += 1
                continue
            same = got.dtype == np.dtype(dtype) and got.shape[2:] == shape
            if not (same and np.array_equal(got[b, :n], expected)):
                wrong[name] += 1
    assert sorted(keys) == sorted(truth)
    return wrong


EVERY = {"rewards": (np.float32, ()), "obs": OBS, "positions": POSITIONS}
RUNS = {
    # Node "a" records positions, node "b" (the newest file by name) does not.
    "first node records more": [
        ("a", {"obs": OBS, "player_positions": POSITIONS}),
        ("b", {"obs": OBS}),
    ],
    "last node records more": [
        ("a", {"obs": OBS}),
        ("b", {"obs": OBS, "player_positions": POSITIONS}),
    ],
    # One node, restarted on a fresh data directory: its next generation lacks positions.
    "a node's later generation records less": [
        ("n1", {"obs": OBS, "player_positions": POSITIONS}),
        ("n1", {"obs": OBS}),
    ],
}


def older_columns_files(uri: str, how: str) -> None:
    """Make the columns files those of an older version: none at all ("footers"), or
    listing columns but no fields ("no fields")."""
    for path in (Path(uri) / "session=run").glob("_columns-*.json"):
        if how == "footers":
            path.unlink()
        elif how == "no fields":
            document = json.loads(path.read_text())
            del document["fields"]
            path.write_text(json.dumps(document))


@pytest.mark.parametrize("columns_files", ["columns files", "no fields", "footers"])
@pytest.mark.parametrize("runs", list(RUNS), ids=list(RUNS))
def test_every_field_of_every_file_reads_back(
    tmp_path: Path, runs: str, columns_files: str, monkeypatch
):
    """Every field every worker recorded reads back exact for every episode, zeros for the
    episodes of a worker that did not record it; from the columns files (no file's fields
    read from its footer), and from every file's footer when they list no fields or are
    gone (a dataset of an older version)."""
    uri = str(tmp_path / "dataset")
    truth = record_runs(tmp_path, uri, RUNS[runs])
    older_columns_files(uri, columns_files)
    recorded = sum("positions" in v for v in truth.values())
    assert 0 < recorded < len(truth)
    described = []
    real = dataset.file_description
    monkeypatch.setattr(
        dataset, "file_description", lambda fs, p: described.append(p) or real(fs, p)
    )
    traj = read_episodes(uri, "run")
    footers = 0 if columns_files == "columns files" else len(RUNS[runs])
    assert len(described) == footers
    wrong = compare(traj, truth, EVERY)
    assert wrong == dict.fromkeys(EVERY, 0), f"{len(truth)} episodes, wrong per field: {wrong}"
    assert traj.states["positions"].dtype == np.int32
    print(f"{runs}, {columns_files}: {len(truth)} episodes ({recorded} with positions) exact")


def test_columns_files_list_the_fields_of_their_node(tmp_path: Path):
    """Each node's columns file lists its files' fields (dtype, trailing shape), so that the
    reader need not read every footer."""
    uri = str(tmp_path / "dataset")
    record_runs(tmp_path, uri, RUNS["last node records more"])
    directory = Path(uri) / "session=run"
    listed = {
        node: {
            f["name"]: (f["dtype"], f["shape"])
            for f in json.loads((directory / f"_columns-{node}.json").read_text())["fields"]
        }
        for node in ("a", "b")
    }
    assert listed["a"] == {"actions": ("<i8", []), "rewards": ("<f4", []), "obs": ("<f4", [2])}
    assert listed["b"] == {**listed["a"], "positions": ("<i4", [1, 2])}


@pytest.mark.parametrize(
    "other, described",
    [((np.float32, (1, 2)), "<f4(1, 2)"), ((np.float64, (2,)), "<f8(2,)")],
    ids=["shape", "dtype"],
)
@pytest.mark.parametrize("columns_files", ["columns files", "footers"])
def test_a_field_recorded_two_ways_is_an_error_naming_it(
    tmp_path: Path, other: tuple, described: str, columns_files: str
):
    """Two nodes record obs with different trailing shapes or dtypes: read_episodes names
    the field, both specs and a file of each, instead of picking one."""
    uri = str(tmp_path / "dataset")
    record_runs(tmp_path, uri, [("a", {"obs": OBS}), ("b", {"obs": other})])
    older_columns_files(uri, columns_files)
    with pytest.raises(ValueError) as raised:
        read_episodes(uri, "run")
    message = str(raised.value)
    assert "'obs'" in message and "<f4(2,)" in message and described in message, message
    assert "part-a-g000000-" in message and "part-b-g000000-" in message, message
    # Each node alone reads back with its own spec.
    assert read_episodes(uri, "run", nodes=["a"]).states["obs"].shape[2:] == OBS[1]
    assert read_episodes(uri, "run", nodes=["b"]).states["obs"].shape[2:] == other[1]


def test_a_sink_finding_a_columns_file_without_fields_lists_its_files_fields(tmp_path: Path):
    """A restarted node whose columns file lists no fields (an older version's) starts the
    list from its files' footers: the older generation's positions stay listed."""
    uri = str(tmp_path / "dataset")
    first, second = RUNS["a node's later generation records less"]
    truth = record_runs(tmp_path, uri, [first])
    older_columns_files(uri, "no fields")
    truth.update(record_runs(tmp_path, uri, [second], first_worker=1))
    document = json.loads((Path(uri) / "session=run" / "_columns-n1.json").read_text())
    listed = {f["name"]: f["file"] for f in document["fields"]}
    assert listed["positions"].startswith("part-n1-g000000-")
    assert compare(read_episodes(uri, "run"), truth, EVERY) == dict.fromkeys(EVERY, 0)
