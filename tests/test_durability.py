"""Crash safety with real processes, real signals and real files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, mounted_tmpfs, wait_for
from reference_model import ReferenceRecorder

from recorder_client import ResourceExhaustedError, RolloutRecorder
from recorder_client._launch import ServerProcess
from recorder_server.workload import SyntheticVecEnv

FIELDS = ["player_positions", "player_inventory"]


class Server:
    """`rollout-recorder serve` on a fixed address, restartable on the same data dir."""

    def __init__(self, data_dir: Path, *extra: str, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra = extra
        self.process: ServerProcess | None = None
        self.stderr_path = data_dir.parent / f"server-{self.port}.log"

    def start(self) -> Server:
        self.log = open(self.stderr_path, "a")
        args = ["--listen", self.address, "--data-dir", str(self.data_dir)]
        self.process = ServerProcess(
            [*args, "--checkpoint-every", "0", *self.extra], stderr=self.log
        )
        return self

    def kill9(self) -> None:
        self.process.kill()
        self.log.close()

    def stop(self) -> int:
        code = self.process.stop(30)
        self.log.close()
        return code

    def stderr(self) -> str:
        return self.stderr_path.read_text()


@pytest.fixture
def durable(tmp_path):
    servers = []

    def make(*extra, port=None):
        server = Server(tmp_path / "data", *extra, port=port)
        servers.append(server)
        return server

    yield make
    for server in servers:
        if server.process is not None and server.process.alive():
            server.process.kill()
        if server.process is not None:
            server.log.close()


WORKER = textwrap.dedent(
    """
    import sys, time
    from recorder_client import RolloutRecorder
    from recorder_server.workload import SyntheticVecEnv
    target, seed, chunks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    env = SyntheticVecEnv(8, seed=seed, done_prob=0.02)
    with RolloutRecorder(record_states=True, state_fields={fields!r}, target=target,
                         session="crash", worker_id=f"w{{seed}}", reconnect_timeout=120,
                         max_bytes_in_flight=1 << 20) as rec:
        for i in range(chunks):
            rec.record(*env.collect(32))
            time.sleep(0.01)
    print("done", flush=True)
    """
).format(fields=FIELDS)


def expected_for(seed: int, chunks: int) -> dict:
    ref = ReferenceRecorder(record_states=True, state_fields=FIELDS)
    env = SyntheticVecEnv(8, seed=seed, done_prob=0.02)
    for _ in range(chunks):
        ref.record(*env.collect(32))
    return ref.finish()


def assert_matches_fault_free(out, chunks: int, workers: int) -> None:
    """Every worker's rows equal a fault-free in-process recording of its chunks."""
    workers_seen = sorted(w for w in out.worker_ids if w.startswith("w"))
    assert workers_seen == [f"w{i}" for i in range(workers)]
    total = 0
    for index, worker_id in enumerate(out.worker_ids):
        if not worker_id.startswith("w"):
            continue
        exp = expected_for(int(worker_id[1:]), chunks)
        rows = out.episode_worker == index
        assert rows.sum() == exp["actions"].shape[0], worker_id
        for name in ("actions", "rewards", "positions", "player_inventory"):
            got = out.fields[name][rows][:, : exp[name].shape[1]]
            assert got.tobytes() == exp[name].tobytes(), (worker_id, name)
        assert np.array_equal(out.lengths[rows], exp["lengths"])
        total += int(rows.sum())
    assert total == out.num_episodes


def test_kill_9_while_four_workers_stream_loses_nothing(durable):
    server = durable().start()
    chunks = 60
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, server.address, str(i), str(chunks)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    with RolloutRecorder(
        record_states=True,
        state_fields=FIELDS,
        target=server.address,
        session="crash",
        worker_id="viewer",
    ) as viewer:
        assert wait_for(lambda: viewer.status().chunks_stored >= 40, timeout=60)
        stored_before = viewer.status().chunks_stored
    assert stored_before < 4 * chunks, "the workers finished before the crash"
    server.kill9()
    time.sleep(0.5)
    server.start()  # same port, same data directory
    for p in procs:
        assert p.wait(120) == 0
        assert p.stdout.read().strip() == "done"
        p.stdout.close()
    with RolloutRecorder(
        record_states=True,
        state_fields=FIELDS,
        target=server.address,
        session="crash",
        worker_id="viewer",
    ) as viewer:
        status = viewer.status()
        assert status.chunks_stored == 4 * chunks
        out = viewer.finish()
    assert_matches_fault_free(out, chunks, 4)
    assert "replayed" in server.stderr()


def record_chunks(target, n, seed=0, session="s", after_flush=lambda: None):
    rng = np.random.default_rng(seed)
    chunks = []
    with RolloutRecorder(target=target, session=session, worker_id="one") as rec:
        for _ in range(n):
            c = {
                "action": rng.integers(0, 12, (16, 4)).astype(np.int32),
                "reward": rng.random((16, 4)).astype(np.float32),
                "done": rng.random((16, 4)) < 0.1,
            }
            rec.record(c)
            chunks.append(c)
        rec.flush()
        after_flush()
    return chunks


def reference(chunks):
    ref = ReferenceRecorder()
    for c in chunks:
        ref.record(c)
    return ref.finish()


def test_torn_log_tail_is_dropped_and_reported(durable):
    server = durable("--wal-fsync", "always").start()
    sizes = []

    def log_size():
        sizes.append(sorted((server.data_dir / "wal").glob("wal-*.log"))[-1].stat().st_size)

    chunks = record_chunks(server.address, 6, after_flush=log_size)
    server.kill9()
    segments = sorted((server.data_dir / "wal").glob("wal-*.log"))
    last = segments[-1]
    with open(last, "r+b") as fh:
        # Mid-way through the last chunk's record (the worker's leave record follows it).
        fh.truncate(sizes[0] - 10)
    server.start()
    log = server.stderr()
    assert "dropped a torn log tail: 1 record(s)" in log
    with RolloutRecorder(target=server.address, session="s", worker_id="one") as rec:
        assert rec.status().chunks_stored == 5  # everything else is kept
        out = rec.finish()
    exp = reference(chunks[:5])
    assert out.actions.tobytes() == exp["actions"].tobytes()


def test_corrupt_newest_checkpoint_is_skipped_and_nothing_is_lost(durable):
    server = durable().start()
    rng_chunks = []
    with RolloutRecorder(target=server.address, session="s", worker_id="one") as rec:
        rng = np.random.default_rng(1)
        for round_ in range(3):
            for _ in range(4):
                c = {
                    "action": rng.integers(0, 12, (16, 4)).astype(np.int32),
                    "reward": rng.random((16, 4)).astype(np.float32),
                    "done": rng.random((16, 4)) < 0.1,
                }
                rec.record(c)
                rng_chunks.append(c)
            if round_ < 2:
                rec.checkpoint()
        rec.flush()
    server.kill9()
    ckpts = sorted((server.data_dir / "checkpoints").glob("ckpt-*.rrc"))
    assert len(ckpts) == 2
    newest = ckpts[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    server.start()
    log = server.stderr()
    assert f"skipped checkpoint {newest}" in log and "sha256" in log
    assert f"loaded checkpoint {ckpts[0]}" in log
    with RolloutRecorder(target=server.address, session="s", worker_id="one") as rec:
        assert rec.status().chunks_stored == 12
        out = rec.finish()
    assert out.actions.tobytes() == reference(rng_chunks)["actions"].tobytes()


def test_sigterm_checkpoints_and_restart_needs_no_replay(durable):
    server = durable().start()
    chunks = record_chunks(server.address, 5)
    assert server.stop() == 0
    assert list((server.data_dir / "checkpoints").glob("ckpt-*.rrc"))
    server.start()
    assert "replayed 0 log records" in server.stderr()
    with RolloutRecorder(target=server.address, session="s", worker_id="one") as rec:
        assert rec.finish().actions.tobytes() == reference(chunks)["actions"].tobytes()


def test_trajectory_store_survives_sigterm_and_kill_9(durable, tmp_path):
    """A store's kept episodes are encoded by the SIGTERM checkpoint (they were still read
    from the session's chunks) and rebuilt by the log replay after kill -9: either way the
    store equals that of a server that never stopped, fed the same chunks."""
    from recorder_client import (
        CellField,
        OutcomeRule,
        TrajectoryTrainingConfiguration,
        UtilityConfig,
    )

    config = TrajectoryTrainingConfiguration(
        cell_fields=(
            CellField("player_positions", (0, 0), bucket=4, name="x"),
            CellField("player_positions", (0, 1), bucket=4, name="y"),
        ),
        utilities=(UtilityConfig("win_proximity", gamma=0.9),),
        outcome_rule=OutcomeRule("reward_sign"),
    )
    env = SyntheticVecEnv(8, seed=4, done_prob=0.05)
    chunks = [env.collect(32) for _ in range(10)]

    def recorder(address, session):
        return RolloutRecorder(
            record_states=True,
            state_fields=FIELDS,
            target=address,
            session=session,
            worker_id="w",
            capture=config,
        )

    def record(address, session):
        with recorder(address, session) as rec:
            for trajectories, states in chunks:
                rec.record(trajectories, states)
            rec.flush()
            return rec.capture.snapshot_potential("win_proximity", ["x", "y"])

    def store_file(address, session):
        with recorder(address, session) as rec:
            return rec.capture.trajectory_store_checkpoint_file(compress=False).data

    steady = Server(tmp_path / "steady").start()
    try:
        potential = record(steady.address, "s")
        expected = store_file(steady.address, "s")
    finally:
        steady.stop()

    server = durable().start()
    assert record(server.address, "s") == potential
    assert server.stop() == 0  # SIGTERM: a checkpoint
    server.start()
    assert "replayed 0 log records" in server.stderr()
    assert store_file(server.address, "s") == expected
    assert record(server.address, "k") == potential
    server.kill9()
    server.start()
    assert store_file(server.address, "k") == expected
    assert store_file(server.address, "s") == expected


def test_runtime_state_moves_a_session_to_a_fresh_server(durable, tmp_path):
    first = durable().start()
    chunks = record_chunks(first.address, 4, seed=5)
    with RolloutRecorder(target=first.address, session="s", worker_id="one") as rec:
        state = rec.runtime_state()
    second = Server(tmp_path / "other").start()
    try:
        with RolloutRecorder(target=second.address, session="s", worker_id="one") as rec:
            rec.load_runtime_state(state)
            assert rec.num_recorded_steps == 64
            more = np.random.default_rng(9)
            extra = {
                "action": more.integers(0, 12, (16, 4)).astype(np.int32),
                "reward": more.random((16, 4)).astype(np.float32),
                "done": more.random((16, 4)) < 0.1,
            }
            rec.record(extra)  # carries on with the next sequence number
            out = rec.finish()
        assert out.actions.tobytes() == reference(chunks + [extra])["actions"].tobytes()
        with RolloutRecorder(target=second.address, session="s", worker_id="one") as rec:
            with pytest.raises(ValueError, match="runtime state"):
                rec.load_runtime_state(state[:-7])
    finally:
        second.stop()


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MiB filesystem: room for the server's files, not for much data."""
    with mounted_tmpfs(tmp_path / "small", "6m") as mount:
        yield mount


def test_full_disk_refuses_with_resource_exhausted_and_resumes(durable, small_fs):
    server = Server(small_fs / "data", "--wal-fsync", "always").start()
    filler = small_fs / "filler"
    try:
        rng = np.random.default_rng(2)

        def chunk():  # incompressible: about 160 KB on the wire
            return {
                "action": rng.integers(0, 1 << 62, (256, 64), dtype=np.int64),
                "reward": np.zeros((256, 64), np.float32),
                "done": np.zeros((256, 64), bool),
            }

        sent = []
        with RolloutRecorder(target=server.address, session="full", worker_id="one") as rec:
            for _ in range(3):
                sent.append(chunk())
                rec.record(sent[-1])
            rec.flush()
            # Leave less room than one chunk needs.
            free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
            filler.write_bytes(b"\0" * max(0, free - 64 * 1024))
            sent.append(chunk())
            rec.record(sent[-1])
            with pytest.raises(ResourceExhaustedError, match="write-ahead log"):
                rec.flush(timeout=30)
            with pytest.raises(ResourceExhaustedError):
                rec.finish()  # never a result that silently lacks the held chunk
            # What was acknowledged is intact.
            with RolloutRecorder(target=server.address, session="full") as viewer:
                assert viewer.status().chunks_stored == 3
                out = viewer.finish()
            assert out.actions.tobytes() == reference(sent[:3])["actions"].tobytes()
            filler.unlink()  # space is back: the held chunk goes through by itself

            def flushed() -> bool:
                try:
                    rec.flush(timeout=5)
                    return True
                except ResourceExhaustedError:
                    return False

            assert wait_for(flushed, timeout=60)
            sent.append(chunk())
            rec.record(sent[-1])
            out = rec.finish()
        assert out.actions.tobytes() == reference(sent)["actions"].tobytes()
    finally:
        server.stop()
