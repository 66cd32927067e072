"""Fuzzing every RPC of the Recorder service against one live `rollout-recorder serve`.

Hypothesis builds the requests of every method in the service descriptor, as bytes, in four
kinds:

- ``valid``: well-formed messages with consistent content (a Join before each Record stream,
  chunks that match their session, files fetched from the server itself);
- ``mutated``: a valid example with one to three things changed: any field of any message set
  to a hostile value for its type (names like ``../../etc``, ``a\\x00b`` or 10,000
  characters; dtypes; shapes such as ``[2**62, 2**62]``; raw sizes and sequence numbers up to
  2**64-1; unknown codecs; data cut short, with junk after it, or a zstd frame that declares
  a huge size), stream messages dropped, repeated or swapped, or a runtime state or store
  checkpoint edited inside and re-wrapped with a correct checksum;
- ``corrupted``: a valid example's serialized bytes with bytes flipped, cut or inserted, or
  wire-level additions (invalid UTF-8 in a string field, a wrong wire type, a length prefix
  far past the end);
- ``random``: random bytes.

Nothing may end as INTERNAL or UNKNOWN, nor as DEADLINE_EXCEEDED or UNAVAILABLE (the server
must refuse cheaply and stay up); no Record ack may carry INTERNAL or UNKNOWN; the server's
log may hold no traceback, and the server's peak RSS may not rise 512 MiB over what it was
before. Before and after the fuzzing, a normal client records a session and gets back
exactly what it sent, and the server answers its health check. Methods are read from the
service descriptor: one this file does not know yet gets its default message, with its
name fields set, as its valid example.

Failures are collected rather than raised inside Hypothesis (a shared server must not be
shrunk against), and reported together at the end, one line per distinct failure.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import zstandard
from conftest import RestartableServer
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from reference_model import ReferenceRecorder

from recorder_client import (
    CellField,
    RolloutRecorder,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_server.durability import snapshot
from recorder_server.durability.checkpoint import decode_checkpoint, encode_checkpoint
from recorder_server.workload import GRID, NUM_ACTIONS, NUM_ITEMS, SyntheticVecEnv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = 4000
ROUNDS = 4
CALL_TIMEOUT_S = 30.0
MAX_RSS_GROWTH = 512 << 20
SERVICE = pb.DESCRIPTOR.services_by_name["Recorder"]
METHODS = {m.name: m for m in SERVICE.methods}
FIELDS = ["player_positions", "player_inventory"]
CAPTURE = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0, 0), bucket=8, name="x"),
        CellField("player_positions", (0, 1), bucket=8, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.9),),
)

# The fuzzer's sessions: two made before it starts, two its Joins create. The sessions of
# the normal client are never named by the fuzzer.
PLAIN, STORE, NEW_PLAIN, NEW_STORE = "fz-plain", "fz-store", "fz-new-plain", "fz-new-store"
SESSIONS = (PLAIN, STORE, NEW_PLAIN, NEW_STORE)
WITH_STORE = (STORE, NEW_STORE)

# Outcomes that mean the server failed, not that it refused.
BAD_CODES = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
}
BAD_ACK_CODES = {"INTERNAL", "UNKNOWN"}
NAME_FIELDS = {"session", "worker_id"}

# fmt: off
HOSTILE_NAMES = [
    "", ".", "..", ".hidden", "../../etc", "a/b", "a\\b", "a\x00b", " ", "\n", "fz-plain\n",
    "ü" * 3, "x" * 129, "x" * 10_000, "%s%n", "*",
]
HOSTILE_DTYPES = [
    "", "<i4", "<i8", "|b1", "<f2", ">i4", "<u8", "<f8", "|u1", "|i1", "<c8", "O", "|O", "<U4",
    "|S4", "V8", "<M8[s]", "<m8[ns]", "<f16", "i4,i4", "[('a', '<i4')]", "(2,)i4", "(2**40,)i1",
    "<i4 ", "int", "float128", "\x00", "x" * 1000,
]
INT64 = [0, 1, -1, 2, 7, -(2**63), 2**63 - 1, 2**62, -(2**62), 2**31, 2**32]
UINT64 = [0, 1, 2, 7, 2**64 - 1, 2**63, 2**62, 2**40, 2**32, 2**31]
INT32 = [0, 1, -1, 4, 5, 7, 99, -5, 2**31 - 1, -(2**31)]
UINT32 = [0, 1, 2**32 - 1, 2**31, 1 << 20]
DOUBLES = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 2.0**70]
SHAPES = [
    [], [0], [-1], [-1, -1], [2**62, 2**62], [2**63 - 1], [2**63 - 1, 2], [2**31, 2**31],
    [2**20, 2**20], [1 << 15, 1 << 15], [0, 2**62], [1] * 33, [1] * 64, [3, 0, 2**62],
]
JSON_VALUES = [
    None, -1, 2**70, 2**63, 1.5, math.nan, "", "lock", "../../etc", "a\x00b", [], {}, True,
    "x" * 5000,
]
# Kinds of example, cycled with the methods so that every method gets each kind.
KINDS = ["valid", "valid", "mutated", "mutated", "mutated", "corrupted", "random", "random"]
# fmt: on


def zstd_header_declaring(size: int, payload: bytes = b"\0" * 64) -> bytes:
    """A zstd frame whose header declares `size` content bytes, followed by one raw block of
    `payload`: the kind of frame a decoder must not trust for its allocation."""
    magic = struct.pack("<I", 0xFD2FB528)
    descriptor = bytes([0b1110_0000])  # 8-byte content size, single segment, no checksum
    block = (len(payload) << 3) | 1  # last block, raw
    return magic + descriptor + struct.pack("<Q", size) + block.to_bytes(3, "little") + payload


# -- calls ------------------------------------------------------------------------------------


@dataclass
class Call:
    method: str
    messages: list[bytes]


@dataclass
class Example:
    method: str
    kind: str
    calls: list[Call]
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        for call in self.calls:
            heads = ", ".join(
                repr(m[:48]) + ("…" if len(m) > 48 else "") for m in call.messages[:3]
            )
            more = f" +{len(call.messages) - 3} more" if len(call.messages) > 3 else ""
            parts.append(f"{call.method}[{heads}{more}]")
        notes = "; ".join(self.notes)
        return f"{self.kind}: {' then '.join(parts)}" + (f" ({notes})" if notes else "")


def invoke(channel: grpc.Channel, call: Call) -> tuple[grpc.StatusCode, str, list[str]]:
    """Send raw bytes to one method; its final status, its details, and for Record each
    ack's result and error code ("STORED", "REJECTED INVALID_ARGUMENT", ...)."""
    method = METHODS[call.method]
    path = f"/{SERVICE.full_name}/{method.name}"
    ack_codes: list[str] = []
    try:
        if method.client_streaming and method.server_streaming:
            stream = channel.stream_stream(
                path, request_serializer=None, response_deserializer=None
            )
            for raw in stream(iter(call.messages), timeout=CALL_TIMEOUT_S):
                if call.method == "Record":
                    ack = pb.RecordAck.FromString(raw)
                    result = pb.RecordAck.Result.Name(ack.result)
                    ack_codes.append(f"{result} {ack.error_code}".strip())
        elif method.client_streaming:
            upload = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            upload(iter(call.messages), timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            download = channel.unary_stream(
                path, request_serializer=None, response_deserializer=None
            )
            for _ in download(call.messages[0], timeout=CALL_TIMEOUT_S):
                pass
        else:
            unary = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            unary(call.messages[0], timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", ack_codes
    return grpc.StatusCode.OK, "", ack_codes


# -- valid messages ---------------------------------------------------------------------------


def session_config(session: str) -> pb.SessionConfig:
    if session in WITH_STORE:
        return pb.SessionConfig(
            record_states=True,
            state_fields=FIELDS,
            capture_config_json=json.dumps(CAPTURE.to_dict(), sort_keys=True),
        )
    return pb.SessionConfig()


def array_data(arr: np.ndarray, codec: int) -> pb.ArrayData:
    arr = np.ascontiguousarray(arr)
    raw = arr.tobytes()
    if codec == pb.CODEC_ZSTD:
        raw = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    return pb.ArrayData(
        dtype=arr.dtype.str, shape=arr.shape, raw_size=arr.nbytes, codec=codec, data=raw
    )


def step_arrays(rng: np.random.Generator, lead: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {
        "action": rng.integers(0, NUM_ACTIONS, lead, dtype=np.int32),
        "reward": rng.standard_normal(lead).astype(np.float32),
        "player_positions": rng.integers(0, GRID, (*lead, 1, 2), dtype=np.int32),
        "player_inventory": rng.integers(0, 4, (*lead, 1, NUM_ITEMS), dtype=np.int32),
    }


@st.composite
def chunks(draw, session: str) -> list[pb.Chunk]:
    num_envs = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for sequence in range(1, draw(st.integers(1, 3)) + 1):
        steps = draw(st.integers(1, 8))
        codec = draw(st.sampled_from([pb.CODEC_RAW, pb.CODEC_ZSTD]))
        arrays = step_arrays(rng, (steps, num_envs))
        done = rng.random((steps, num_envs)) < 0.3
        chunk = pb.Chunk(
            sequence=sequence,
            action=array_data(arrays["action"], codec),
            reward=array_data(arrays["reward"], codec),
            done=array_data(done, codec),
        )
        if draw(st.booleans()):
            codes = np.where(done, rng.integers(1, 5, done.shape), 0).astype(np.int8)
            chunk.outcome.CopyFrom(array_data(codes, codec))
        if session in WITH_STORE:
            for name in FIELDS:
                chunk.states.append(pb.NamedArray(name=name, array=array_data(arrays[name], codec)))
        out.append(chunk)
    return out


@st.composite
def episode_arrays(draw) -> pb.EpisodeArrays:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    codec = draw(st.sampled_from([pb.CODEC_RAW, pb.CODEC_ZSTD]))
    arrays = step_arrays(rng, (draw(st.integers(1, 16)),))
    return pb.EpisodeArrays(
        actions=array_data(arrays["action"], codec),
        rewards=array_data(arrays["reward"], codec),
        states=[pb.NamedArray(name=n, array=array_data(arrays[n], codec)) for n in FIELDS],
    )


def file_messages(session: str, name: str, data: bytes) -> list[pb.FilePart]:
    parts = [pb.FilePart(session=session, name=name, size=len(data), sha256=sha256(data))]
    step = 1 << 20
    for offset in range(0, max(len(data), 1), step):
        if offset:
            parts.append(pb.FilePart())
        parts[-1].data = data[offset : offset + step]
    return parts


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Files:
    """Files fetched from the server before the fuzzing: valid uploads."""

    runtime_states: dict[str, bytes]
    store_checkpoint: tuple[str, bytes]


FILES: Files | None = None  # set by the test before Hypothesis runs
FRESH = itertools.count()


@st.composite
def valid_messages(draw, method: str) -> list[tuple[str, list]]:
    """[(method, [message, ...]), ...] of one valid example."""
    session = draw(st.sampled_from(SESSIONS))
    store_session = draw(st.sampled_from(WITH_STORE))
    # Mostly a new worker (its chunks reach the checks behind the sequence numbers), else one
    # of a few that already exist.
    # Fixed width: a replayed example draws the same byte offsets whatever the counter says.
    worker = f"fw-{next(FRESH):09d}" if draw(st.booleans()) else f"fw-old-{draw(st.integers(0, 3))}"
    assert FILES is not None
    if method == "Join":
        return [
            (
                "Join",
                [pb.JoinRequest(session=session, config=session_config(session), worker_id=worker)],
            )
        ]
    if method == "Record":
        join = pb.JoinRequest(session=session, config=session_config(session), worker_id=worker)
        opening = pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id=worker))
        stream = [opening] + [pb.RecordRequest(chunk=c) for c in draw(chunks(session))]
        return [("Join", [join]), ("Record", stream)]
    if method == "Finish":
        request = pb.FinishRequest(
            session=session,
            pad_incomplete=draw(st.booleans()),
            max_part_bytes=draw(st.sampled_from([0, 64, 4096, 4 << 20])),
        )
        return [("Finish", [request])]
    if method == "Reset":
        return [("Reset", [pb.ResetRequest(session=session)])]
    if method == "GetStatus":
        return [("GetStatus", [pb.StatusRequest(session=session)])]
    if method == "GetMetrics":
        return [("GetMetrics", [pb.MetricsRequest()])]
    if method == "Checkpoint":
        return [("Checkpoint", [pb.CheckpointRequest()])]
    if method == "SubmitEpisode":
        request = pb.SubmitEpisodeRequest(
            session=store_session,
            episode=draw(episode_arrays()),
            episode_data={"return": draw(st.floats(-10, 10))},
            step=draw(st.integers(0, 10**6)),
            outcome=draw(st.integers(0, 4)),
        )
        if draw(st.booleans()):
            request.start_reference.CopyFrom(
                pb.SliceReference(
                    trajectory_id=draw(st.integers(0, 5)), step=draw(st.integers(0, 5))
                )
            )
        return [("SubmitEpisode", [request])]
    if method == "SampleStart":
        return [("SampleStart", [pb.SampleStartRequest(session=store_session)])]
    if method == "SnapshotPotential":
        names = draw(st.sampled_from([["x", "y"], ["x"], ["y"], []]))
        request = pb.SnapshotPotentialRequest(
            session=store_session, utility_key="win_proximity", field_names=names
        )
        return [("SnapshotPotential", [request])]
    if method == "GetStoreCheckpoint":
        request = pb.StoreCheckpointRequest(
            session=store_session,
            compress=draw(st.booleans()),
            checkpoint_step=draw(st.integers(0, 10**6)),
        )
        return [("GetStoreCheckpoint", [request])]
    if method == "LoadStoreCheckpoint":
        name, data = FILES.store_checkpoint
        return [("LoadStoreCheckpoint", file_messages(store_session, name, data))]
    if method == "GetRuntimeState":
        return [("GetRuntimeState", [pb.RuntimeStateRequest(session=session)])]
    if method == "LoadRuntimeState":
        target = draw(st.sampled_from(sorted(FILES.runtime_states)))
        data = FILES.runtime_states[target]
        return [("LoadRuntimeState", file_messages(target, f"{target}.state", data))]
    # A method this test does not know yet: its default message, with every string field
    # that names a session set to one of the fuzzer's.
    cls = message_factory.GetMessageClass(METHODS[method].input_type)
    msg = cls()
    for fd in cls.DESCRIPTOR.fields:
        if fd.type == FieldDescriptor.TYPE_STRING and not fd.is_repeated:
            setattr(msg, fd.name, session if "session" in fd.name or fd.name == "name" else worker)
    return [(method, [msg])]


# -- mutations --------------------------------------------------------------------------------


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry


def _slots(msg, depth: int = 0) -> list[tuple[object, FieldDescriptor]]:
    """Every (message, field) reachable in `msg`: the places a mutation can hit."""
    out = []
    for fd in msg.DESCRIPTOR.fields:
        out.append((msg, fd))
        if fd.type != FieldDescriptor.TYPE_MESSAGE or _is_map(fd) or depth >= 4:
            continue
        if fd.is_repeated:
            for sub in getattr(msg, fd.name):
                out.extend(_slots(sub, depth + 1))
        elif msg.HasField(fd.name):
            out.extend(_slots(getattr(msg, fd.name), depth + 1))
    return out


def hostile_bytes(draw, data: bytes) -> tuple[bytes, str]:
    how = draw(
        st.sampled_from(
            ["cut", "junk", "much-junk", "empty", "random", "flip", "zstd-of-other", "zstd-huge"]
        )
    )
    if how == "cut":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))], "data cut short"
    if how == "junk":
        return data + draw(st.binary(min_size=1, max_size=64)), "junk after data"
    if how == "much-junk":
        return data + b"\xab" * (1 << 20), "1 MiB of junk after data"
    if how == "empty":
        return b"", "data empty"
    if how == "random":
        return draw(st.binary(max_size=256)), "data random"
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :], f"data byte {at} flipped"
    if how == "zstd-of-other":
        other = draw(st.binary(max_size=128))
        return zstandard.ZstdCompressor().compress(other), "a zstd frame of other bytes"
    size = draw(st.sampled_from([2**64 - 1, 2**62, 2**40, 2**31, 2**30]))
    return zstd_header_declaring(size), f"zstd frame declaring {size} bytes"


def set_hostile(draw, msg, fd: FieldDescriptor) -> str:
    """Set one field of `msg` to a hostile value for its type; returns what was done."""
    name = fd.name
    if _is_map(fd):
        entries = getattr(msg, name)
        key = draw(st.one_of(st.sampled_from(HOSTILE_NAMES), st.text(max_size=20)))
        value = draw(st.sampled_from(DOUBLES))
        entries[key] = value
        return f"{name}[{key[:20]!r}] = {value}"
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        if fd.is_repeated:
            items = getattr(msg, name)
            how = draw(st.sampled_from(["clear", "duplicate", "add-empty"]))
            if how == "clear":
                del items[:]
            elif how == "duplicate" and len(items):
                items.add().CopyFrom(items[draw(st.integers(0, len(items) - 1))])
            else:
                items.add()
            return f"{name}: {how}"
        if draw(st.booleans()):
            msg.ClearField(name)
            return f"{name} cleared"
        getattr(msg, name).Clear()
        getattr(msg, name).SetInParent()
        return f"{name} set empty"
    if fd.is_repeated:
        if fd.type == FieldDescriptor.TYPE_STRING:
            values = draw(st.lists(st.sampled_from(HOSTILE_NAMES + ["x", "y"]), max_size=40))
        elif fd.type in (FieldDescriptor.TYPE_INT64,):
            values = draw(
                st.one_of(st.sampled_from(SHAPES), st.lists(st.sampled_from(INT64), max_size=8))
            )
        elif fd.type == FieldDescriptor.TYPE_UINT32:
            values = draw(st.lists(st.sampled_from(UINT32), max_size=8))
        elif fd.type == FieldDescriptor.TYPE_DOUBLE:
            values = draw(st.lists(st.sampled_from(DOUBLES), max_size=8))
        elif fd.type == FieldDescriptor.TYPE_BOOL:
            values = draw(st.lists(st.booleans(), max_size=8))
        else:
            values = draw(st.lists(st.sampled_from(UINT64), max_size=8))
        getattr(msg, name)[:] = values
        return f"{name} = {str(values)[:80]}"
    if fd.type == FieldDescriptor.TYPE_STRING:
        pool = HOSTILE_DTYPES if name == "dtype" else HOSTILE_NAMES + list(SESSIONS)
        if name == "sha256":
            pool = ["", "0" * 64, "z" * 64, sha256(b"")]
        value = draw(st.one_of(st.sampled_from(pool), st.text(max_size=40)))
        setattr(msg, name, value)
        return f"{name} = {value[:40]!r}"
    if fd.type == FieldDescriptor.TYPE_BYTES:
        value, what = hostile_bytes(draw, getattr(msg, name))
        setattr(msg, name, value)
        return f"{name}: {what}"
    if fd.type == FieldDescriptor.TYPE_BOOL:
        setattr(msg, name, not getattr(msg, name))
        return f"{name} flipped"
    pool = {
        FieldDescriptor.TYPE_INT64: INT64,
        FieldDescriptor.TYPE_UINT64: UINT64,
        FieldDescriptor.TYPE_INT32: INT32,
        FieldDescriptor.TYPE_ENUM: INT32,
        FieldDescriptor.TYPE_UINT32: UINT32,
        FieldDescriptor.TYPE_DOUBLE: DOUBLES,
    }[fd.type]
    value = draw(st.sampled_from(pool))
    setattr(msg, name, value)
    return f"{name} = {value}"


def mutate_array(draw, arr: pb.ArrayData) -> str:
    """Change an ArrayData so that its header and data disagree, or declare a huge size."""
    how = draw(
        st.sampled_from(
            [
                "dtype",
                "shape",
                "huge-consistent",
                "overflow",
                "raw-size",
                "codec",
                "data",
                "same-size-dtype",
            ]
        )
    )
    if how == "dtype":
        arr.dtype = draw(st.sampled_from(HOSTILE_DTYPES))
        return f"array dtype {arr.dtype[:30]!r}"
    if how == "shape":
        arr.shape[:] = draw(st.sampled_from(SHAPES))
        return f"array shape {list(arr.shape)}"
    if how == "huge-consistent":
        # A header that checks out, declaring a size the data cannot hold.
        shape = draw(st.sampled_from([[1 << 15, 1 << 15], [1 << 20, 1 << 20], [1 << 31, 4]]))
        arr.dtype, arr.shape[:] = "|i1", shape
        arr.raw_size = math.prod(shape)
        if draw(st.booleans()):
            arr.codec, arr.data = pb.CODEC_ZSTD, zstd_header_declaring(arr.raw_size)
        return f"array |i1 {shape} with raw_size {arr.raw_size}, codec {arr.codec}"
    if how == "overflow":
        arr.shape[:] = draw(st.sampled_from([[2**62, 2**62], [2**63 - 1, 2**63 - 1], [2**32] * 3]))
        arr.raw_size = draw(st.sampled_from([0, 2**64 - 1, (math.prod(arr.shape) * 4) % 2**64]))
        return f"array shape {list(arr.shape)} raw_size {arr.raw_size}"
    if how == "raw-size":
        # raw_size may already be the largest uint64 (an earlier mutation of this array).
        bigger = min(arr.raw_size + 1, 2**64 - 1)
        arr.raw_size = draw(st.sampled_from([0, 1, bigger, max(arr.raw_size - 1, 0), *UINT64]))
        return f"array raw_size {arr.raw_size}"
    if how == "codec":
        arr.codec = draw(st.sampled_from([0, 3, 4, 8, 9, 99, -1, 2**31 - 1, 3 - arr.codec]))
        return f"array codec {arr.codec}"
    if how == "same-size-dtype":
        itemsize = np.dtype(arr.dtype).itemsize if arr.dtype in ("<i4", "<f4", "|b1", "|i1") else 4
        arr.dtype = {1: "|u1", 4: "<u4"}.get(itemsize, "<u4")
        return f"array dtype {arr.dtype} of the same size"
    value, what = hostile_bytes(draw, arr.data)
    arr.data = value
    return f"array data: {what}"


def mutate_json(draw, node, depth: int = 0):
    """`node` (a JSON value) with one place in it replaced by a hostile value."""
    hostile = st.sampled_from(JSON_VALUES)
    if isinstance(node, dict) and node and depth < 6:
        key = draw(st.sampled_from(sorted(node)))
        how = draw(st.sampled_from(["into", "replace", "delete", "add"]))
        out = dict(node)
        if how == "into":
            out[key] = mutate_json(draw, node[key], depth + 1)
        elif how == "replace":
            out[key] = draw(hostile)
        elif how == "delete":
            del out[key]
        else:
            out[draw(st.sampled_from(["lock", "__class__", "../x", "extra"]))] = draw(hostile)
        return out
    if isinstance(node, list) and node and depth < 6:
        at = draw(st.integers(0, len(node) - 1))
        how = draw(st.sampled_from(["into", "replace", "delete", "duplicate"]))
        out = list(node)
        if how == "into":
            out[at] = mutate_json(draw, node[at], depth + 1)
        elif how == "replace":
            out[at] = draw(hostile)
        elif how == "delete":
            del out[at]
        else:
            out.insert(at, node[at])
        return out
    return draw(hostile)


def mutate_file(draw, parts: list[pb.FilePart]) -> str:
    """Edit a streamed file: inside and re-wrapped with correct checksums, or its framing."""
    first = parts[0]
    data = b"".join(p.data for p in parts)
    how = draw(st.sampled_from(["inside", "inside", "payload", "framing"]))
    if how == "framing":
        return "file " + set_hostile(
            draw,
            first,
            first.DESCRIPTOR.fields_by_name[
                draw(st.sampled_from(["size", "sha256", "data", "name", "empty", "session"]))
            ],
        )
    try:
        payload = decode_checkpoint(data)
    except Exception:  # an earlier mutation broke its framing already
        payload = data
    try:
        meta, blobs = snapshot.unpack(payload)
    except ValueError:  # not a runtime state (a store payload), or broken already
        how = "payload"
    if how == "inside":
        meta = mutate_json(draw, meta)
        payload = snapshot.pack(meta, [bytes(b) for b in blobs])
        note = "runtime state edited inside"
    else:
        payload, what = hostile_bytes(draw, payload)
        note = f"file payload: {what}"
    framed = encode_checkpoint(payload, compress=draw(st.booleans()))
    parts[:] = file_messages(first.session, first.name, framed)
    return note + ", checksums correct"


def mutate_stream(draw, messages: list) -> str:
    how = draw(st.sampled_from(["drop", "duplicate", "swap", "empty"]))
    at = draw(st.integers(0, len(messages) - 1))
    if how == "drop" and len(messages) > 1:
        del messages[at]
        return f"stream message {at} dropped"
    if how == "swap" and len(messages) > 1:
        other = draw(st.integers(0, len(messages) - 1))
        messages[at], messages[other] = messages[other], messages[at]
        return f"stream messages {at} and {other} swapped"
    if how == "empty":
        messages.insert(at, type(messages[0])())
        return f"empty message inserted at {at}"
    messages.insert(at, messages[at])
    return f"stream message {at} repeated"


def _arrays(msg) -> list[pb.ArrayData]:
    found = []
    for parent, fd in _slots(msg):
        if fd.type == FieldDescriptor.TYPE_MESSAGE and not fd.is_repeated and not _is_map(fd):
            if fd.message_type.name == "ArrayData" and parent.HasField(fd.name):
                found.append(getattr(parent, fd.name))
    return found


def mutate(draw, calls: list[tuple[str, list]]) -> list[str]:
    """One to three changes to a valid example's messages; what was done, for the report."""
    notes = []
    for _ in range(draw(st.integers(1, 3))):
        method, messages = calls[draw(st.integers(0, len(calls) - 1))]
        msg = messages[draw(st.integers(0, len(messages) - 1))]
        # Names are checked first by every method: they get one share, the other fields two,
        # so that most changes reach the checks behind the names.
        slots = _slots(msg)
        names = [(p, fd) for p, fd in slots if fd.name in NAME_FIELDS]
        others = [(p, fd) for p, fd in slots if fd.name not in NAME_FIELDS]
        arrays = [a for m in messages for a in _arrays(m)]
        options = ["field", "field"] if others else []
        options += ["name"] if names else []
        if arrays:
            options += ["array", "array"]
        if method.startswith("Load"):
            options += ["file", "file"]
        if len(messages) > 1 or METHODS[method].client_streaming:
            options.append("stream")
        if not options:
            notes.append(f"{method}: no field to change")
            continue
        how = draw(st.sampled_from(options))
        if how == "array":
            notes.append(f"{method}: " + mutate_array(draw, draw(st.sampled_from(arrays))))
        elif how == "file":
            notes.append(f"{method}: " + mutate_file(draw, messages))
        elif how == "stream":
            notes.append(f"{method}: " + mutate_stream(draw, messages))
        else:
            parent, fd = draw(st.sampled_from(others if how == "field" else names))
            notes.append(f"{method}: " + set_hostile(draw, parent, fd))
    return notes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def corrupt(draw, data: bytes, desc) -> tuple[bytes, str]:
    """Serialized bytes damaged at the byte or wire level."""
    how = draw(
        st.sampled_from(["flip", "cut", "insert", "utf8", "wire-type", "long-length", "unknown"])
    )
    if how == "flip" and data:
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, len(out) - 1))
            out[at] = draw(st.integers(0, 255))
        return bytes(out), "bytes flipped"
    if how == "cut" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at], f"cut at byte {at} of {len(data)}"
    if how == "insert":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[
            at:
        ], f"bytes inserted at {at}"
    fields = list(desc.fields) or [None]
    fd = draw(st.sampled_from(fields))
    number = fd.number if fd is not None else 1
    if how == "utf8":
        strings = [f for f in desc.fields if f.type == FieldDescriptor.TYPE_STRING] or fields
        f = draw(st.sampled_from(strings))
        number = f.number if f is not None else 1
        bad = draw(st.sampled_from([b"\xff\xfe", b"\xc3", b"a\xed\xa0\x80b", b"\x80" * 4]))
        return data + _varint(number << 3 | 2) + _varint(
            len(bad)
        ) + bad, f"invalid UTF-8 in field {number}"
    if how == "wire-type":
        wire = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]))
        return data + _varint(number << 3 | wire) + b"\x01", f"field {number} with wire type {wire}"
    if how == "long-length":
        length = draw(st.sampled_from([2**31, 2**40, 2**63, 1 << 20]))
        return data + _varint(number << 3 | 2) + _varint(
            length
        ) + b"abc", f"field {number} length {length}"
    return data + _varint(9999 << 3 | 0) + _varint(2**63), "unknown field 9999"


@st.composite
def examples(draw, method: str, kind: str) -> Example:
    desc = METHODS[method].input_type
    if kind == "random":
        count = draw(st.integers(1, 3)) if METHODS[method].client_streaming else 1
        messages = draw(st.lists(st.binary(max_size=256), min_size=count, max_size=count))
        return Example(method, kind, [Call(method, messages)])
    calls = draw(valid_messages(method))
    notes = mutate(draw, calls) if kind == "mutated" else []
    raw = [Call(name, [m.SerializeToString() for m in messages]) for name, messages in calls]
    if kind == "corrupted":
        call = raw[-1]
        at = draw(st.integers(0, len(call.messages) - 1))
        call.messages[at], note = corrupt(draw, call.messages[at], desc)
        notes.append(f"{method} message {at}: {note}")
    return Example(method, kind, raw, notes)


# -- the normal client ------------------------------------------------------------------------


def normal_chunks(seed: int) -> list[tuple]:
    env = SyntheticVecEnv(4, seed=seed, done_prob=0.1)
    return [env.collect(16) for _ in range(6)]


def expected_of(chunks: list[tuple]) -> dict[str, np.ndarray]:
    ref = ReferenceRecorder(record_states=True, state_fields=FIELDS)
    for rollout, states in chunks:
        ref.record(rollout, states)
    return ref.finish()


def check_normal_session(address: str, session: str, seed: int, *, record: bool) -> None:
    """Record (or only read back) a normal session and compare it with what was sent."""
    chunks = normal_chunks(seed)
    with RolloutRecorder(
        record_states=True,
        state_fields=FIELDS,
        target=address,
        session=session,
        worker_id="normal",
        reconnect_timeout=10,
        rpc_timeout=60,
    ) as rec:
        if record:
            for rollout, states in chunks:
                rec.record(rollout, states)
        out = rec.finish()
    exp = expected_of(chunks)
    for name in ("actions", "rewards", "positions", "player_inventory", "lengths"):
        got = out.fields[name] if name != "lengths" else out.lengths
        assert got.shape == exp[name].shape, (session, name, got.shape, exp[name].shape)
        assert got.tobytes() == exp[name].tobytes(), (session, name)


# -- the test ---------------------------------------------------------------------------------


@dataclass
class Failure:
    method: str
    kind: str
    what: str
    example: str

    def key(self) -> tuple[str, str]:
        return self.method, re.sub(r"\d+", "N", self.what)[:140]


@dataclass
class Tally:
    failures: list[Failure] = field(default_factory=list)
    codes: Counter = field(default_factory=Counter)
    examples: int = 0
    server_died: str | None = None

    def report(self) -> str:
        lines = [f"{self.examples} examples; outcomes by (method, kind, status):"]
        for (method, kind, code), n in sorted(self.codes.items()):
            lines.append(f"  {method:20} {kind:10} {code:22} {n}")
        distinct: dict[tuple[str, str], list[Failure]] = {}
        for failure in self.failures:
            distinct.setdefault(failure.key(), []).append(failure)
        lines.append(f"{len(self.failures)} failures, {len(distinct)} distinct:")
        for (method, _), group in sorted(distinct.items()):
            first = group[0]
            lines.append(f"- {method} x{len(group)}: {first.what[:300]}")
            lines.append(f"    e.g. {first.example[:400]}")
        return "\n".join(lines)


class LogWatch:
    """New lines of the server's log since the last look."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new(self) -> str:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            text = fh.read()
        self.offset += len(text)
        return text.decode(errors="replace")


def traceback_summary(text: str) -> str:
    """The exception lines of each traceback in a log excerpt."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            before = lines[i - 1] if i else ""
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            last = lines[j] if j < len(lines) else "?"
            out.append(f"{before.strip()[-120:]} / {last.strip()[:200]}")
    return " | ".join(out)


@dataclass
class Context:
    channel: grpc.Channel
    server: RestartableServer
    watch: LogWatch
    tally: Tally


def run_example(example: Example, ctx: Context) -> None:
    tally = ctx.tally
    tally.examples += 1
    if tally.server_died:
        return
    for call in example.calls:
        code, details, ack_codes = invoke(ctx.channel, call)
        tally.codes[(call.method, example.kind, code.name)] += 1
        if code in BAD_CODES:
            what = f"{code.name}: {details[:200]}"
            tally.failures.append(Failure(call.method, example.kind, what, example.describe()))
        for ack_code in ack_codes:
            tally.codes[(call.method, example.kind, f"ack {ack_code}")] += 1
            if ack_code.split(" ")[-1] in BAD_ACK_CODES:
                what = f"ack {ack_code}"
                tally.failures.append(Failure(call.method, example.kind, what, example.describe()))
    logged = ctx.watch.new()
    if "Traceback" in logged:
        what = "traceback in the server log: " + traceback_summary(logged)
        tally.failures.append(Failure(example.method, example.kind, what, example.describe()))
    if not ctx.server.alive():
        tally.server_died = example.describe()


def fuzz_method(method: str, count: int, run) -> None:
    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.sampled_from(KINDS).flatmap(lambda kind: examples(method, kind)))
    def fuzz(example: Example) -> None:
        run(example)

    fuzz()


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def fetch_files(channel: grpc.Channel) -> Files:
    stub = pb_grpc.RecorderStub(channel)
    for session in SESSIONS[:2]:
        stub.Join(pb.JoinRequest(session=session, config=session_config(session), worker_id="seed"))
    rng = np.random.default_rng(7)
    for session in SESSIONS[:2]:
        lead = (6, 2)
        arrays = step_arrays(rng, lead)
        done = np.zeros(lead, dtype=bool)
        done[[2, 5], :] = True
        chunk = pb.Chunk(
            sequence=1,
            action=array_data(arrays["action"], pb.CODEC_ZSTD),
            reward=array_data(arrays["reward"], pb.CODEC_ZSTD),
            done=array_data(done, pb.CODEC_ZSTD),
            outcome=array_data(np.where(done, 1, 0).astype(np.int8), pb.CODEC_ZSTD),
        )
        if session in WITH_STORE:
            for name in FIELDS:
                chunk.states.append(
                    pb.NamedArray(name=name, array=array_data(arrays[name], pb.CODEC_ZSTD))
                )
        opening = pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id="seed"))
        acks = list(stub.Record(iter([opening, pb.RecordRequest(chunk=chunk)]), timeout=30))
        assert [a.result for a in acks] == [pb.RecordAck.STORED], acks
    states = {}
    for session in SESSIONS[:2]:
        parts = list(stub.GetRuntimeState(pb.RuntimeStateRequest(session=session), timeout=30))
        states[session] = b"".join(p.data for p in parts)
    parts = list(
        stub.GetStoreCheckpoint(pb.StoreCheckpointRequest(session=STORE, compress=True), timeout=30)
    )
    assert parts and not parts[0].empty
    return Files(states, (parts[0].name, b"".join(p.data for p in parts)))


def test_fuzz_every_rpc_against_a_live_server(tmp_path):
    global FILES
    server = RestartableServer(
        tmp_path / "data",
        # Room for the sessions the fuzzer's Joins create: a full server is not what we test.
        "--max-sessions",
        "4096",
        "--checkpoint-every",
        "5",
        "--grace",
        "1",
    ).start()
    channel = grpc.insecure_channel(
        server.address, options=[("grpc.max_receive_message_length", 256 << 20)]
    )
    tally = Tally()
    watch = LogWatch(server.log_path)
    ctx = Context(channel, server, watch, tally)
    try:
        check_normal_session(server.address, "normal-before", 1, record=True)
        FILES = fetch_files(channel)
        watch.new()
        baseline_rss = proc_memory(server.pid)["VmRSS"]

        # Rounds over every method, so that each gets its share of every kind of example and
        # later methods meet the state earlier ones left; Hypothesis draws the rest.
        per_run = -(-EXAMPLES // (ROUNDS * len(METHODS)))
        for round_ in range(ROUNDS):
            for method in random.Random(round_).sample(sorted(METHODS), len(METHODS)):
                fuzz_method(method, per_run, lambda example: run_example(example, ctx))
        memory = proc_memory(server.pid)
        print(tally.report())
        print(
            f"server RSS {baseline_rss >> 20} MiB before the fuzzing, peak {memory['VmHWM'] >> 20} MiB"
        )
        assert tally.server_died is None, f"the server died after: {tally.server_died}"
        assert tally.examples >= EXAMPLES
        methods_seen = {method for method, _, _ in tally.codes}
        assert methods_seen == set(METHODS), f"never called: {set(METHODS) - methods_seen}"

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        check_normal_session(server.address, "normal-before", 1, record=False)
        check_normal_session(server.address, "normal-after", 2, record=True)
        if tally.failures:
            pytest.fail(tally.report(), pytrace=False)
        # No call may cost the server more than a small multiple of its limits.
        assert memory["VmHWM"] - baseline_rss < MAX_RSS_GROWTH, memory
        assert "Traceback" not in server.log(), traceback_summary(server.log())
    finally:
        FILES = None
        channel.close()
        stop_code = server.stop(timeout=15)
        print(f"server stopped with exit status {stop_code}")
