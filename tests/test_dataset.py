"""The dataset sink: finished episodes land as Parquet on local disk or S3 while workers record,
read back equal to finish(), once each, through crashes, on one sidecar or several.

Every step's action carries its identity, (worker << 40) | (env << 32) | step on the worker's
time axis, so that each episode can be told apart across sidecars and checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pytest
from conftest import RestartableServer, ServerProcess, wait_for

from recorder_client import RolloutRecorder
from recorder_client.dataset import episode_files, filesystem, open_dataset, read_episodes
from recorder_client.errors import RecorderError
from recorder_server import ServerOptions, start_server
from recorder_server.dataset import layout
from recorder_server.dataset.sink import DatasetOptions, storage_options

T, N = 16, 3
STATES = ("player_positions", "player_inventory")


def chunk(worker: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Chunk `index` of worker `worker` (the same arrays every time), and its states."""
    rng = np.random.default_rng([worker, index])
    steps = np.arange(index * T, (index + 1) * T, dtype=np.int64)[:, None]
    envs = np.arange(N, dtype=np.int64)[None, :]
    done = rng.random((T, N)) < 0.15
    arrays = {
        "action": (np.int64(worker) << 40) | (envs << 32) | steps,
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "done": done,
        "outcome": np.where(done, rng.integers(0, 3, (T, N)), 0).astype(np.int8),
    }
    states = {
        "player_positions": rng.integers(0, 64, (T, N, 1, 2)).astype(np.int32),
        "player_inventory": rng.integers(0, 9, (T, N, 1, 4)).astype(np.int16),
    }
    return arrays, states


def record(rec: RolloutRecorder, worker: int, indexes: range) -> None:
    for i in indexes:
        arrays, states = chunk(worker, i)
        outcome = arrays.pop("outcome")
        rec.record(arrays, states, outcome=outcome)
    rec.flush()


def sent_episodes(worker: int, chunks: int) -> Counter:
    """The finished episodes worker `worker` sent in chunks 0..chunks-1, as (worker, env,
    start, length, reward bytes)."""
    parts = [chunk(worker, i)[0] for i in range(chunks)]
    done = np.concatenate([p["done"] for p in parts])
    reward = np.concatenate([p["reward"] for p in parts])
    out: Counter = Counter()
    for env in range(N):
        start = 0
        for t in np.flatnonzero(done[:, env]).tolist():
            out[(worker, env, start, t + 1 - start, reward[start : t + 1, env].tobytes())] += 1
            start = t + 1
    return out


def episodes_of(traj) -> Counter:
    """The same identities, read from the actions a Trajectory holds."""
    out: Counter = Counter()
    for b, n in enumerate(traj.lengths.tolist()):
        ident = traj.actions[b, :n]
        worker, env, step = int(ident[0] >> 40), int((ident[0] >> 32) & 0xFF), ident & 0xFFFFFFFF
        assert (step == np.arange(step[0], step[0] + n)).all()
        out[(worker, env, int(step[0]), n, traj.rewards[b, :n].tobytes())] += 1
    return out


def assert_identical(a, b) -> None:
    """Bit-identical Trajectories: every field, every per-episode array, the worker ids."""
    assert a.fields.keys() == b.fields.keys()
    for name in a.fields:
        x, y = a.fields[name], b.fields[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.tobytes() == y.tobytes(), name
    for name in ("lengths", "episode_worker", "episode_env", "episode_start", "episode_done"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.worker_ids == b.worker_ids


def count_episodes(uri: str, session: str) -> int:
    try:
        return read_episodes(uri, session).num_episodes
    except (FileNotFoundError, KeyError):
        return 0


def wait_written(uri: str, session: str, expected: int, timeout: float = 30.0) -> None:
    assert wait_for(lambda: count_episodes(uri, session) >= expected, timeout, 0.2), (
        f"dataset holds {count_episodes(uri, session)} of {expected} episodes"
    )


def sink_options(tmp_path: Path, uri: str, *, node: str = "n1", flush: float, **extra):
    """An in-process server on a free port, its dataset sink writing to ``uri``."""
    return ServerOptions(
        listen="127.0.0.1:0",
        data_dir=str(tmp_path / "data"),
        dataset=DatasetOptions(uri=uri, node_id=node, flush_seconds=flush),
        **extra,
    )


@pytest.fixture(params=["local", "s3"])
def dataset_uri(request, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "dataset")
    s3 = request.getfixturevalue("s3")
    return f"{s3.make_bucket(f'runs-{random.getrandbits(32):08x}')}/recorder"


def test_four_workers_record_while_the_dataset_is_written(tmp_path: Path, dataset_uri: str):
    options = sink_options(tmp_path, dataset_uri, flush=0.3)
    server = start_server(options)
    try:
        recs = [
            RolloutRecorder(
                record_states=True, target=server.address, session="run", worker_id=f"w{w}"
            )
            for w in range(4)
        ]
        threads = [
            threading.Thread(target=record, args=(rec, w, range(40))) for w, rec in enumerate(recs)
        ]
        for t in threads:
            t.start()
        # Files land while the workers are still recording.
        fs, root = filesystem(dataset_uri)
        assert wait_for(lambda: episode_files(fs, root), 20, 0.1)
        for t in threads:
            t.join()
        finished = recs[0].finish(pad_incomplete=False)
        wait_written(dataset_uri, "run", finished.num_episodes)
        got = read_episodes(dataset_uri, "run")
        assert_identical(finished, got)
        assert episodes_of(got) == sum((sent_episodes(w, 40) for w in range(4)), Counter())

        # DuckDB over the Parquet files: the same per-episode returns and lengths.
        dataset = open_dataset(dataset_uri)  # noqa: F841 - scanned by name below
        if dataset_uri.startswith("s3://"):
            source = "dataset"  # DuckDB scans the Arrow dataset (its S3 reader is an extension)
        else:
            source = f"read_parquet('{dataset_uri}/**/*.parquet', hive_partitioning = true)"
        rows = duckdb.sql(
            f"SELECT worker, env, start, count(*) AS length, sum(reward::DOUBLE) AS ret, "
            f"max(outcome) AS outcome FROM {source} WHERE session = 'run' "
            "GROUP BY episode_id, worker, env, start"
        ).fetchall()
        by_episode = {(str(w), e, s): (n, r, o) for w, e, s, n, r, o in rows}
        assert len(by_episode) == finished.num_episodes
        for b in range(finished.num_episodes):
            key = (
                finished.worker_ids[finished.episode_worker[b]],
                int(finished.episode_env[b]),
                int(finished.episode_start[b]),
            )
            n = int(finished.lengths[b])
            length, ret, _ = by_episode[key]
            assert length == n
            assert ret == pytest.approx(float(finished.rewards[b, :n].astype(np.float64).sum()))
        # The outcome column: the last non-zero code each episode was sent with.
        sent = {}
        for w in range(4):
            codes = np.concatenate([chunk(w, i)[0]["outcome"] for i in range(40)])
            done = np.concatenate([chunk(w, i)[0]["done"] for i in range(40)])
            for env in range(N):
                start = 0
                for t in np.flatnonzero(done[:, env]).tolist():
                    nz = codes[start : t + 1, env][codes[start : t + 1, env] != 0]
                    sent[(f"w{w}", env, start)] = int(nz[-1]) if nz.size else 0
                    start = t + 1
        assert {k: v[2] for k, v in by_episode.items()} == sent
        for rec in recs:
            rec.close()
    finally:
        server.stop(grace=0)


def test_workers_without_a_finished_episode_keep_their_place(tmp_path: Path):
    """finish() numbers every worker the session holds; so does read_episodes (each file
    carries the roster), also for a worker that has not finished an episode yet."""
    uri = str(tmp_path / "dataset")
    options = sink_options(tmp_path, uri, flush=0.2)
    server = start_server(options)
    try:
        kw = {"record_states": True, "target": server.address, "session": "s"}
        quiet = RolloutRecorder(worker_id="first-no-episodes", **kw)
        busy = RolloutRecorder(worker_id="second", **kw)
        arrays, states = chunk(0, 0)
        arrays["done"][:] = False
        quiet.record({k: arrays[k] for k in ("action", "reward", "done")}, states)
        quiet.flush()
        record(busy, 1, range(10))
        expected = busy.finish(pad_incomplete=False)
        assert list(expected.worker_ids) == ["first-no-episodes", "second"]
        assert set(expected.episode_worker.tolist()) == {1}
        wait_written(uri, "s", expected.num_episodes)
        assert_identical(expected, read_episodes(uri, "s"))
        only = read_episodes(uri, "s", workers=["second"])
        assert list(only.worker_ids) == ["second"] and set(only.episode_worker.tolist()) == {0}
        quiet.close()
        busy.close()
    finally:
        server.stop(grace=0)


def test_a_write_that_landed_without_its_commit_is_written_once(tmp_path: Path, monkeypatch):
    """A crash after a file is written but before its commit is logged: the restarted server
    (under another --node-id, even) writes the same file again under the same name, and no
    episode appears twice."""
    uri = str(tmp_path / "dataset")
    options = sink_options(tmp_path, uri, flush=0.2)
    real_put = layout.put_whole
    landed: list[str] = []

    def put_then_fail(fs, path, payload):
        real_put(fs, path, payload)
        if path.endswith(".parquet"):
            landed.append(path)
            raise OSError("connection reset after the upload")

    monkeypatch.setattr(layout, "put_whole", put_then_fail)
    server = start_server(options)
    rec = RolloutRecorder(record_states=True, target=server.address, session="s", worker_id="w")
    record(rec, 0, range(30))
    expected = rec.finish(pad_incomplete=False)
    assert wait_for(lambda: len(landed) >= 2, 20)  # written, failed, retried: still pending
    failures = server.metrics.snapshot().get("Recorder/dataset_write_failures/session=s", 0)
    rec.close(timeout=5)
    server.stop(grace=0, checkpoint=False)  # a crash: no last checkpoint, the log has it all
    assert failures >= 2
    assert len(set(landed)) == 1  # every retry rewrote the one logged file
    monkeypatch.setattr(layout, "put_whole", real_put)

    renamed = dataclasses.replace(options.dataset, node_id="n2")
    server = start_server(dataclasses.replace(options, dataset=renamed))
    try:
        wait_written(uri, "s", expected.num_episodes)
        fs, root = filesystem(uri)
        files = episode_files(fs, root)
        assert set(landed) <= set(files)  # the same name, written again
        assert all("part-n2-" in f for f in set(files) - set(landed))
        got = read_episodes(uri, "s")
        assert episodes_of(got) == episodes_of(expected)
    finally:
        server.stop(grace=0)


def test_reset_and_drop_write_every_finished_episode_first(tmp_path: Path):
    uri = str(tmp_path / "dataset")
    # An interval no test waits for: only reset and drop write.
    options = sink_options(tmp_path, uri, flush=3600)
    server = start_server(options)
    try:
        rec = RolloutRecorder(record_states=True, target=server.address, session="s", worker_id="w")
        record(rec, 0, range(10))
        first = rec.finish(pad_incomplete=False)
        rec.reset()
        assert_identical(first, read_episodes(uri, "s"))
        record(rec, 1, range(10))
        second = rec.finish(pad_incomplete=False)
        rec.close()
        from recorder_client import drop_session

        drop_session(server.address, "s")
        both = read_episodes(uri, "s")
        assert both.num_episodes == first.num_episodes + second.num_episodes
        assert episodes_of(both) == episodes_of(first) + episodes_of(second)
        ids = open_dataset(uri).to_table(columns=["episode_id"])["episode_id"].unique()
        generations = Counter(str(i).split("/")[2] for i in ids.to_pylist())
        assert generations == {"0": first.num_episodes, "1": second.num_episodes}
    finally:
        server.stop(grace=0)


def test_a_session_name_used_again_after_a_drop_keeps_the_first_ones_files(tmp_path: Path):
    uri = str(tmp_path / "dataset")
    options = sink_options(tmp_path, uri, flush=3600)
    from recorder_client import drop_session

    runs = []
    for run in range(2):  # the second on a restarted server: nothing in memory says "again"
        server = start_server(options)
        try:
            rec = RolloutRecorder(
                record_states=True, target=server.address, session="s", worker_id="w"
            )
            record(rec, run, range(8))
            runs.append(rec.finish(pad_incomplete=False))
            rec.close()
            drop_session(server.address, "s")
        finally:
            server.stop(grace=0)
    both = open_dataset(uri).to_table(columns=["episode_id", "generation"])
    assert both.num_rows == sum(int(r.lengths.sum()) for r in runs)
    episodes = Counter(str(i) for i in both["episode_id"].unique().to_pylist())
    assert len(episodes) == sum(r.num_episodes for r in runs)
    assert set(both["generation"].to_pylist()) == {0, 1}


def test_a_failing_dataset_refuses_drop_and_keeps_the_session(tmp_path: Path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the dataset directory should be")
    options = sink_options(tmp_path, str(blocker / "dataset"), flush=3600)
    server = start_server(options)
    try:
        rec = RolloutRecorder(target=server.address, session="s", worker_id="w")
        record(rec, 0, range(5))
        from recorder_client import drop_session, list_sessions

        with pytest.raises(RecorderError, match="dataset .*cannot write the finished episodes"):
            drop_session(server.address, "s")
        assert [s["name"] for s in list_sessions(server.address)] == ["s"]
        record(rec, 0, range(5, 8))  # the session still takes chunks
        assert rec.finish(pad_incomplete=False).num_episodes > 0
        rec.close()
    finally:
        server.stop(grace=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_between_ack_and_flush_loses_and_repeats_nothing(tmp_path: Path):
    uri = str(tmp_path / "dataset")
    base = ["--dataset-uri", uri, "--node-id", "n1", "--checkpoint-every", "1"]
    # First: episodes acknowledged, never flushed (an interval no test waits for), then kill -9.
    server = RestartableServer(tmp_path / "data", *base, "--dataset-flush-seconds", "3600")
    server.start()
    rec = RolloutRecorder(record_states=True, target=server.address, session="s", worker_id="w0")
    record(rec, 0, range(20))
    rec.close()
    server.kill()
    fs, root = filesystem(uri)
    assert episode_files(fs, root) == []
    # Then: kill -9 at random moments while files are being written, five times.
    server = RestartableServer(tmp_path / "data", *base, "--dataset-flush-seconds", "0.05")
    rng = random.Random(7)
    sent = 20
    for _ in range(5):
        server.start()
        rec = RolloutRecorder(
            record_states=True, target=server.address, session="s", worker_id="w0"
        )
        record(rec, 0, range(sent, sent + 10))
        sent += 10
        rec.close()
        time.sleep(rng.uniform(0.0, 0.3))
        server.kill()
    server.start()
    try:
        rec = RolloutRecorder(
            record_states=True, target=server.address, session="s", worker_id="w0"
        )
        expected = rec.finish(pad_incomplete=False)
        assert episodes_of(expected) == sent_episodes(0, sent)
        wait_written(uri, "s", expected.num_episodes)
        time.sleep(0.5)  # anything written twice would show now
        assert_identical(expected, read_episodes(uri, "s"))
        rec.close()
    finally:
        assert server.stop() == 0, server.log()


def test_serve_refuses_bad_dataset_flags(tmp_path: Path):
    for flags, message in [
        (["--node-id", "no/slash"], "--node-id: expected"),
        (["--dataset-flush-seconds", "0"], "--dataset-flush-seconds: expected seconds > 0"),
        (["--dataset-file-mib", "0"], "--dataset-file-mib: expected at least 1 KiB"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "recorder_server", "serve", "--listen", "127.0.0.1:0"]
            + ["--data-dir", str(tmp_path / "data"), "--dataset-uri", str(tmp_path / "d")]
            + flags,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr


def test_sigterm_writes_what_is_left(tmp_path: Path):
    uri = str(tmp_path / "dataset")
    server = ServerProcess(
        tmp_path / "data",
        "--dataset-uri",
        uri,
        "--node-id",
        "n1",
        "--dataset-flush-seconds",
        "3600",
    )
    try:
        rec = RolloutRecorder(record_states=True, target=server.address, session="s", worker_id="w")
        record(rec, 0, range(15))
        expected = rec.finish(pad_incomplete=False)
        rec.close()
        fs, root = filesystem(uri)
        assert episode_files(fs, root) == []  # the interval has not come
    finally:
        assert server.stop() == 0
    assert_identical(expected, read_episodes(uri, "s"))


def test_an_unreachable_bucket_is_retried_until_it_takes_the_episodes(tmp_path: Path, s3):
    bucket = f"late-{random.getrandbits(32):08x}"
    uri = f"s3://{bucket}/episodes"
    options = sink_options(tmp_path, uri, flush=0.2, http_listen="127.0.0.1:0")
    server = start_server(options)

    def shown() -> dict:  # what the dashboard's session page reads
        url = f"http://{server.http_address}/api/sessions/s"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())["dataset"]

    try:
        rec = RolloutRecorder(record_states=True, target=server.address, session="s", worker_id="w")
        record(rec, 0, range(15))  # ingest does not wait for the dataset
        expected = rec.finish(pad_incomplete=False)

        def failures() -> float:
            return server.metrics.snapshot().get("Recorder/dataset_write_failures/session=s", 0)

        assert wait_for(lambda: failures() >= 2, 20)

        def lag() -> float:  # the age of the oldest finished episode not yet written
            return server.metrics.snapshot().get("Recorder/dataset_lag_seconds/session=s", 0)

        assert wait_for(lambda: lag() > 0.5, 5)
        waiting = shown()
        assert waiting["uri"] == uri and waiting["node"] == "n1"
        assert waiting["write_failures"] >= 2 and waiting["episodes_written"] == 0
        assert waiting["episodes_waiting"] == expected.num_episodes
        s3.make_bucket(bucket)
        wait_written(uri, "s", expected.num_episodes, timeout=40)
        assert_identical(expected, read_episodes(uri, "s"))
        snapshot = server.metrics.snapshot()
        assert snapshot["Recorder/dataset_episodes_written/session=s"] == expected.num_episodes
        assert snapshot["Recorder/dataset_pending_episodes/session=s"] == 0
        assert wait_for(lambda: lag() == 0, 5)
        done = shown()
        assert done["episodes_written"] == expected.num_episodes
        assert done["episodes_waiting"] == 0 and done["bytes_written"] > 0
        rec.close()
    finally:
        server.stop(grace=0)


def test_s3_writes_time_out_and_leave_retries_to_the_sink():
    s3 = storage_options(DatasetOptions(uri="s3://b/p", node_id="n", io_timeout=3.0))
    assert s3["config_kwargs"] == {
        "connect_timeout": 3.0,
        "read_timeout": 3.0,
        "retries": {"max_attempts": 2},
    }
    given = DatasetOptions(
        uri="s3://b/p", node_id="n", storage_options={"config_kwargs": {"read_timeout": 30}}
    )
    assert storage_options(given)["config_kwargs"]["read_timeout"] == 30  # the caller's wins
    assert storage_options(DatasetOptions(uri="/tmp/d", node_id="n")) == {}
    with pytest.raises(ValueError, match="--dataset-retry-max-seconds"):
        DatasetOptions(uri="/tmp/d", node_id="n", retry_max_seconds=0)


def test_every_dtype_and_trailing_shape_reads_back(tmp_path: Path):
    """bool, float16, uint64, int8 of rank 3, a zero-size field, float64 actions of (P,), a
    state named like a layout column (kept as state_step), through a file:// URI."""
    uri = f"file://{tmp_path / 'dataset'}"
    options = sink_options(tmp_path, uri, node="edge", flush=0.2)
    fields = ("step", "flags", "half", "big", "empty", "map")
    server = start_server(options)
    try:
        rec = RolloutRecorder(
            record_states=True,
            state_fields=fields,
            target=server.address,
            session="edge",
            worker_id="w",
        )
        rng = np.random.default_rng(1)
        for _ in range(6):
            shape = (7, 2)
            rec.record(
                {
                    "action": rng.random((*shape, 3)),
                    "reward": rng.standard_normal(shape),  # float64: finish() gives float32
                    "done": rng.random(shape) < 0.3,
                },
                {
                    "step": rng.integers(0, 5, shape).astype(np.uint64),
                    "flags": rng.random((*shape, 2, 2)) < 0.5,
                    "half": rng.random((*shape, 3)).astype(np.float16),
                    "big": rng.integers(-9, 9, (*shape, 2, 3, 2)).astype(np.int8),
                    "empty": np.zeros((*shape, 0), np.float32),
                    "map": rng.integers(0, 3, (*shape, 4, 4)).astype(np.uint8),
                },
            )
        expected = rec.finish(pad_incomplete=False)
        wait_written(uri, "edge", expected.num_episodes)
        assert_identical(expected, read_episodes(uri, "edge"))
        columns = set(open_dataset(uri).schema.names)
        assert {"state_step", "step", "block_map", "flags", "half", "big", "empty"} <= columns
        rec.close()
    finally:
        server.stop(grace=0)


def test_a_long_episode_is_gathered_one_decoded_chunk_at_a_time():
    """Memory stays bounded: an episode spanning 100 chunks of 64 envs costs its own steps and
    one decoded chunk, not the 100 chunks decoded at once."""
    from conftest import core_chunk

    from recorder_server.dataset.gather import gather_steps as _gather_steps
    from recorder_server.episodes import StoredChunk

    t_len, n, count = 64, 64, 100
    chunks = []
    for i in range(count):
        arrays = {
            "action": np.full((t_len, n), i, dtype=np.int64),
            "reward": np.full((t_len, n), i, dtype=np.float64),
            "done": np.zeros((t_len, n), dtype=bool),
        }
        chunks.append(StoredChunk(i * t_len, t_len, core_chunk(i + 1, arrays).arrays, 0))
    fields = layout.field_specs(
        {"action": (np.dtype(np.int64), ()), "reward": (np.dtype(np.float64), ())}, ()
    )
    lengths = np.array([t_len * count - 5])
    tracemalloc.start()
    try:
        out, codes = _gather_steps(chunks, fields, np.array([3]), np.array([5]), lengths)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    steps = int(lengths[0])
    assert (out["action"] == (np.arange(5, 5 + steps) // t_len)).all()
    assert out["reward"].dtype == np.float32 and (codes == 0).all()
    result = steps * (8 + 4 + 8)  # the two columns and the codes
    bookkeeping = steps * 8 * 4  # time, env, order and index arrays
    one_chunk = t_len * n * (8 + 8)
    everything = count * one_chunk  # 6.6 MB: what decoding the span at once would take
    assert peak < result + bookkeeping + 3 * one_chunk < everything / 4


def test_writes_wait_for_a_gap_in_ingest_up_to_twice_the_interval(tmp_path: Path):
    """Ingest first: while chunks keep arriving a due write waits (here a file's worth of
    steps is due at every tick), but never past twice the interval; a gap lets it through."""
    uri = str(tmp_path / "dataset")
    options = ServerOptions(
        listen="127.0.0.1:0",
        data_dir=str(tmp_path / "data"),
        dataset=DatasetOptions(uri=uri, node_id="n1", flush_seconds=1.0, file_bytes=64 << 10),
    )
    server = start_server(options)
    fs, root = filesystem(uri)
    try:
        rec = RolloutRecorder(record_states=True, target=server.address, session="s", worker_id="w")
        index, deadline = 0, time.monotonic() + 3.0
        while time.monotonic() < deadline:  # a chunk every 20 ms: never a 0.2 s gap
            record(rec, 0, range(index, index + 1))
            index += 1
            time.sleep(0.02)
        written = sorted(os.path.getmtime(f) for f in episode_files(fs, root))
        expected = rec.finish(pad_incomplete=False)
        wait_written(uri, "s", expected.num_episodes, timeout=10)
        # Flushes while recording (a flush writes its files within a few ms): 64 KiB of
        # steps is due about every 0.4 s, so without waiting there would be about 7; waiting,
        # only the one forced at twice the interval.
        flushes = 1 + sum(b - a > 0.15 for a, b in zip(written, written[1:])) if written else 0
        assert 1 <= flushes <= 2, written
        assert len(episode_files(fs, root)) > len(written)  # the rest, once ingest stopped
        assert_identical(expected, read_episodes(uri, "s"))
        rec.close()
    finally:
        server.stop(grace=0)
