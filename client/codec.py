"""Array <-> wire encoding: numpy dtype, shape, raw size and one zstd frame.

Shared by client and server. Decoding checks the declared raw size against
dtype and shape, and the zstd frame's own content size against the declared
size, before it decompresses a byte (no zstd bombs).
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ._proto import recorder_pb2 as pb

# Numeric and bool only: object, string and structured dtypes never go on the wire.
_ALLOWED_KINDS = frozenset("biuf")
DEFAULT_LEVEL = 1

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


class ArrayDecodeError(ValueError):
    """An ArrayData that cannot be decoded; the message names what is wrong."""


def check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"{what}: expected a numeric or bool dtype, got {dtype.str!r} ({dtype})")


def encode_array(arr: np.ndarray, level: int = DEFAULT_LEVEL) -> pb.ArrayData:
    """Encode a numeric array as one zstd frame of its C-order bytes."""
    arr = np.ascontiguousarray(arr)
    raw = memoryview(arr).cast("B") if arr.size else b""
    data = _compressor(level).compress(raw) if level >= 0 else bytes(raw)
    return pb.ArrayData(
        dtype=arr.dtype.str,
        shape=arr.shape,
        raw_size=arr.nbytes,
        codec=pb.CODEC_ZSTD if level >= 0 else pb.CODEC_RAW,
        data=data,
    )


def parse_dtype(text: str, what: str) -> np.dtype:
    try:
        dtype = np.dtype(text)
    except TypeError as exc:
        raise ArrayDecodeError(
            f"{what}.dtype: expected a numpy dtype string, got {text!r}"
        ) from exc
    try:
        check_dtype(dtype, f"{what}.dtype")
    except ValueError as exc:
        raise ArrayDecodeError(str(exc)) from None
    return dtype


def declared(msg: pb.ArrayData, what: str, max_raw: int) -> tuple[np.dtype, tuple[int, ...]]:
    """Validate an ArrayData's header without touching its data."""
    dtype = parse_dtype(msg.dtype, what)
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise ArrayDecodeError(f"{what}.shape: expected non-negative sizes, got {list(shape)}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
    if msg.raw_size != expected:
        raise ArrayDecodeError(
            f"{what}.raw_size: expected {expected} bytes for dtype {msg.dtype} and shape "
            f"{list(shape)}, got {msg.raw_size}"
        )
    if expected > max_raw:
        raise ArrayDecodeError(f"{what}.raw_size: expected at most {max_raw} bytes, got {expected}")
    return dtype, shape


def decode_array(msg: pb.ArrayData, what: str, max_raw: int = 1 << 34) -> np.ndarray:
    """Decode and validate; raises ArrayDecodeError naming the field."""
    dtype, shape = declared(msg, what, max_raw)
    out = np.empty(shape, dtype=dtype)
    decode_into(msg, out, what)
    return out


def decode_into(msg: pb.ArrayData, out: np.ndarray, what: str) -> None:
    """Decode msg's bytes straight into the C-contiguous buffer `out`."""
    raw_size = int(msg.raw_size)
    if out.nbytes != raw_size:
        raise ArrayDecodeError(f"{what}: expected {out.nbytes} raw bytes, got {raw_size}")
    dest = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(bytearray())
    if msg.codec == pb.CODEC_RAW:
        if len(msg.data) != raw_size:
            raise ArrayDecodeError(
                f"{what}.data: expected {raw_size} raw bytes, got {len(msg.data)}"
            )
        dest[:] = msg.data
        return
    if msg.codec != pb.CODEC_ZSTD:
        raise ArrayDecodeError(
            f"{what}.codec: expected CODEC_ZSTD or CODEC_RAW, got {pb.Codec.Name(msg.codec) if msg.codec in pb.Codec.values() else msg.codec}"
        )
    try:
        content = zstandard.frame_content_size(msg.data)
    except zstandard.ZstdError as exc:
        raise ArrayDecodeError(f"{what}.data: not a zstd frame ({exc})") from None
    if content != raw_size:
        raise ArrayDecodeError(
            f"{what}.data: zstd frame declares {content} bytes, expected {raw_size}"
        )
    if raw_size == 0:
        return
    try:
        reader = _decompressor().stream_reader(msg.data, read_across_frames=False)
        got = 0
        while got < raw_size:
            n = reader.readinto(dest[got:])
            if n == 0:
                break
            got += n
    except zstandard.ZstdError as exc:
        raise ArrayDecodeError(f"{what}.data: corrupt zstd frame ({exc})") from None
    if got != raw_size:
        raise ArrayDecodeError(f"{what}.data: expected {raw_size} bytes, frame gave {got}")
