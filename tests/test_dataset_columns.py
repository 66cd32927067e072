"""Every column of every episode file is in the dataset's schema: a column that only a file in
the middle of a session holds (the final observations of the one worker that sends
``final_obs``, between files of a worker that does not) reads back, through open_dataset,
read_episodes and DuckDB over open_dataset.

Each step's action carries its identity, (worker << 40) | (env << 32) | step, and the truth
(each episode's rewards, flags and final observation) comes from the arrays sent.
"""

from __future__ import annotations

import random
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import wait_for
from test_dataset import sink_options

from recorder_client import RolloutRecorder
from recorder_client.dataset import (
    SESSION_FILE,
    columns_file,
    episode_files,
    file_schema,
    filesystem,
    open_dataset,
    read_episodes,
)
from recorder_server import start_server

T, N = 16, 3


def chunk(worker: int, index: int, finals: bool) -> dict[str, np.ndarray]:
    """Chunk ``index`` of worker ``worker``: obs (T, N, 2) float32, the flags, and with
    ``finals`` the final observations."""
    rng = np.random.default_rng([worker, index, 7])
    steps = np.arange(index * T, (index + 1) * T, dtype=np.int64)[:, None]
    envs = np.arange(N, dtype=np.int64)[None, :]
    ended = rng.random((T, N)) < 0.2
    truncated = ended & (rng.random((T, N)) < 0.4)
    arrays = {
        "action": (np.int64(worker) << 40) | (envs << 32) | steps,
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "terminated": ended & ~truncated,
        "truncated": truncated,
        "obs": rng.standard_normal((T, N, 2)).astype(np.float32),
    }
    if finals:
        arrays["final_obs"] = rng.standard_normal((T, N, 2)).astype(np.float32)
    return arrays


def sent(worker: int, indexes: range, finals: bool) -> dict[tuple, tuple]:
    """The finished episodes a worker sent, (worker, env, start) -> (rewards, terminated,
    truncated, final obs or None)."""
    parts = [chunk(worker, i, finals) for i in indexes]
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    first = indexes[0] * T
    out = {}
    for env in range(N):
        start = 0
        ends = joined["terminated"][:, env] | joined["truncated"][:, env]
        for t in np.flatnonzero(ends).tolist():
            final = joined["final_obs"][t, env].tolist() if finals else None
            out[(worker, env, first + start)] = (
                joined["reward"][start : t + 1, env].tolist(),
                bool(joined["terminated"][t, env]),
                bool(joined["truncated"][t, env]),
                final,
            )
            start = t + 1
    return out


def record(rec: RolloutRecorder, worker: int, indexes: range, finals: bool) -> None:
    """The chunks ``indexes`` as one record() call: the sink writes them as one file."""
    parts = [chunk(worker, i, finals) for i in indexes]
    rec.record({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    rec.flush()


def written_files(uri: str) -> list[str]:
    return episode_files(*filesystem(uri))


def served_middle_only_finals(tmp_path: Path, uri: str) -> dict[tuple, tuple]:
    """record_middle_only_finals into a server of its own with a sink to ``uri``."""
    server = start_server(sink_options(tmp_path, uri, flush=0.2))
    try:
        return record_middle_only_finals(uri, server.address)
    finally:
        server.stop(grace=0)


def record_middle_only_finals(uri: str, address: str) -> dict[tuple, tuple]:
    """Worker 0 records obs only, worker 1 obs and final_obs: worker 0's episodes land in the
    session's first and last files, worker 1's in the one between. Returns the truth."""
    kw = {"target": address, "session": "run"}
    plain = RolloutRecorder(worker_id="plain", **kw)
    finals = RolloutRecorder(worker_id="finals", **kw)
    try:
        # Chunks end mid-episode: an open episode waits, so it is written with the next batch.
        for rec, worker, indexes, with_finals in (
            (plain, 0, range(0, 4), False),
            (finals, 1, range(0, 4), True),
            (plain, 0, range(4, 8), False),
        ):
            before = len(written_files(uri))
            record(rec, worker, indexes, with_finals)
            assert wait_for(lambda b=before: len(written_files(uri)) == b + 1, 20, 0.05)
    finally:
        plain.close()
        finals.close()
    truth = {**sent(0, range(0, 8), False), **sent(1, range(0, 4), True)}
    files = written_files(uri)
    assert len(files) == 3
    # The middle file alone holds the final observations.
    fs, _ = filesystem(uri)
    assert ["final.obs" in file_schema(fs, f).names for f in files] == [False, True, False]
    return truth


def check_episodes(uri: str, truth: dict[tuple, tuple]) -> None:
    """read_episodes gives every episode with its rewards, flags and final observation."""
    traj = read_episodes(uri, "run")
    assert "obs" in traj.final_states
    got = {}
    for b, n in enumerate(traj.lengths.tolist()):
        ident = int(traj.actions[b, 0])
        key = (ident >> 40, (ident >> 32) & 0xFF, ident & 0xFFFFFFFF)
        final = traj.final_states["obs"][b].tolist()
        got[key] = (
            traj.rewards[b, :n].tolist(),
            bool(traj.episode_terminated[b]),
            bool(traj.episode_truncated[b]),
            final,
        )
    # Worker 0 sent no final observation: its episodes read zeros there.
    expected = {k: (*v[:3], v[3] if v[3] is not None else [0.0, 0.0]) for k, v in truth.items()}
    assert got == expected


def test_final_columns_of_a_middle_file_read_back(tmp_path: Path):
    """open_dataset's schema has final.obs, read_episodes returns every final observation
    sent, DuckDB over open_dataset counts them; the sink lists every column with its Arrow
    type in the node's columns file."""
    uri = str(tmp_path / "dataset")
    truth = served_middle_only_finals(tmp_path, uri)
    dataset = open_dataset(uri)
    assert "final.obs" in dataset.schema.names
    check_episodes(uri, truth)
    with_final = sum(v[3] is not None for v in truth.values())
    assert with_final > 0 and len(truth) > with_final
    counted = duckdb.sql(
        'SELECT count("final.obs"), count(DISTINCT episode_id) FROM dataset'
    ).fetchall()
    assert counted == [(with_final, len(truth))]
    # The sink's record of the columns: every file's, final.obs included, typed.
    footers = [pq.read_schema(f) for f in written_files(uri)]
    listed = columns_file(*filesystem(uri), "run", "n1")
    assert listed is not None
    every = {f.name: f.type for s in footers for f in s}
    assert {f.name: f.type for f in listed} == every
    print(f"{len(truth)} episodes ({with_final} with a final observation) read back exact")


@pytest.mark.parametrize("damage", ["removed", "cut short"])
def test_files_without_a_columns_file_read_every_footer(tmp_path: Path, damage: str):
    """Files written before the sink recorded its columns (the columns file removed here),
    or with a columns file that does not read, read back whole: the reader reads every
    file's schema then."""
    uri = str(tmp_path / "dataset")
    truth = served_middle_only_finals(tmp_path, uri)
    listed = Path(uri) / "session=run"
    (columns,) = [p for p in listed.iterdir() if p.name.startswith("_columns")]
    if damage == "removed":
        columns.unlink()
    else:
        columns.write_bytes(columns.read_bytes()[:200])
    assert (listed / SESSION_FILE).exists()
    assert "final.obs" in open_dataset(uri).schema.names
    check_episodes(uri, truth)


def test_a_sink_started_on_older_files_records_their_columns_too(tmp_path: Path):
    """A server that finds its node's files without a columns file (written by an older
    server) records their columns as well as its own before its first write."""
    uri = str(tmp_path / "dataset")
    options = sink_options(tmp_path, uri, flush=0.2)
    server = start_server(options)
    try:
        truth = record_middle_only_finals(uri, server.address)
    finally:
        server.stop(grace=0)
    directory = Path(uri) / "session=run"
    (columns,) = [p for p in directory.iterdir() if p.name.startswith("_columns")]
    columns.unlink()
    server = start_server(options)
    try:
        rec = RolloutRecorder(target=server.address, session="run", worker_id="plain")
        record(rec, 0, range(8, 12), False)
        rec.close()
        assert wait_for(lambda: len(written_files(uri)) == 4, 20, 0.05)
    finally:
        server.stop(grace=0)
    assert columns.exists()
    listed = columns_file(*filesystem(uri), "run", "n1")
    assert "final.obs" in listed.names
    assert "final.obs" in open_dataset(uri).schema.names
    check_episodes(uri, {**truth, **sent(0, range(0, 12), False)})


def test_a_column_one_node_of_three_writes_reads_back(tmp_path: Path):
    """Three sidecars write one session: only the node between the others by name records
    final_obs. Each node lists its own columns (no sidecar overwrites another's), and the
    reader unifies them."""
    uri = str(tmp_path / "dataset")
    truth = {}
    for worker, node in enumerate(("a", "m", "z")):
        server = start_server(sink_options(tmp_path / node, uri, node=node, flush=0.2))
        try:
            rec = RolloutRecorder(target=server.address, session="run", worker_id=node)
            record(rec, worker, range(0, 4), node == "m")
            rec.close()
            assert wait_for(lambda w=worker: len(written_files(uri)) == w + 1, 20, 0.05)
        finally:
            server.stop(grace=0)
        truth.update(sent(worker, range(0, 4), node == "m"))
    fs, root = filesystem(uri)
    listed = {node: columns_file(fs, root, "run", node).names for node in ("a", "m", "z")}
    assert ["final.obs" in names for names in listed.values()] == [False, True, False]
    assert "final.obs" in open_dataset(uri).schema.names
    check_episodes(uri, truth)


def test_final_columns_of_a_middle_file_read_back_from_s3(tmp_path: Path, s3):
    uri = f"{s3.make_bucket(f'columns-{random.getrandbits(32):08x}')}/episodes"
    truth = served_middle_only_finals(tmp_path, uri)
    assert "final.obs" in open_dataset(uri).schema.names
    check_episodes(uri, truth)
    assert columns_file(*filesystem(uri), "run", "n1") is not None


pytestmark = pytest.mark.timeout(120)


def test_a_column_two_sessions_type_differently_is_named(tmp_path: Path):
    """Two sessions record obs as float32 and as int32: open_dataset over both names the
    column and both types; each session's files alone open, with its own type."""
    uri = str(tmp_path / "dataset")
    server = start_server(sink_options(tmp_path, uri, flush=0.2))
    try:
        for session, dtype in (("floats", np.float32), ("ints", np.int32)):
            with RolloutRecorder(target=server.address, session=session) as rec:
                done = np.zeros((T, N), dtype=bool)
                done[-1] = True
                rec.record(
                    {
                        "action": np.zeros((T, N), np.int64),
                        "reward": np.ones((T, N), np.float32),
                        "done": done,
                        "obs": np.arange(T * N * 2).reshape(T, N, 2).astype(dtype),
                    }
                )
                rec.flush()
            assert wait_for(lambda s=session: any(f"={s}/" in f for f in written_files(uri)), 20)
    finally:
        server.stop(grace=0)
    with pytest.raises(
        ValueError, match=r"column 'obs': expected one type in every episode file, got .* and "
    ) as info:
        open_dataset(uri)
    assert "float" in str(info.value) and "int32" in str(info.value)
    for session, kind in (("floats", "float"), ("ints", "int32")):
        dataset = open_dataset(uri, session=session)
        assert kind in str(dataset.schema.field("obs").type)
