"""The sink writes a file a row group at a time (gathered on its thread, encoded on another):
files of many row groups, some holding several workers' episodes, read back equal to
finish(); an encode that fails mid-file leaves no partial file and is written again whole."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
from test_dataset import (
    assert_identical,
    episodes_of,
    record,
    sent_episodes,
    sink_options,
    wait_written,
)

from recorder_client import RolloutRecorder
from recorder_client.dataset import episode_files, filesystem, read_episodes
from recorder_server import start_server
from recorder_server.dataset import layout

WORKERS, CHUNKS = 3, 12


def record_all(server, session: str):
    recs = [
        RolloutRecorder(
            record_states=True, target=server.address, session=session, worker_id=f"w{w}"
        )
        for w in range(WORKERS)
    ]
    for w, rec in enumerate(recs):
        record(rec, w, range(CHUNKS))
    expected = recs[0].finish(pad_incomplete=False)
    for rec in recs:
        rec.close()
    return expected


def test_files_of_many_row_groups_read_back_exact(tmp_path: Path, monkeypatch):
    # Row groups of a few episodes: a file holds many, and a worker's last episodes share
    # one with the next worker's first.
    monkeypatch.setattr(layout, "ROW_GROUP_BYTES", 3 << 10)
    uri = str(tmp_path / "dataset")
    server = start_server(sink_options(tmp_path, uri, flush=30.0))
    try:
        expected = record_all(server, "rg")
    finally:
        server.stop(grace=5)  # a stop writes every finished episode
    got = read_episodes(uri, "rg")
    assert_identical(expected, got)
    sent = sum((sent_episodes(w, CHUNKS) for w in range(WORKERS)), Counter())
    assert episodes_of(got) == sent
    fs, root = filesystem(uri)
    groups = mixed = 0
    for path in episode_files(fs, root):
        meta = pq.ParquetFile(path).metadata
        groups += meta.num_row_groups
        for g in range(meta.num_row_groups):
            workers = pq.ParquetFile(path).read_row_group(g, columns=["worker"]).column(0)
            mixed += len(set(workers.to_pylist())) > 1
    assert groups > 10 and mixed >= 1
    # Every row group holds whole episodes: each episode id appears in one only.
    for path in episode_files(fs, root):
        f = pq.ParquetFile(path)
        seen: set[str] = set()
        for g in range(f.metadata.num_row_groups):
            ids = set(f.read_row_group(g, columns=["episode_id"]).column(0).to_pylist())
            assert not ids & seen
            seen |= ids


def test_an_encode_failing_mid_file_leaves_nothing_partial(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(layout, "ROW_GROUP_BYTES", 3 << 10)
    real_write = layout.EpisodeFile.write
    calls = []

    def fail_the_third(self, table):
        calls.append(table.num_rows)
        if len(calls) == 3:
            raise OSError("disk full while encoding")
        real_write(self, table)

    monkeypatch.setattr(layout.EpisodeFile, "write", fail_the_third)
    uri = str(tmp_path / "dataset")
    server = start_server(sink_options(tmp_path, uri, flush=0.2))
    try:
        expected = record_all(server, "fail")
        wait_written(uri, "fail", expected.num_episodes)
        failures = server.metrics.snapshot().get("Recorder/dataset_write_failures/session=fail")
    finally:
        server.stop(grace=5)
    assert failures == 1 and len(calls) > 3
    assert_identical(expected, read_episodes(uri, "fail"))
    left = [n for _, _, names in os.walk(uri) for n in names if n.endswith(".partial")]
    assert left == []
