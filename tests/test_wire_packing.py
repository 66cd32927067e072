"""Integer arrays travel packed into the narrowest type that holds their values, and come
back exactly: the codec each range picks, a real session's finish() with every integer
dtype, and the refusals of a packed codec that the header's dtype cannot hold or whose frame
declares the unpacked size."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from recorder_client import RolloutRecorder, _wire
from recorder_client._credentials import make_channel
from recorder_client._pending import PendingChunk, encode_chunk
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_server.chunks import encoded_array
from recorder_server.errors import RequestError

# (dtype, lowest and highest value, the codec they travel in)
CASES = [
    ("<i4", 0, 255, "CODEC_ZSTD_U8"),
    ("<i4", -128, 127, "CODEC_ZSTD_I8"),
    ("<i4", -1, 255, "CODEC_ZSTD_I16"),
    ("<i4", 0, 256, "CODEC_ZSTD_U16"),
    ("<i4", -32769, 0, "CODEC_ZSTD"),
    ("<i8", -32769, 0, "CODEC_ZSTD_I32"),
    ("<i8", 0, 2**32 - 1, "CODEC_ZSTD_U32"),
    ("<i8", -(2**31) - 1, 0, "CODEC_ZSTD"),
    ("<u8", 0, 2**64 - 1, "CODEC_ZSTD"),
    ("<u2", 0, 255, "CODEC_ZSTD_U8"),
    ("<i2", -129, 127, "CODEC_ZSTD"),
    (">i4", -5, 100, "CODEC_ZSTD_I8"),
    (">u8", 7, 65535, "CODEC_ZSTD_U16"),
    ("|u1", 0, 255, "CODEC_ZSTD"),
    ("|i1", -128, 127, "CODEC_ZSTD"),
]


def spread(dtype: str, lo: int, hi: int, shape=(64, 5, 3)) -> np.ndarray:
    """Values across [lo, hi], both ends included, in a fixed random order."""
    rng = np.random.default_rng(abs(lo) + hi % 1000)
    n = int(np.prod(shape))
    values = [lo, hi] + [lo + int(x * (hi - lo)) for x in rng.random(n - 2)]
    return np.array(values, dtype=object).astype(np.dtype(dtype)).reshape(shape)


@pytest.mark.parametrize(("dtype", "lo", "hi", "codec"), CASES)
def test_each_range_travels_in_the_narrowest_type_and_comes_back_exactly(dtype, lo, hi, codec):
    arr = spread(dtype, lo, hi)
    got_codec, data = _wire.encode(arr, pack=True)
    assert _wire.CODEC_NAMES[got_codec] == codec
    content = _wire.frame_bytes(got_codec, arr.dtype, arr.nbytes, "x")
    assert zstandard.frame_content_size(data) == content
    back = encoded_array(arr.dtype.str, arr.shape, arr.nbytes, got_codec, data, "x", 1 << 30)
    out = back.decode()
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()


def test_floats_bools_and_empty_arrays_are_not_packed():
    for arr in (
        np.arange(10, dtype=np.float32),
        np.ones(10, dtype=bool),
        np.zeros((0, 4), dtype=np.int64),
        np.arange(3, dtype=np.float64),
    ):
        codec, _ = _wire.encode(arr, pack=True)
        assert codec == _wire.CODEC_ZSTD, arr.dtype
    assert _wire.encode(np.arange(4, dtype=np.int32), level=-1, pack=True)[0] == _wire.CODEC_RAW


def test_a_chunk_is_packed_only_for_a_server_that_takes_packed_codecs():
    """JoinReply.packed_codecs decides: a server that does not set it (an older one) gets
    every integer array as plain CODEC_ZSTD."""
    arrays = {
        "action": np.arange(12, dtype=np.int32).reshape(3, 4),
        "reward": np.zeros((3, 4), np.float32),
        "done": np.zeros((3, 4), bool),
        "state:pos": np.ones((3, 4, 2), np.int64),
    }
    for pack, expected in ((False, "CODEC_ZSTD"), (True, "CODEC_ZSTD_U8")):
        request = encode_chunk(PendingChunk(sequence=1, arrays=dict(arrays), raw_bytes=0), 1, pack)
        chunk = request.chunk
        assert _wire.CODEC_NAMES[chunk.action.codec] == expected
        assert _wire.CODEC_NAMES[chunk.states[0].array.codec] == expected
        assert chunk.reward.codec == chunk.done.codec == _wire.CODEC_ZSTD


def frame(arr: np.ndarray, codec: int) -> pb.ArrayData:
    packed = _wire.PACKED.get(codec)
    raw = arr if packed is None else arr.astype(packed)
    data = zstandard.ZstdCompressor(level=1).compress(raw.tobytes())
    return pb.ArrayData(
        dtype=arr.dtype.str, shape=arr.shape, raw_size=arr.nbytes, codec=codec, data=data
    )


@pytest.mark.parametrize(
    ("dtype", "codec", "expected"),
    [
        ("<f4", 3, "packs |u1 values"),
        ("|b1", 3, "packs |u1 values"),
        ("|i1", 3, "packs |u1 values"),
        ("<u4", 4, "packs |i1 values"),
        ("<i2", 5, "packs <u2 values"),
        ("<u8", 8, "packs <i4 values"),
        ("<i4", 9, "a packed CODEC_ZSTD_<type> (3-8), got 9"),
    ],
)
def test_a_packed_codec_the_dtype_cannot_hold_is_refused(dtype, codec, expected):
    arr = np.zeros((4, 2), dtype=dtype)
    with pytest.raises(RequestError) as caught:
        encoded_array(arr.dtype.str, arr.shape, arr.nbytes, codec, b"", "chunk.action", 1 << 20)
    assert caught.value.message.startswith("chunk.action.codec: expected")
    assert expected in caught.value.message


def test_a_packed_frame_declaring_the_unpacked_size_is_refused():
    arr = np.arange(64, dtype=np.int32).reshape(8, 8)
    data = zstandard.ZstdCompressor(level=1).compress(arr.tobytes())  # 256 bytes, not 64
    with pytest.raises(RequestError) as caught:
        encoded_array("<i4", arr.shape, arr.nbytes, 3, data, "chunk.action", 1 << 20)
    assert caught.value.message == (
        "chunk.action.data: expected a zstd frame of 64 bytes, it declares 256 bytes"
    )


def test_a_session_records_every_integer_dtype_packed_and_finishes_exactly(server):
    """Actions and states of several integer dtypes and ranges, through a real server, come
    back from finish() with their dtypes and every value; a worker whose packed codec its
    dtype cannot hold is refused by name and the session goes on."""
    t, n = 24, 3
    rng = np.random.default_rng(5)
    done = np.zeros((t, n), bool)
    done[7, 0] = done[15, 1] = done[t - 1, :] = True
    states = {
        "small": rng.integers(0, 200, (t, n, 2)).astype(">i8"),
        "signed": rng.integers(-3000, 3000, (t, n)).astype(np.int32),
        "wide": rng.integers(-(2**40), 2**40, (t, n)).astype(np.int64),
        "counts": rng.integers(0, 60000, (t, n, 4)).astype(np.uint32),
    }
    action = rng.integers(0, 12, (t, n)).astype(np.int64)
    codecs = {k: _wire.CODEC_NAMES[_wire.encode(v, pack=True)[0]] for k, v in states.items()}
    assert codecs == {
        "small": "CODEC_ZSTD_U8",
        "signed": "CODEC_ZSTD_I16",
        "wide": "CODEC_ZSTD",
        "counts": "CODEC_ZSTD_U16",
    }
    target = server.address
    with RolloutRecorder(
        target=target, session="packed", record_states=True, state_fields=list(states)
    ) as rec:
        traj = {"action": action, "reward": rng.normal(size=(t, n)).astype(np.float32)}
        rec.record({**traj, "done": done}, states)
        rec.flush(timeout=30)
        # What the server holds is what travelled: packed where the values fit.
        (timeline,) = server.sessions.get("packed").workers.values()
        held = {k: _wire.CODEC_NAMES[a.codec] for k, a in timeline.chunks[0].arrays.items()}
        assert held == {
            "action": "CODEC_ZSTD_U8",
            "reward": "CODEC_ZSTD",
            "done": "CODEC_ZSTD",
            **{f"state:{k}": v for k, v in codecs.items()},
        }
        result = rec.finish()
    # Episodes environment by environment, each in time order (env, first step, end)
    spans = [(0, 0, 8), (0, 8, 24), (1, 0, 16), (1, 16, 24), (2, 0, 24)]
    assert result.actions.dtype == np.int64
    for row, (env, start, end) in enumerate(spans):
        assert np.array_equal(result.actions[row, : end - start], action[start:end, env])
        for name, arr in states.items():
            got = result.states[name]
            assert got.dtype.newbyteorder("=") == arr.dtype.newbyteorder("=")
            assert np.array_equal(got[row, : end - start], arr[start:end, env]), name

    with make_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        config = pb.SessionConfig()
        joined = stub.Join(
            pb.JoinRequest(session="packed-bad", config=config, worker_id="w"), timeout=10
        )
        assert joined.packed_codecs
        good = np.zeros((t, n), np.int32)
        chunks = []
        for seq, action_codec in ((1, 4), (2, 3)):  # I8 of a uint32 action: refused
            act = good.astype(np.uint32) if seq == 1 else good
            chunks.append(
                pb.RecordRequest(
                    chunk=pb.Chunk(
                        sequence=seq,
                        action=frame(act, action_codec),
                        reward=frame(good.astype(np.float32), _wire.CODEC_ZSTD),
                        done=frame(done, _wire.CODEC_ZSTD),
                    )
                )
            )
        opening = pb.RecordRequest(open=pb.RecordOpen(session="packed-bad", worker_id="w"))
        acks = list(stub.Record(iter([opening, *chunks]), timeout=30))
    assert [a.result for a in acks] == [pb.RecordAck.REJECTED, pb.RecordAck.STORED]
    assert acks[0].error_code == "INVALID_ARGUMENT"
    assert acks[0].error_message.startswith("chunk.action.codec: expected a codec whose values")
    assert "CODEC_ZSTD_I8 (4)" in acks[0].error_message
    assert acks[1].num_recorded_steps == t  # the refused chunk counts no steps
