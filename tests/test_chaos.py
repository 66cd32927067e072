"""Chaos: workers stream while the server is killed, restarted, and loses its log's tail.

1. Eight worker processes stream into one session while the server is SIGKILLed and
   restarted five times at random moments (same port, same data directory). Afterwards
   finish() holds every episode exactly once, with the content that was sent.
2. After a kill, the newest log segment loses its last records (as a power cut loses the
   unsynced tail of a batched-fsync log: cut at a record boundary, torn inside a record, or
   overwritten with garbage), then the server restarts. Every worker whose acknowledged
   chunks were lost hears it: a DataLossError naming exactly the lost range
   (on_data_loss="raise"), or a warning and a count in status() (on_data_loss="continue").
   No client spins, and finish() holds every chunk that was not lost exactly once.

Every step of every chunk carries its identity in its action, (worker << 40) | (env << 32)
| step on the worker's time axis, so that each episode can be told apart and checked.
"""

from __future__ import annotations

import json
import logging
import random
import struct
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import TESTS, RestartableServer

from recorder_client import DataLossError, RolloutRecorder
from recorder_server.durability import records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

T, N = 16, 4
DONE_PROB = 0.08


def chunk(worker: int, index: int) -> dict[str, np.ndarray]:
    """Chunk `index` (from 0) of worker `worker`: the same arrays every time it is asked for."""
    rng = np.random.default_rng([worker, index])
    steps = np.arange(index * T, (index + 1) * T, dtype=np.int64)[:, None]
    envs = np.arange(N, dtype=np.int64)[None, :]
    return {
        "action": (np.int64(worker) << 40) | (envs << 32) | steps,
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "done": rng.random((T, N)) < DONE_PROB,
    }


def identity(action: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(worker, env, step) of each action value."""
    return action >> 40, (action >> 32) & 0xFF, action & 0xFFFFFFFF


def expected_episodes(
    worker: int, indexes: list[int], lost: frozenset[int] = frozenset()
) -> list[tuple]:
    """The episodes finish() returns of these chunks of one worker, each as (worker, env,
    step ids, rewards, ended by done), pad_incomplete=True. `indexes`: the chunks it sent, in
    order (sequences 1, 2, ...); `lost`: the sequences lost after their ack. A lost one is a
    hole: no episode spans it, and each env's first piece after it (its start was lost) is
    left out; the piece before it is kept as an unfinished tail."""
    runs: list[tuple[bool, list[int]]] = [(False, [])]
    for sequence, i in enumerate(indexes, start=1):
        if sequence in lost:
            if runs[-1][1] or not runs[-1][0]:
                runs.append((True, []))
        else:
            runs[-1][1].append(i)
    out = []
    for after_hole, run in runs:
        if not run:
            continue
        parts = [chunk(worker, i) for i in run]
        action = np.concatenate([p["action"] for p in parts])
        reward = np.concatenate([p["reward"] for p in parts])
        done = np.concatenate([p["done"] for p in parts])
        for env in range(N):
            start, pieces = 0, []
            for t in range(len(done)):
                if done[t, env]:
                    ids = action[start : t + 1, env]
                    pieces.append(_episode(worker, env, ids, reward, start, t + 1))
                    start = t + 1
            if start < len(done):
                ids = action[start:, env]
                pieces.append(_episode(worker, env, ids, reward, start, len(done), False))
            out += pieces[1:] if after_hole else pieces
    return out


def _episode(worker, env, ids, reward, start, stop, done=True) -> tuple:
    steps = tuple(int(s) for s in identity(ids)[2])
    return worker, env, steps, reward[start:stop, env].tobytes(), done


def episodes_of(out) -> list[tuple]:
    """The episodes finish() returned, in the form of expected_episodes; every row is checked
    against its metadata on the way."""
    found = []
    for row in range(out.num_episodes):
        length = int(out.lengths[row])
        ids = out.actions[row, :length]
        worker, env, steps = identity(ids)
        worker_id = out.worker_ids[out.episode_worker[row]]
        assert worker_id == f"w{int(worker[0])}", (row, worker_id, worker[:3])
        assert (worker == worker[0]).all() and (env == out.episode_env[row]).all(), row
        assert not out.actions[row, length:].any(), f"row {row}: padding is not zero"
        found.append(
            (
                int(worker[0]),
                int(env[0]),
                tuple(int(s) for s in steps),
                out.rewards[row, :length].tobytes(),
                bool(out.episode_done[row]),
            )
        )
    return found


def assert_same_episodes(got: list[tuple], expected: list[tuple]) -> None:
    got_count, expected_count = Counter(got), Counter(expected)
    twice = [e for e, n in got_count.items() if n > 1]
    missing = expected_count - got_count
    extra = got_count - expected_count

    def show(episodes) -> str:
        return ", ".join(f"w{w}/env{e}/steps {s[0]}..{s[-1]}" for w, e, s, *_ in list(episodes)[:8])

    assert not twice, f"{len(twice)} episodes appear more than once: {show(twice)}"
    assert not missing and not extra, (
        f"{sum(missing.values())} expected episodes missing ({show(missing)}); "
        f"{sum(extra.values())} unexpected ({show(extra)})"
    )


# -- 1. kills and restarts while eight workers stream ------------------------------------------

WORKERS = 8
KILLS = 5
MIN_CHUNKS = 40

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from test_chaos import chunk
    from recorder_client import RolloutRecorder
    target, worker, stop_file, min_chunks = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    rec = RolloutRecorder(target=target, session="chaos", worker_id=f"w{{worker}}",
                          connect_timeout=30, reconnect_timeout=60, max_bytes_in_flight=4 << 20,
                          linger_ms=50)  # chunks 20 ms apart join through the kills too
    print("joined", flush=True)
    sent = 0
    while sent < min_chunks or not os.path.exists(stop_file):
        rec.record(chunk(worker, sent))
        sent += 1
        time.sleep(0.02)
    rec.flush(timeout=60)
    stats = rec.stats
    rec.close()
    print(json.dumps({{"sent": sent, "joined": stats.chunks_joined,
                      "reconnects": stats.reconnects}}), flush=True)
    """
).format(tests=str(TESTS))


def test_eight_workers_survive_five_kills_and_every_episode_is_there_once(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"kill schedule seed {seed}")
    server = RestartableServer(tmp_path / "data", "--checkpoint-every", "2").start()
    stop_file = tmp_path / "stop"
    logs = [tmp_path / f"w{w}.log" for w in range(WORKERS)]
    procs = []
    for w in range(WORKERS):
        with open(logs[w], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, server.address, str(w), str(stop_file)]
                    + [str(MIN_CHUNKS)],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            )

    def worker_logs() -> str:
        return "\n".join(f"w{w}: {log.read_text()[-1500:]}" for w, log in enumerate(logs))

    try:
        for p in procs:
            assert p.stdout.readline().strip() == "joined", worker_logs()
        for kill in range(KILLS):
            time.sleep(rng.uniform(0.2, 1.2))
            assert all(p.poll() is None for p in procs), (
                f"a worker ended before the kills did: {worker_logs()}"
            )
            server.kill()
            time.sleep(rng.uniform(0.0, 0.6))
            server.start()
            print(f"kill {kill + 1} done")
        time.sleep(0.5)
        stop_file.touch()
        sent, reconnects, messages = {}, {}, {}
        for w, p in enumerate(procs):
            assert p.wait(90) == 0, f"worker w{w} failed: {worker_logs()}"
            report = json.loads(p.stdout.read().strip().splitlines()[-1])
            sent[w], reconnects[w] = report["sent"], report["reconnects"]
            # Chunks that joined the one before them went under its sequence (linger_ms).
            messages[w] = sent[w] - report["joined"]
            # Each kill broke its stream; a reconnect storm would show here.
            assert 1 <= report["reconnects"] <= 10 * KILLS, (w, report)
        print(f"chunks sent per worker: {sent}; reconnects: {reconnects}")
        with RolloutRecorder(target=server.address, session="chaos", worker_id="viewer") as viewer:
            status = viewer.status()
            out = viewer.finish()
        assert status.chunks_stored == sum(messages.values())
        for worker_status in status.workers:
            if worker_status.worker_id != "viewer":
                w = int(worker_status.worker_id[1:])
                assert worker_status.last_sequence == messages[w], worker_status
        expected = [e for w in range(WORKERS) for e in expected_episodes(w, list(range(sent[w])))]
        assert_same_episodes(episodes_of(out), expected)
        assert "Traceback" not in server.log()
    finally:
        stop_file.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
        server.kill()


# -- 2. the log's unsynced tail is lost --------------------------------------------------------

_SEGMENT_HEADER = 24
_RECORD_HEADER = struct.Struct("<4sIQII")


def log_records(segment: Path) -> list[tuple[int, int, records.Record]]:
    """(offset, size, record) of every record of a log segment (layout: wal.py's docstring)."""
    data = segment.read_bytes()
    out = []
    offset = _SEGMENT_HEADER
    while offset + _RECORD_HEADER.size <= len(data):
        marker, length, _index, _crc, _head_crc = _RECORD_HEADER.unpack_from(data, offset)
        assert marker == b"RRWL", f"{segment}: no record at offset {offset}"
        body = data[offset + _RECORD_HEADER.size : offset + _RECORD_HEADER.size + length]
        out.append((offset, _RECORD_HEADER.size + length, records.decode(body)))
        offset += _RECORD_HEADER.size + length
    assert offset == len(data), f"{segment}: {len(data) - offset} trailing bytes"
    return out


def cut_log_tail(data_dir: Path, count: int, style: str) -> dict[str, list[int]]:
    """Lose the last `count` records of the newest log segment as a power cut would; returns
    the chunk sequences lost per worker id."""
    segment = sorted((data_dir / "wal").glob("wal-*.log"))[-1]
    tail = log_records(segment)[-count:]
    lost: dict[str, list[int]] = {}
    for _, _, record in tail:
        assert record.kind == records.CHUNK, f"the cut would take a {record.kind!r} record"
        lost.setdefault(record.worker, []).append(record.body.sequence)
    start = tail[0][0]
    size = segment.stat().st_size
    with open(segment, "r+b") as fh:
        if style == "boundary":  # the last records never reached the disk
            fh.truncate(start)
        elif style == "torn":  # the first lost record only in part
            fh.truncate(start + _RECORD_HEADER.size + 5)
        else:  # "garbage": the sectors hold something else
            fh.seek(start)
            fh.write(np.random.default_rng(size).bytes(size - start))
    return lost


@pytest.mark.parametrize("style", ["boundary", "torn", "garbage"])
def test_lost_log_tail_reaches_every_affected_worker(tmp_path, style, caplog):
    caplog.set_level(logging.WARNING, logger="recorder_client")
    server = RestartableServer(tmp_path / "data", "--checkpoint-every", "0").start()
    policies = {0: "raise", 1: "raise", 2: "continue", 3: "raise"}
    recs = {
        w: RolloutRecorder(
            target=server.address,
            session="cut",
            worker_id=f"w{w}",
            reconnect_timeout=30,
            on_data_loss=policy,
        )
        for w, policy in policies.items()
    }
    try:
        before = 6
        # One chunk at a time, so that the log holds them in this order: w0 1, w1 1, ...
        for index in range(before):
            for w, rec in recs.items():
                if w == 3 and index >= 3:
                    continue  # w3 stops early: none of its chunks is in the lost tail
                rec.record(chunk(w, index))
                rec.flush(timeout=30)
        server.kill()
        # The last four records: w1's and w2's chunk 6, w0's chunk 6, w2's chunk 5... in log
        # order w2 5, w0 6, w1 6, w2 6.
        lost = cut_log_tail(server.data_dir, 4, style)
        assert {w: sorted(s) for w, s in lost.items()} == {"w0": [6], "w1": [6], "w2": [5, 6]}
        server.start()
        restarted = time.monotonic()

        errors: dict[int, list[DataLossError]] = {w: [] for w in recs}
        after = 2
        for index in range(before, before + after):
            for w, rec in recs.items():
                try:
                    rec.record(chunk(w, index))
                except DataLossError as exc:
                    errors[w].append(exc)
        for w, rec in recs.items():
            for _ in range(3):
                try:
                    rec.flush(timeout=30)
                    break
                except DataLossError as exc:
                    errors[w].append(exc)
            rec.flush(timeout=30)
        assert time.monotonic() - restarted < 60

        for w, rec in recs.items():
            worker_id = f"w{w}"
            ranges = [(e.first, e.last) for e in errors[w]]
            lost_here = lost.get(worker_id, [])
            if policies[w] == "raise" and lost_here:
                assert ranges == [(min(lost_here), max(lost_here))], (worker_id, ranges)
            else:
                assert ranges == [], (worker_id, ranges)
            assert rec.stats.sequences_lost == len(lost_here), worker_id
            assert rec.stats.reconnects <= 3, (worker_id, rec.stats)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("lost chunks 5..6" in m and "'w2'" in m for m in warned), warned

        status = recs[0].status()
        by_worker = {ws.worker_id: ws for ws in status.workers}
        for w in recs:
            lost_here = lost.get(f"w{w}", [])
            assert by_worker[f"w{w}"].sequences_lost == len(lost_here)
        assert status.sequences_lost == sum(len(s) for s in lost.values())

        sent = {w: list(range(3 if w == 3 else before)) for w in recs}
        for w in recs:
            sent[w] += list(range(before, before + after))
        kept = {
            w: [i for i in indexes if i + 1 not in lost.get(f"w{w}", [])]
            for w, indexes in sent.items()
        }
        expected = [
            e for w in recs for e in expected_episodes(w, sent[w], frozenset(lost.get(f"w{w}", [])))
        ]
        out = recs[0].finish()
        assert_same_episodes(episodes_of(out), expected)
        assert status.chunks_stored == sum(len(k) for k in kept.values())

        # The server's log says what was lost, worker by worker.
        log = server.log()
        for worker_id, sequences in lost.items():
            first, last = min(sequences), max(sequences)
            assert f"worker {worker_id!r}: chunks {first}..{last}" in log, log[-3000:]
        assert "up to None" not in log, "a recovery message that does not say what was lost"

        # What survived the loss is durable: a clean restart keeps it all.
        for rec in recs.values():
            rec.close()
        recs.clear()
        assert server.stop() == 0
        server.start()
        with RolloutRecorder(target=server.address, session="cut", worker_id="w0") as viewer:
            assert_same_episodes(episodes_of(viewer.finish()), expected)
        assert "Traceback" not in server.log()
    finally:
        for rec in recs.values():
            try:
                rec.close(timeout=5)
            except Exception:
                pass
        server.kill()


def test_helpers_agree_with_the_reference_model():
    """The expected episodes above equal what the reference model makes of the chunks."""
    from reference_model import ReferenceRecorder

    ref = ReferenceRecorder()
    for i in range(5):
        ref.record(chunk(3, i))
    exp = ref.finish()
    mine = expected_episodes(3, list(range(5)))
    # The reference model orders episodes env by env, then in time: as expected_episodes.
    assert len(mine) == exp["actions"].shape[0]
    for row, (_, env, steps, rewards, done) in enumerate(mine):
        length = int(exp["lengths"][row])
        assert identity(exp["actions"][row, :length])[2].tolist() == list(steps)
        assert exp["rewards"][row, :length].tobytes() == rewards
        assert int(exp["episode_env"][row]) == env and bool(exp["episode_done"][row]) == done
