"""The gRPC edge: one function chooses every status an RPC ends with, from a typed error."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import numpy as np
import pytest

from recorder_client import _wire
from recorder_client._credentials import make_channel
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_server.errors import ErrorKind, RequestError
from recorder_server.rpc import convert

SERVER = Path(__file__).resolve().parents[1] / "server"


def test_every_kind_has_one_status():
    expected = {
        ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
        ErrorKind.SEQUENCE_GAP: grpc.StatusCode.ABORTED,
        ErrorKind.UNKNOWN_SESSION: grpc.StatusCode.NOT_FOUND,
        ErrorKind.LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
        ErrorKind.STORAGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
        ErrorKind.NO_DATA: grpc.StatusCode.FAILED_PRECONDITION,
        ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    }
    for kind in ErrorKind:
        code, message, tag = convert.status_of(RequestError(kind, f"{kind.value}: why"))
        assert isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK
        assert message == f"{kind.value}: why" and tag == kind.value
        if kind in expected:
            assert code == expected[kind], kind
    code, message, tag = convert.status_of(KeyError("secret internals"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message and tag == "internal"


def _status_sites(path: Path) -> list[int]:
    """Lines of `path` that name a gRPC status code or end an RPC with abort()."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "StatusCode":
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "abort":
            # `writer.transport.abort()` closes an HTTP listener's socket: not an RPC's end.
            if getattr(node.func.value, "attr", "") != "transport":
                lines.append(node.lineno)
    return lines


def test_status_codes_are_named_in_convert_only():
    """Outside convert.py the server names no status code: each abort() takes the code that
    status_of chose (the two aborts: the servicer's and the token check's)."""
    sites = {}
    for path in sorted(SERVER.rglob("*.py")):
        if "cli" in path.parts:  # the health command reads codes it receives
            continue
        found = _status_sites(path)
        if found:
            sites[str(path.relative_to(SERVER))] = found
    named = {p for p, lines in sites.items() if p != "rpc/convert.py"}
    assert named == {"rpc/servicer.py", "rpc/security.py"}, sites
    for path in named:
        text = (SERVER / path).read_text()
        assert text.count(".abort(") == 1 and "StatusCode" not in text, path
        assert "status_of(" in text


def test_a_refusal_reaches_the_client_with_its_status_and_kind(target):
    with make_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetStatus(pb.StatusRequest(session="never-joined"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "never-joined" in caught.value.details()
        tags = dict(caught.value.trailing_metadata())
        assert tags[_wire.ERROR_KIND_KEY] == ErrorKind.UNKNOWN_SESSION.value
        stub.Join(pb.JoinRequest(session="edge", config=pb.SessionConfig(), worker_id="w"))
        chunk = pb.Chunk(sequence=2)
        for name, arr in (
            ("action", np.zeros((2, 2), np.int32)),
            ("reward", np.zeros((2, 2), np.float32)),
            ("done", np.zeros((2, 2), bool)),
        ):
            codec, data = _wire.encode(arr)
            getattr(chunk, name).CopyFrom(
                pb.ArrayData(
                    dtype=arr.dtype.str,
                    shape=arr.shape,
                    raw_size=arr.nbytes,
                    codec=codec,
                    data=data,
                )
            )
        opening = pb.RecordRequest(open=pb.RecordOpen(session="edge", worker_id="w"))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Record(iter([opening, pb.RecordRequest(chunk=chunk)]), timeout=10))
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "chunk.sequence: expected 1" in caught.value.details()
        tags = dict(caught.value.trailing_metadata())
        assert tags[_wire.ERROR_KIND_KEY] == ErrorKind.SEQUENCE_GAP.value


def test_wire_codec_values_match_the_proto():
    assert _wire.CODEC_RAW == pb.CODEC_RAW and _wire.CODEC_ZSTD == pb.CODEC_ZSTD
    assert {pb.Codec.Value(name): code for code, name in _wire.CODEC_NAMES.items()} == {
        code: code for code in _wire.CODEC_NAMES
    }
    assert set(pb.Codec.values()) == {0, *_wire.CODEC_NAMES}


def test_the_offload_pool_bounds_the_calls_in_flight():
    """At most `threads` calls run and `threads + queue` are taken at once; the rest wait on
    the loop (a coroutine each). A cancelled caller's slot comes back when its call ends."""
    import asyncio
    import threading

    from recorder_server.rpc.offload import Offload

    pool = Offload(2, 1, "test")
    running, taken, peak = 0, 0, {"running": 0}
    lock = threading.Lock()
    gate = threading.Event()

    def work(i: int) -> int:
        nonlocal running
        with lock:
            running += 1
            peak["running"] = max(peak["running"], running)
        gate.wait(10)
        with lock:
            running -= 1
        return i

    async def call(i: int) -> int:
        nonlocal taken
        result = await pool.run(work, i)
        taken += 1
        return result

    async def main() -> list[int]:
        tasks = [asyncio.ensure_future(call(i)) for i in range(10)]
        await asyncio.sleep(0.2)
        assert peak["running"] == 2 and taken == 0
        assert pool.in_flight == 3  # 2 running, 1 queued: the other 7 callers wait
        tasks[0].cancel()  # its call still runs to the end, then frees the slot
        gate.set()
        done = await asyncio.gather(*tasks[1:])
        return done

    try:
        assert asyncio.run(main()) == list(range(1, 10))
        assert peak["running"] == 2
    finally:
        pool.shutdown()
