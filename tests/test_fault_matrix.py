"""The fault matrix: every fault of tests/fault_matrix_rows.py against a real
`rollout-recorder serve` subprocess, with a dataset (--dataset-uri, a local directory) and a
trajectory store (capture=) on every session.

Each row's scenario records chunks whose every action carries its identity ((worker << 40) |
(env << 32) | step, tests/test_dataset.py's chunks), does the fault, and says what the
trainer saw and which chunks the server must hold. The truth is then computed here from
those chunks by a splitter of its own, and compared with finish(), read_episodes() of the
dataset, the store's archive (visits per cell) and sample_start(); the row's line must be in
the server's log.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import RestartableServer
from fault_matrix_rows import DOCS, ROWS, Row, markdown_table
from test_dataset import N, T, chunk, episodes_of, wait_written
from test_dataset_store import CAPTURE
from test_trust import zeros, zeros_frame

from recorder_client import (
    DataLossError,
    InvalidChunkError,
    RecorderError,
    RolloutRecorder,
    WorkerIdInUseError,
    drop_session,
    list_sessions,
)
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_client.dataset import read_episodes

pytestmark = pytest.mark.timeout(180)

# -- the truth, from the chunks sent ---------------------------------------------------------


def true_episodes(kept: dict[int, list[int]]) -> Counter:
    """The finished episodes of these chunks (worker -> chunk indexes the server holds), as
    test_dataset.episodes_of reads them: (worker, env, first step, length, reward bytes).

    A chunk missing from a worker's indexes is a hole: no episode spans it, and the steps
    after it up to the next done (an episode whose start was lost) are no episode."""
    out: Counter = Counter()
    for worker, indexes in kept.items():
        runs: list[list[int]] = []
        for i in sorted(indexes):
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parts = [chunk(worker, i)[0] for i in run]
            done = np.concatenate([p["done"] for p in parts])
            reward = np.concatenate([p["reward"] for p in parts])
            for env in range(N):
                ends = np.flatnonzero(done[:, env]).tolist()
                starts = [0] + [e + 1 for e in ends[:-1]]
                for start, end in zip(starts, ends):
                    if start == 0 and run[0] != 0:
                        continue  # began before the hole
                    first = run[0] * T + start
                    out[
                        (
                            worker,
                            env,
                            first,
                            end + 1 - start,
                            reward[start : end + 1, env].tobytes(),
                        )
                    ] += 1
    return out


def steps_of(episode: tuple) -> tuple[int, int, int, int]:
    worker, env, first, length, _ = episode
    return worker, env, first, length


def true_visits(episodes: Counter) -> Counter:
    """Steps per store cell (CAPTURE: player position // 16 on x and y) over these episodes."""
    visits: Counter = Counter()
    for (worker, env, first, length, _), count in episodes.items():
        for step in range(first, first + length):
            position = chunk(worker, step // T)[1]["player_positions"][step % T, env, 0]
            visits[tuple(int(v) // 16 for v in position)] += count
    return visits


# -- a row's run -----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a scenario saw and which chunks the server must hold."""

    session: str
    kept: dict[int, list[int]]
    """worker -> chunk indexes whose finished episodes finish() returns."""
    seen: object = None
    """What the trainer saw: None, an exception, or a refusing RecordAck."""
    store: dict[int, list[int]] | None = None
    """worker -> chunk indexes whose finished episodes the store holds (default: kept)."""
    dataset: dict[int, list[int]] | None = None
    """worker -> chunk indexes whose finished episodes the dataset holds (default: store)."""


def recorder(server: RestartableServer, session: str, worker: int, **kw) -> RolloutRecorder:
    return RolloutRecorder(
        record_states=True,
        target=server.address,
        session=session,
        worker_id=f"w{worker}",
        capture=CAPTURE,
        **{"reconnect_timeout": 60, **kw},
    )


def send(rec: RolloutRecorder, worker: int, indexes) -> None:
    for i in indexes:
        arrays, states = chunk(worker, i)
        outcome = arrays.pop("outcome")
        rec.record(arrays, states, outcome=outcome)


def seen_as(seen: object) -> tuple[str, str]:
    """(kind, message) of what the trainer saw."""
    if seen is None:
        return "nothing", ""
    if isinstance(seen, pb.RecordAck):
        return seen.error_code, seen.error_message
    if isinstance(seen, grpc.RpcError):
        return seen.code().name, seen.details()
    return type(seen).__name__, str(seen)


def check_holdings(server: RestartableServer, uri: str, out: Outcome) -> None:
    store = out.store if out.store is not None else out.kept
    expected = true_episodes(store)
    viewer = RolloutRecorder(
        record_states=True,
        target=server.address,
        session=out.session,
        worker_id="viewer",
        capture=CAPTURE,
        on_data_loss="continue",  # what the trainer was told is checked on its own
    )
    try:
        got = viewer.finish(pad_incomplete=False)
        assert episodes_of(got) == true_episodes(out.kept), "finish() differs from the truth"
        archive = viewer.capture.archive()
        cells = {tuple(k): int(v) for k, v in zip(archive.keys.tolist(), archive.visits.tolist())}
        assert cells == dict(true_visits(expected)), "the store's visits differ from the truth"
        start = viewer.capture.sample_start()
        assert start is not None
        reference, prefix = start
        ident = prefix.actions
        worker, env, step = int(ident[0] >> 40), int((ident[0] >> 32) & 0xFF), ident & 0xFFFFFFFF
        # The prefix is the start of an episode that happened, ending in the named cell.
        assert prefix.length == reference.step + 1
        assert (step == np.arange(step[0], step[0] + prefix.length)).all()
        assert any(
            (w, e, first) == (worker, env, int(step[0])) and length >= prefix.length
            for w, e, first, length in map(steps_of, expected)
        ), f"sample_start() returned steps {step[0]}.. of w{worker}/env{env}: no such episode"
        cell = tuple(int(v) // 16 for v in prefix.states["player_positions"][-1, 0])
        assert cell == reference.cell
    finally:
        viewer.close()
    in_dataset = true_episodes(out.dataset if out.dataset is not None else store)
    wait_written(uri, out.session, sum(in_dataset.values()))
    assert episodes_of(read_episodes(uri, out.session)) == in_dataset, "the dataset differs"


class Bench:
    """The servers of the matrix: `shared` for rows without a restart (each on its own
    session), `own()` for a row that kills its server."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uris: dict[str, str] = {}
        """Each server's dataset, by its address."""
        self.servers: list[RestartableServer] = []
        self._shared: RestartableServer | None = None

    def own(self, *extra: str, seed: Path | None = None) -> RestartableServer:
        """A server of its own; `seed`: a data directory copied in first."""
        data = self.root / f"data-{len(self.servers)}"
        if seed is not None:
            shutil.copytree(seed, data)
        # A dataset per server: one session's dtypes must not meet another's in a read.
        uri = str(self.root / f"dataset-{len(self.servers)}")
        flags = ["--dataset-uri", uri, "--dataset-flush-seconds", "0.1", "--node-id", "n1"]
        server = RestartableServer(data, *flags, "--checkpoint-every", "0", *extra)
        self.servers.append(server)
        self.uris[server.address] = uri
        return server.start()

    @property
    def shared(self) -> RestartableServer:
        if self._shared is None:
            self._shared = self.own()
        return self._shared

    def close(self) -> None:
        for server in self.servers:
            if server.alive():
                server.stop()


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Iterator[Bench]:
    running = Bench(tmp_path_factory.mktemp("matrix"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROLLOUT_RECORDER_LOG", "INFO")  # refusals are logged at INFO
        try:
            yield running
        finally:
            running.close()


# -- the scenarios, one per row --------------------------------------------------------------


def restarted(
    server: RestartableServer, rec: RolloutRecorder, while_down: Callable[[], None], after: range
) -> None:
    """What ``rec`` sent so far acknowledged, the server killed, ``while_down()`` done, the
    server started again, chunks ``after`` sent and acknowledged; ``rec`` closed."""
    rec.flush()
    server.kill()
    while_down()
    server.start()
    send(rec, 0, after)
    rec.flush(timeout=60)
    rec.close()


def kill_9(bench: Bench, session: str) -> tuple[RestartableServer, Outcome]:
    server = bench.own()
    rec = recorder(server, session, 0)
    send(rec, 0, range(5))
    # Chunks 5 and 6 are held by the client while the server is down.
    restarted(server, rec, lambda: send(rec, 0, range(5, 7)), range(7, 10))
    return server, Outcome(session, {0: list(range(10))})


def torn_unacked_tail(bench: Bench, session: str) -> tuple[RestartableServer, Outcome]:
    server = bench.own("--wal-fsync", "always")
    rec = recorder(server, session, 0)
    send(rec, 0, range(6))

    def torn() -> None:
        segment = sorted((server.data_dir / "wal").glob("wal-*.log"))[-1]
        with open(segment, "ab") as fh:
            fh.write(b"RRWL" + bytes(6))  # the start of a record header that never got further

    restarted(server, rec, torn, range(6, 9))
    return server, Outcome(session, {0: list(range(9))})


def torn_acked_tail(bench: Bench, session: str) -> tuple[RestartableServer, Outcome]:
    # The dataset is written once early on, then not before the restart: no file outlives
    # the log records it came from.
    server = bench.own("--dataset-flush-seconds", "3600")
    rec = recorder(server, session, 0)
    send(rec, 0, range(7))
    rec.flush()
    time.sleep(1.5)  # the dataset's first write, of a new session, is over
    wal = server.data_dir / "wal"
    cut = sorted(wal.glob("wal-*.log"))[-1].stat().st_size + 10  # inside chunk 8's record
    send(rec, 0, range(7, 10))
    rec.flush()
    server.kill()
    with open(sorted(wal.glob("wal-*.log"))[-1], "r+b") as fh:
        fh.truncate(cut)
    server.extra = server.extra[:-2]  # the matrix's dataset flush interval again
    server.start()
    seen = None
    calls = [lambda i=i: send(rec, 0, [i]) for i in range(10, 14)]
    for call in [*calls, lambda: rec.flush(timeout=60)]:
        try:
            call()
        except DataLossError as exc:  # raised once its call's chunk was queued
            seen = exc
    rec.flush(timeout=60)
    rec.close()
    return server, Outcome(session, {0: [*range(7), *range(10, 14)]}, seen=seen)


def flip_newest_checkpoint(data_dir: Path) -> None:
    """One byte of the checkpoint recovery tries first (the highest step; of its copies,
    ckpt-<step>.rrc) flipped."""
    paths = (data_dir / "checkpoints").glob("ckpt-*.rrc")
    newest = max(paths, key=lambda p: (int(p.name[5:17]), -len(p.suffixes)))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))


def unexplained_loss(bench: Bench, session: str) -> tuple[RestartableServer, Outcome]:
    server = bench.own("--wal-fsync", "always", "--dataset-flush-seconds", "3600")
    rec = recorder(server, session, 0, connect_timeout=10, reconnect_timeout=10)
    send(rec, 0, range(4))
    rec.flush()
    segment = sorted((server.data_dir / "wal").glob("wal-*.log"))[-1]
    cut = segment.stat().st_size  # after chunk 4's record
    send(rec, 0, range(4, 6))
    rec.flush()
    server.kill()
    with open(segment, "r+b") as fh:
        fh.truncate(cut)  # chunks 5 and 6 gone, at a record boundary
    server.extra = server.extra[:-2]  # the matrix's dataset flush interval again
    server.start()
    send(rec, 0, [6])
    with pytest.raises(InvalidChunkError) as refused:
        rec.flush(timeout=30)
    rec.close(timeout=5)
    return server, Outcome(session, {0: list(range(4))}, seen=refused.value)


def corrupt_newest_checkpoint(bench: Bench, session: str) -> tuple[RestartableServer, Outcome]:
    server = bench.own()
    rec = recorder(server, session, 0)
    for part in range(3):
        send(rec, 0, range(4 * part, 4 * part + 4))
        if part < 2:
            rec.checkpoint()
    restarted(server, rec, lambda: flip_newest_checkpoint(server.data_dir), range(12, 14))
    return server, Outcome(session, {0: list(range(14))})


def drop_then_corrupt_checkpoint(bench: Bench, session: str):
    server = bench.own()
    dropped = recorder(server, session + "-dropped", 1)
    send(dropped, 1, range(3))
    dropped.close()
    rec = recorder(server, session, 0)
    send(rec, 0, range(2))
    rec.checkpoint()
    drop_session(server.address, session + "-dropped")
    send(rec, 0, range(2, 12))
    restarted(server, rec, lambda: flip_newest_checkpoint(server.data_dir), range(12, 14))
    assert session + "-dropped" not in [s["name"] for s in list_sessions(server.address)]
    # Its finished episodes went to the dataset at the drop, once.
    dropped_episodes = true_episodes({1: list(range(3))})
    wait_written(bench.uris[server.address], session + "-dropped", sum(dropped_episodes.values()))
    assert (
        episodes_of(read_episodes(bench.uris[server.address], session + "-dropped"))
        == dropped_episodes
    )
    return server, Outcome(session, {0: list(range(14))})


def previous_format_data_dir(bench: Bench, session: str):
    """The upgrade tests' fixture (written by the code before the current formats, with its
    own truth) under the matrix's server; then a session of the matrix's own on it."""
    from test_upgrade import FIXTURE, finish_matches_truth

    server = bench.own(seed=FIXTURE / "data")
    finish_matches_truth(server.address)
    rec = recorder(server, session, 0)
    send(rec, 0, range(5))
    rec.close()
    return server, Outcome(session, {0: list(range(5))})


def unary_call_during_restart(bench: Bench, session: str):
    server = bench.own()
    rec = recorder(server, session, 0, connect_timeout=30)
    send(rec, 0, range(4))
    rec.flush()
    server.kill()
    later = threading.Timer(1.0, server.start)
    later.start()
    try:
        sessions = list_sessions(server.address, timeout=30)
        status = rec.status()
    finally:
        later.join()
    assert [s["name"] for s in sessions] == [session]
    assert status.chunks_stored == 4 and status.sequences_lost == 0
    send(rec, 0, range(4, 6))
    rec.close()
    return server, Outcome(session, {0: list(range(6))})


def _refused_chunk(bench: Bench, session: str, worker_id: str, action: pb.ArrayData):
    """A live worker records around one raw chunk of `worker_id`; the raw chunk's ack."""
    server = bench.shared
    rec = recorder(server, session, 0)
    send(rec, 0, range(3))
    rec.flush()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.RecorderStub(channel)
        stub.Join(pb.JoinRequest(session=session, config=rec._config(), worker_id=worker_id))
        bad = pb.Chunk(
            sequence=1,
            action=action,
            reward=zeros("<f4", [T, N]),
            done=zeros("|b1", [T, N]),
        )
        opened = pb.RecordOpen(session=session, worker_id=worker_id)
        requests = [pb.RecordRequest(open=opened), pb.RecordRequest(chunk=bad)]
        [ack] = stub.Record(iter(requests), timeout=60)
    send(rec, 0, range(3, 6))
    rec.close()
    return server, Outcome(session, {0: list(range(6))}, seen=ack)


def zstd_bomb(bench: Bench, session: str):
    # 1 GiB of zeros in 32 KiB of zstd (RLE blocks).
    return _refused_chunk(bench, session, "bomber", zeros("|u1", [1 << 15, 1 << 15]))


def lying_size(bench: Bench, session: str):
    # The header declares T*N*8 bytes of int64; the frame holds 8.
    action = zeros("<i8", [T, N], zeros_frame(8))
    return _refused_chunk(bench, session, "liar", action)


def corrupt_frame(bench: Bench, session: str) -> tuple[RestartableServer, Outcome]:
    """Worker 0 records chunks 0..5; worker 1 (raw messages) chunks 0..3, whose chunk 1 has
    an inventory frame that passes the header checks and does not decode."""
    from test_verify_frames import broken_frame

    from recorder_client._messages import array_to_proto

    server = bench.shared
    rec = recorder(server, session, 0)
    send(rec, 0, range(6))
    rec.flush()
    messages = []
    for i in range(4):
        arrays, states = chunk(1, i)
        msg = pb.Chunk(sequence=i + 1)
        for name in ("action", "reward", "done", "outcome"):
            getattr(msg, name).CopyFrom(array_to_proto(arrays[name], pack=True))
        for name, value in states.items():
            frame = array_to_proto(value, pack=True)
            if i == 1 and name == "player_inventory":
                frame = broken_frame(value)
            msg.states.append(pb.NamedArray(name=name, array=frame))
        messages.append(msg)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.RecorderStub(channel)
        stub.Join(pb.JoinRequest(session=session, config=rec._config(), worker_id="w1"))
        opened = pb.RecordOpen(session=session, worker_id="w1")
        requests = [pb.RecordRequest(open=opened), *(pb.RecordRequest(chunk=m) for m in messages)]
        acks = list(stub.Record(iter(requests), timeout=60))
        assert [a.result for a in acks] == [pb.RecordAck.STORED] * 4, acks
    with pytest.raises(DataLossError) as told:
        rec.finish(pad_incomplete=False)
    marked = told.value.trajectory
    over = marked.episode_worker == marked.worker_ids.index("w1")
    rows = np.flatnonzero(over & (marked.episode_partial == "corrupt"))
    assert rows.size and (marked.episode_partial[~over] == "").all()
    rec.close()
    held = {0: list(range(6)), 1: list(range(4))}
    # Chunk 1 of worker 1 holds zeros: no episode over it reaches the store or the dataset's
    # default read, as if it were a hole.
    return server, Outcome(session, held, seen=told.value, store={0: held[0], 1: [0, 2, 3]})


def _refused_record(bench: Bench, session: str, spoil) -> tuple[RestartableServer, Outcome]:
    """A worker's record() of chunk 3, spoiled, between good ones."""
    server = bench.shared
    rec = recorder(server, session, 0)
    send(rec, 0, range(3))
    arrays, states = chunk(0, 3)
    spoil(arrays)
    with pytest.raises(InvalidChunkError) as refused:
        rec.record(arrays, states, outcome=arrays.pop("outcome"))
    send(rec, 0, range(3, 6))  # the same sequence numbers go on: nothing was queued
    rec.close()
    return server, Outcome(session, {0: list(range(6))}, seen=refused.value)


def bad_shape(bench: Bench, session: str):
    return _refused_record(bench, session, lambda a: a.update(reward=a["reward"][:, :2]))


def changed_dtype(bench: Bench, session: str):
    return _refused_record(bench, session, lambda a: a.update(action=a["action"].astype(np.int32)))


def late_refusal(bench: Bench, session: str):
    server = bench.shared
    first = recorder(server, session, 0)
    send(first, 0, range(4))
    first.flush()
    other = recorder(server, session, 1)
    arrays, states = chunk(1, 0)
    arrays["action"] = arrays["action"].astype(np.int32)  # the session's are int64
    assert other.record(arrays, states, outcome=arrays.pop("outcome"))
    seen = None
    deadline = time.monotonic() + 30
    while seen is None and time.monotonic() < deadline:
        try:
            other.is_full  # noqa: B018 - a call of any kind raises the refusal
        except InvalidChunkError as exc:
            seen = exc
        time.sleep(0.05)
    other.close(timeout=5)
    send(first, 0, range(4, 7))
    first.close()
    return server, Outcome(session, {0: list(range(7))}, seen=seen)


def worker_id_in_use(bench: Bench, session: str):
    server = bench.shared
    first = recorder(server, session, 0)
    send(first, 0, range(4))
    first.flush()
    with pytest.raises(WorkerIdInUseError) as refused:
        recorder(server, session, 0)
    send(first, 0, range(4, 8))
    first.close()
    return server, Outcome(session, {0: list(range(8))}, seen=refused.value)


def overclaiming_join(bench: Bench, session: str):
    server = bench.shared
    live = recorder(server, session, 0)
    send(live, 0, range(3))
    live.flush()
    claim = pb.JoinRequest(
        session=session,
        config=live._config(),
        worker_id="w0",
        acked_sequence=10**6,
        instance_id="another",
    )
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.RecorderStub(channel).Join(claim, timeout=30)
    send(live, 0, range(3, 7))
    live.flush()
    assert live.status().sequences_lost == 0 and live.stats.sequences_lost == 0
    live.close()
    return server, Outcome(session, {0: list(range(7))}, seen=refused.value)


def drop_while_recording(bench: Bench, session: str, restart: bool = False):
    server = bench.own() if restart else bench.shared
    rec = recorder(server, session, 0, connect_timeout=10, reconnect_timeout=30)
    send(rec, 0, range(5))
    rec.flush()
    drop_session(server.address, session)
    if restart:
        server.kill()
        server.start()
    seen = None
    try:
        send(rec, 0, range(5, 7))
        rec.flush(timeout=30)
    except RecorderError as exc:
        seen = exc
    time.sleep(0.3)  # a reconnect, if any, would re-create the session by now
    again = recorder(server, session, 1)  # a new recorder: the session starts empty
    send(again, 1, range(4))
    again.close()
    rec.close(timeout=5)
    out = Outcome(
        session, {1: list(range(4))}, seen=seen, dataset={0: list(range(5)), 1: list(range(4))}
    )
    return server, out


def drop_then_kill_9(bench: Bench, session: str):
    return drop_while_recording(bench, session, restart=True)


SCENARIOS = {
    "kill-9": kill_9,
    "torn-unacked-tail": torn_unacked_tail,
    "torn-acked-tail": torn_acked_tail,
    "unexplained-loss": unexplained_loss,
    "corrupt-newest-checkpoint": corrupt_newest_checkpoint,
    "drop-then-corrupt-checkpoint": drop_then_corrupt_checkpoint,
    "previous-format-data-dir": previous_format_data_dir,
    "unary-call-during-restart": unary_call_during_restart,
    "zstd-bomb": zstd_bomb,
    "lying-size": lying_size,
    "corrupt-frame": corrupt_frame,
    "bad-shape": bad_shape,
    "changed-dtype": changed_dtype,
    "late-refusal": late_refusal,
    "worker-id-in-use": worker_id_in_use,
    "overclaiming-join": overclaiming_join,
    "drop-while-recording": drop_while_recording,
    "drop-then-kill-9": drop_then_kill_9,
}


def test_every_row_has_a_scenario():
    assert sorted(SCENARIOS) == sorted(row.key for row in ROWS)
    assert len({row.key for row in ROWS}) == len(ROWS)


@pytest.mark.slow  # the whole matrix: 25-60 s on 2 busy cores
@pytest.mark.parametrize("row", ROWS, ids=[row.key for row in ROWS])
def test_fault(bench: Bench, row: Row):
    logs_before = {id(s): len(s.log()) for s in bench.servers}
    server, out = SCENARIOS[row.key](bench, row.key)
    kind, message = seen_as(out.seen)
    assert kind == row.trainer, f"the trainer saw {kind}: {message}"
    assert row.told in message, message
    check_holdings(server, bench.uris[server.address], out)
    log = server.log()[logs_before.get(id(server), 0) :]
    if row.log is None:
        assert not [
            line for line in log.splitlines() if " WARNING " in line or " ERROR " in line
        ], log[-3000:]
    else:
        assert row.log in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


# -- the documented table --------------------------------------------------------------------


def documented_rows(text: str) -> list[tuple[str, str]]:
    """(fault, guarantee) of each row of the markdown table whose header is Fault | Guarantee."""
    lines = text.splitlines()
    for at, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["Fault", "Guarantee"]:
            rows = []
            for body in lines[at + 2 :]:
                if not body.strip().startswith("|"):
                    break
                rows.append(tuple(c.strip() for c in body.strip().strip("|").split("|"))[:2])
            return rows
    raise AssertionError(f"{DOCS}: no table with the header | Fault | Guarantee |")


def test_the_crash_safety_table_matches_the_fault_matrix():
    readme = (DOCS.parent.parent / "README.md").read_text()
    assert "(docs/crash-safety.md)" in readme, "README's crash-safety section links the table"
    documented = documented_rows(DOCS.read_text())
    assert documented == [(row.fault, row.guarantee) for row in ROWS], (
        f"{DOCS}'s table differs from tests/fault_matrix_rows.py (python "
        "tests/fault_matrix_rows.py --write puts the rows' table in); it should read:\n"
        + markdown_table()
    )
