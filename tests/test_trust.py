"""A real `rollout-recorder serve` against hostile input: bombs, edited states, bytes that do
not parse and torn logs. Each attack is refused (or handled) with the right code and a message
that names the field; the server's peak RSS (VmHWM, reset before each bomb) stays within 512
MiB of what it was; and afterwards a normal client still gets back exactly what it sent."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from recorder_client import (
    CellField,
    RolloutRecorder,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
    _launch,
)
from recorder_client._messages import file_parts, join_parts
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_server.durability import snapshot
from recorder_server.durability.checkpoint import decode_checkpoint, encode_checkpoint

MiB = 1 << 20
GiB = 1 << 30
RSS_BUDGET_MIB = 512
INVALID = grpc.StatusCode.INVALID_ARGUMENT
FIELDS = ["player_positions"]
CAPTURE = TrajectoryTrainingConfiguration(
    cell_fields=(CellField("player_positions", (0, 0), bucket=8, name="x"),),
    utilities=(UtilityConfig("win_proximity", gamma=0.9),),
)


# -- a watched server --------------------------------------------------------------------------


class Server:
    """`serve` on port 0 with its stderr in a file; its peak RSS can be reset and read."""

    def __init__(self, root: Path, *extra: str) -> None:
        self.data_dir = root / "data"
        self.log_path = root / "server.log"
        self.extra = extra
        self.process: _launch.ServerProcess | None = None
        self.start()

    def start(self) -> Server:
        with open(self.log_path, "a") as log:
            args = ["--listen", "127.0.0.1:0", "--data-dir", str(self.data_dir), *self.extra]
            self.process = _launch.ServerProcess(args, stderr=log)
        self.address = self.process.address
        self.channel = grpc.insecure_channel(
            self.address, options=[("grpc.max_send_message_length", 256 * MiB)]
        )
        self.stub = pb_grpc.RecorderStub(self.channel)
        return self

    def stop(self) -> None:
        self.channel.close()
        assert self.process is not None
        assert self.process.stop() == 0

    def kill(self) -> None:
        self.channel.close()
        assert self.process is not None
        self.process.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _status(self, key: str) -> int:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
        raise AssertionError(f"no {key} in /proc status")

    def reset_peak(self) -> int:
        """Reset VmHWM to the current RSS (MiB), which it returns."""
        assert self.process is not None
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")
        return self._status("VmRSS")

    def peak(self) -> int:
        return self._status("VmHWM")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("trust"), "--wal-fsync", "never")
    try:
        yield running
    finally:
        running.stop()
    assert "Traceback" not in running.log()


class watched:
    """Asserts that the block raises the server's peak RSS by less than the budget."""

    def __init__(self, server: Server, what: str) -> None:
        self.server, self.what = server, what

    def __enter__(self) -> None:
        self.base = self.server.reset_peak()

    def __exit__(self, *exc: object) -> None:
        grew = self.server.peak() - self.base
        print(f"{self.what}: peak RSS +{grew} MiB over {self.base} MiB")
        assert grew < RSS_BUDGET_MIB, f"{self.what}: peak RSS grew by {grew} MiB"


# -- messages ----------------------------------------------------------------------------------


def compressed_checkpoint(stored: bytes, declared: int) -> bytes:
    """Checkpoint bytes (durability/checkpoint.py's layout) whose zstd payload declares
    ``declared`` bytes."""
    head = struct.pack("<8sHHH", b"RRCKPT\r\n", 1, 1, 5) + b"0.1.0"
    head += struct.pack("<QQ32s", len(stored), declared, hashlib.sha256(stored).digest())
    return head + struct.pack("<I", zlib.crc32(head)) + stored


def zeros_frame(n: int) -> bytes:
    """A valid zstd frame of ``n`` zero bytes, 4 bytes per 128 KiB (RLE blocks): what a
    bomb sends."""
    out = [b"\x28\xb5\x2f\xfd", bytes([0xE0]), struct.pack("<Q", n)]
    full, rest = divmod(n, 1 << 17)
    sizes = [1 << 17] * full + ([rest] if rest or not full else [])
    for i, size in enumerate(sizes):
        last = int(i == len(sizes) - 1)
        out.append(((size << 3) | 2 | last).to_bytes(3, "little") + b"\0")
    return b"".join(out)


def zeros(dtype: str, shape: list[int], data: bytes | None = None) -> pb.ArrayData:
    raw = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=object))
    frame = zeros_frame(raw) if data is None else data
    return pb.ArrayData(dtype=dtype, shape=shape, raw_size=raw, codec=2, data=frame)


def chunk(t: int, n: int, *, action: pb.ArrayData | None = None, **states) -> pb.Chunk:
    return pb.Chunk(
        action=action or zeros("|u1", [t, n]),
        reward=zeros("<f4", [t, n]),
        done=zeros("|b1", [t, n]),
        states=[pb.NamedArray(name=k, array=v) for k, v in states.items()],
    )


def join(server: Server, session: str, *, capture: bool = False) -> None:
    config = pb.SessionConfig(record_states=True, state_fields=FIELDS)
    if capture:
        config.capture_config_json = json.dumps(CAPTURE.to_dict())
    server.stub.Join(pb.JoinRequest(session=session, worker_id="w", config=config), timeout=60)


_SENT: dict[str, int] = {}


def record(server: Server, session: str, *chunks: pb.Chunk) -> list[pb.RecordAck]:
    """Send chunks of worker "w" on one Record stream, numbered on from its last; their acks."""
    for c in chunks:
        c.sequence = _SENT[session] = _SENT.get(session, 0) + 1
    requests = [pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id="w"))]
    requests += [pb.RecordRequest(chunk=c) for c in chunks]
    return list(server.stub.Record(iter(requests), timeout=60))


def rejected(ack: pb.RecordAck, *fields: str) -> None:
    assert ack.result == pb.RecordAck.REJECTED, ack
    assert ack.error_code == "INVALID_ARGUMENT", ack
    for name in fields:
        assert name in ack.error_message, (name, ack.error_message)


def refused(call, code: grpc.StatusCode, *fields: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    details = info.value.details()
    for name in fields:
        assert name in details, (name, details)
    assert len(details) < 1200
    return details


_CHECKS = itertools.count()


def roundtrip(server: Server, session: str) -> None:
    """A normal client's record + finish returns exactly what it sent (its own episodes, in a
    session that may hold others)."""
    rng = np.random.default_rng(len(session))
    worker = f"check-{next(_CHECKS)}"
    sent = []
    with RolloutRecorder(target=server.address, session=session, worker_id=worker) as rec:
        for last in (False, True):
            c = {
                "action": rng.integers(0, 9, (4, 3)).astype(np.int32),
                "reward": rng.standard_normal((4, 3)).astype(np.float32),
                "done": np.zeros((4, 3), bool),
            }
            c["done"][-1] = last
            rec.record(c)
            sent.append(c)
        out = rec.finish()
    mine = out.episode_worker == list(out.worker_ids).index(worker)
    assert out.lengths[mine].tolist() == [8, 8, 8]
    for key, name in (("action", "actions"), ("reward", "rewards")):
        whole = np.concatenate([c[key] for c in sent]).T  # environment by environment
        got = getattr(out, name)[mine][:, :8]
        assert got.dtype == whole.dtype and np.array_equal(got, whole), name


# -- limits on what arrives --------------------------------------------------------------------


def test_chunk_bombs_are_refused_from_their_headers(server):
    join(server, "bombs")
    wide = [128, 64, 20 * MiB // 1024]  # 160 MiB of uint8
    attacks = {
        # 1 GiB of zeros in 32 KiB: refused before anything is decompressed.
        "a 1 GiB array": (chunk(1 << 15, 1 << 15), ["chunk.action.raw_size"]),
        # Each array under the cap, together over it.
        "arrays over the cap together": (
            chunk(128, 64, action=zeros("|u1", wide), player_positions=zeros("|u1", wide)),
            ["chunk.raw_size", "--max-chunk-mib"],
        ),
        # Tiny arrays, but a split that would cost gigabytes of bookkeeping.
        "too many env steps": (chunk(1, 40_000_000), ["chunk.action.shape", "env steps"]),
        "a million envs of nothing": (chunk(0, 100_000_000), ["shape"]),
        "overflowing shape": (
            chunk(0, 1, action=pb.ArrayData(dtype="|u1", shape=[0, 2**62, 2**62], codec=2)),
            ["chunk.action.shape"],
        ),
        "overflowing shape, raw size 0": (
            chunk(1, 1, action=pb.ArrayData(dtype="|u1", shape=[2**62, 2**62], codec=2)),
            ["chunk.action.raw_size"],
        ),
        "negative shape": (
            chunk(1, 1, action=pb.ArrayData(dtype="|u1", shape=[-1, 5], raw_size=0, codec=2)),
            ["chunk.action.shape"],
        ),
        "junk after the frame": (
            chunk(8, 2, action=zeros("|u1", [8, 2], zeros_frame(16) + b"\0" * (4 * MiB))),
            ["chunk.action.data", "after"],
        ),
        "a frame smaller than declared": (
            chunk(8, 2, action=zeros("|u1", [8, 2], zeros_frame(8))),
            ["chunk.action.data", "declares 8"],
        ),
        "a state field named at length": (
            chunk(1, 1, **{"x" * 10_000: zeros("|u1", [1, 1])}),
            ["chunk.states", "(10000 characters)"],
        ),
    }
    for what, (c, fields) in attacks.items():
        with watched(server, what):
            [ack] = record(server, "bombs", c)
        rejected(ack, *fields)
        assert len(ack.error_message) < 1200
        roundtrip(server, "checks")


def test_largest_default_chunk_is_taken_and_bounded(server):
    # T=128 steps of N=64 environments with 84x84x4 uint8 pixels: 231 MB, under 256 MiB.
    join(server, "pixels")
    pixels = chunk(128, 64, action=zeros("|u1", [128, 64, 84 * 84 * 4]))
    with watched(server, "a 231 MB chunk"):
        [ack] = record(server, "pixels", pixels)
    assert ack.result == pb.RecordAck.STORED, ack.error_message
    roundtrip(server, "after-pixels")


def test_episode_and_upload_bombs_are_refused(server):
    join(server, "store", capture=True)

    def episode(length: int, dtype: str = "|u1", trailing: tuple = ()) -> pb.EpisodeArrays:
        return pb.EpisodeArrays(
            actions=zeros(dtype, [length, *trailing]),
            rewards=zeros("<f4", [length]),
            states=[pb.NamedArray(name=FIELDS[0], array=zeros("<i4", [length, 1, 2]))],
        )

    def submit(ep: pb.EpisodeArrays):
        return lambda: server.stub.SubmitEpisode(
            pb.SubmitEpisodeRequest(session="store", episode=ep), timeout=60
        )

    def upload(method: str, data: bytes, *, size: int | None = None):
        parts = list(file_parts("store", "store.bin", data))
        if size is not None:
            parts[0].size = size
        return lambda: getattr(server.stub, method)(iter(parts), timeout=60)

    bombs = {
        "an 8 KiB episode declaring 1 GiB": (
            submit(episode(1 << 20, trailing=(1 << 10,))),
            ["episode.actions.raw_size"],
        ),
        "an episode of too many steps": (submit(episode(10_000_000)), ["episode", "env steps"]),
        "a 64 KiB state declaring 2 GiB": (
            upload("LoadRuntimeState", compressed_checkpoint(zeros_frame(2 * GiB), 2 * GiB)),
            ["runtime state", "declares 2147483648 bytes"],
        ),
        "a 2 KiB state declaring 64 MiB": (
            upload("LoadRuntimeState", compressed_checkpoint(zeros_frame(64 * MiB), 64 * MiB)),
            ["runtime state", "declares 67108864 bytes"],
        ),
        "a file declaring 4 GiB": (upload("LoadRuntimeState", b"", size=4 * GiB), ["file.size"]),
        "a store checkpoint inflating to 2 GiB": (
            upload("LoadStoreCheckpoint", encode_checkpoint(zeros_frame(2 * GiB), compress=False)),
            ["store checkpoint", "declares"],
        ),
    }
    for what, (call, fields) in bombs.items():
        with watched(server, what):
            refused(call, INVALID, *fields)
        roundtrip(server, "checks")


# -- right codes -------------------------------------------------------------------------------


def _garbage(rng: random.Random, parse) -> bytes:
    """Random bytes that do not parse as the message ``parse`` reads."""
    while True:
        data = rng.randbytes(rng.randrange(1, 64))
        try:
            parse(data)
        except Exception:
            return data


def _send(channel: grpc.Channel, path: str, method, data: bytes) -> object:
    """``data`` as the one request message of ``method``, whatever its kind."""
    if method.client_streaming and method.server_streaming:
        return list(channel.stream_stream(path)(iter([data]), timeout=10))
    if method.client_streaming:
        return channel.stream_unary(path)(iter([data]), timeout=10)
    if method.server_streaming:
        return list(channel.unary_stream(path)(data, timeout=10))
    return channel.unary_unary(path)(data, timeout=10)


def test_random_bytes_to_every_method_are_invalid_argument(server):
    rng = random.Random(19)
    service = pb.DESCRIPTOR.services_by_name["Recorder"]
    before = server.log().count("do not parse")
    calls = 0
    for method in service.methods:
        path = f"/{service.full_name}/{method.name}"
        parse = getattr(pb, method.input_type.name).FromString
        for _ in range(3):
            bad = _garbage(rng, parse)
            refused(lambda: _send(server.channel, path, method, bad), INVALID, "do not parse")  # noqa: B023
            calls += 1
    # A stream that opens well and then sends bytes that do not parse.
    join(server, "garbled")
    opened = pb.RecordRequest(open=pb.RecordOpen(session="garbled", worker_id="w"))
    call = server.channel.stream_stream(f"/{service.full_name}/Record")
    stream = [opened.SerializeToString(), b"\x0a\xff\xff\xff\xff\x0f"]
    refused(lambda: list(call(iter(stream), timeout=10)), INVALID, "RecordRequest")
    calls += 1
    log = server.log()
    assert log.count("do not parse") - before == calls  # one WARNING line per call
    assert "Traceback" not in log
    roundtrip(server, "after-garbage")


# -- validated restores ------------------------------------------------------------------------


def _state(server: Server, session: str) -> tuple[dict, list[bytes]]:
    parts = server.stub.GetRuntimeState(pb.RuntimeStateRequest(session=session), timeout=60)
    file = join_parts(parts)
    assert file is not None
    meta, blobs = snapshot.unpack(decode_checkpoint(file.data))
    return json.loads(json.dumps(meta)), [bytes(b) for b in blobs]


def _load(server: Server, target: str, meta: dict, blobs: list[bytes]):
    data = encode_checkpoint(snapshot.pack(meta, blobs), compress=False)
    parts = file_parts(target, f"{target}.state", data)
    return lambda: server.stub.LoadRuntimeState(iter(parts), timeout=60)


def test_edited_runtime_states_are_refused_by_field(server):
    roundtrip(server, "saved")
    meta, blobs = _state(server, "saved")

    def edit(fn) -> tuple[dict, list[bytes]]:
        copy = json.loads(json.dumps(meta))
        more = list(blobs)
        fn(copy, more)
        return copy, more

    def set_path(path: list, value) -> callable:
        def fn(m: dict, _b: list) -> None:
            node = m
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value

        return fn

    def huge_shape(m: dict, b: list) -> None:
        m["workers"][0]["chunks"][0]["arrays"]["action"]["shape"] = [10**6, 10**6]

    def bomb_chunk(m: dict, b: list) -> None:
        # Two arrays of 180 MiB in 12 KiB: each within the array limit, over it together.
        shape = [4, 3, 15 * MiB]
        b.append(zeros_frame(180 * MiB))
        arrays = m["workers"][0]["chunks"][0]["arrays"]
        arrays["action"].update(shape=shape, dtype="|u1", blob=len(b) - 1)
        arrays["state:player_positions"] = dict(arrays["action"])

    def junk_chunk(m: dict, b: list) -> None:
        spec = m["workers"][0]["chunks"][0]["arrays"]["reward"]
        b[spec["blob"]] = b[spec["blob"]] + b"junk"

    def bad_env(m: dict, b: list) -> None:
        spec = m["workers"][0]["table"][0]
        b[spec["blob"]] = np.full(len(b[spec["blob"]]) // 8, 99, np.int64).tobytes()

    cases = {
        "a counter named lock": (set_path(["counters", "lock"], 1), "state.counters"),
        "a counter of 2**70": (
            set_path(["counters", "env_steps"], 2**70),
            "state.counters.env_steps",
        ),
        "a capture counter of 2**70": (
            set_path(["capture_runtime", "counters", "episodes_captured"], 2**70),
            "state.capture_runtime.counters.episodes_captured",
        ),
        "a capture counter named lock": (
            set_path(["capture_runtime", "counters", "lock"], 1),
            "state.capture_runtime.counters",
        ),
        "a worker id with NUL": (
            set_path(["workers", 0, "id"], "a\x00b"),
            "worker_id",
        ),
        "an object dtype in the schema": (
            set_path(["schema", "action"], ["|O", []]),
            "state.schema['action'].dtype",
        ),
        "a shape its blob does not hold": (huge_shape, "chunks[0].action.raw_size"),
        "a chunk frame declaring 1 GiB": (bomb_chunk, "chunks[0].raw_size"),
        "junk after a chunk frame": (junk_chunk, "chunks[0].reward.data"),
        "a chunk out of place": (set_path(["workers", 0, "chunks", 1, "t0"], 99), "chunks[1]"),
        "an episode of env 99": (bad_env, "table"),
        "a blob index out of range": (
            set_path(["workers", 0, "chunks", 0, "arrays", "done", "blob"], -1),
            "chunks[0].done.blob",
        ),
        "a chunk sequence of -1": (
            set_path(["workers", 0, "chunks", 0, "sequence"], -1),
            "state.sequence",
        ),
        "a message about zeros that is not text": (
            set_path(["workers", 0, "chunks", 0, "corrupt"], [7]),
            "chunks[0].corrupt",
        ),
        "more messages about zeros than frames": (
            set_path(["workers", 0, "chunks", 0, "corrupt"], ["x"] * 99),
            "chunks[0].corrupt",
        ),
        "a message about zeros of 1 MB": (
            set_path(["workers", 0, "chunks", 0, "corrupt"], ["x" * 10**6]),
            "chunks[0].corrupt",
        ),
    }
    for what, (fn, field) in cases.items():
        edited, more = edit(fn)
        with watched(server, what):
            refused(_load(server, "saved", edited, more), INVALID, "runtime state", field)
        roundtrip(server, "checks")
    for name in ("../../etc", "a\x00b"):
        edited, more = edit(set_path(["name"], name))
        refused(_load(server, name, edited, more), INVALID, "session")
        roundtrip(server, "checks")
    # The unedited state loads, and the session is as it was.
    _load(server, "saved", meta, blobs)()
    roundtrip(server, "after-restores")
    assert server.stub.GetMetrics(pb.MetricsRequest(), timeout=30).uptime_s > 0


def test_a_state_whose_open_episode_spans_many_big_chunks_is_loaded_within_bounds(server):
    """A few KB of state can name a hundred chunks of 2M env steps each, all of one open
    episode (every chunk refers to the same small blobs): loading it decodes only the
    newest chunks the store's tail budget holds, not all of them."""
    join(server, "tail", capture=True)
    t, n = 128, 16384
    with watched(server, "one chunk of 2M env steps"):
        record(server, "tail", chunk(t, n, player_positions=zeros("<i4", [t, n, 2])))
    meta, blobs = _state(server, "tail")
    worker = next(w for w in meta["workers"] if w["id"] == "w")
    first = worker["chunks"][0]
    worker["chunks"] = [{**first, "t0": i * t} for i in range(120)]
    worker["t_total"] = 120 * t
    meta["counters"]["num_recorded_steps"] = 120 * t
    meta["counters"]["env_steps"] = 120 * t * n
    meta["counters"]["chunks_stored"] = 120
    meta["name"] = "tail-loaded"
    size = len(snapshot.pack(meta, blobs))
    with watched(server, f"a {size // 1024} KiB state of 120 such chunks"):
        _load(server, "tail-loaded", meta, blobs)()
    # (A finish of that session would be 16,384 episodes of 15,360 steps: not a check.)
    roundtrip(server, "after-tail")


def test_states_beyond_the_session_and_worker_caps_are_refused(tmp_path):
    server = Server(tmp_path, "--max-sessions", "2", "--max-workers", "2", "--no-wal")
    try:
        roundtrip(server, "one")
        meta, blobs = _state(server, "one")
        roundtrip(server, "two")
        # A new session past --max-sessions: refused like any other invalid state (a drop
        # makes room).
        meta["name"] = "three"
        refused(_load(server, "three", meta, blobs), INVALID, "state.name", "at most 2 sessions")
        # A state with more active workers than this server allows: never loadable here.
        meta["name"] = "two"
        workers = json.loads(json.dumps(meta))
        worker = workers["workers"][0]
        for i in range(3):
            extra = {k: v for k, v in worker.items() if k not in ("open_start", "feeder")}
            extra.update(id=f"x{i}", index=i + 1, chunks=[], num_envs=None)
            workers["workers"].append(extra)
        workers["lifecycle"]["active"] = [w["id"] for w in workers["workers"]]
        refused(_load(server, "two", workers, blobs), INVALID, "state.lifecycle.active")
        _load(server, "two", meta, blobs)()  # replacing one is no new session
        roundtrip(server, "two")
    finally:
        server.stop()
    assert "Traceback" not in server.log()


# -- write-ahead log recovery messages ---------------------------------------------------------


def _records(segment: Path) -> list[tuple[int, int]]:
    """(offset, index) of each record in a log segment (see durability/wal.py)."""
    data = segment.read_bytes()
    out, offset = [], 24
    while offset + 24 <= len(data):
        _, length, index, _, _ = struct.unpack_from("<4sIQII", data, offset)
        out.append((offset, index))
        offset += 24 + length
    return out


def _record_some(server: Server, session: str) -> None:
    with RolloutRecorder(target=server.address, session=session, worker_id="w") as rec:
        for _ in range(3):
            rec.record(
                {
                    "action": np.ones((4, 2), np.int32),
                    "reward": np.ones((4, 2), np.float32),
                    "done": np.zeros((4, 2), bool),
                }
            )
        rec.flush()


@pytest.mark.parametrize("damage", ["torn", "bad header crc"])
def test_wal_recovery_says_exactly_what_was_dropped_once(tmp_path, damage):
    server = Server(tmp_path, "--wal-fsync", "always", "--checkpoint-every", "0")
    _record_some(server, "logged")
    server.kill()
    [segment] = sorted((server.data_dir / "wal").glob("wal-*.log"))
    offset, index = _records(segment)[-1]
    with open(segment, "r+b") as fh:
        if damage == "torn":
            fh.truncate(offset + 30)  # mid-way through the last record's body
        else:
            fh.seek(offset)
            fh.write(b"\xab" * 24)  # its header, as a power cut may leave it
    before = len(server.log())
    server.start()
    first = server.log()[before:]
    if damage == "torn":
        assert f"dropped a torn log tail: 1 record(s) (index {index})" in first
    else:
        assert f"the record at index {index} and any after it" in first
        assert "(at most 1)" in first
    assert "None" not in first
    # Later starts, after a crash or a clean stop, report nothing lost.
    for stop in (server.kill, server.stop):
        _record_some(server, "logged")
        stop()
        before = len(server.log())
        server.start()
        later = server.log()[before:]
        for word in ("lost", "corrupt", "torn", "dropped"):
            assert word not in later, later
    roundtrip(server, "after-wal")
    server.stop()
    assert "Traceback" not in server.log()
