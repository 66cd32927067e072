"""A small self-describing container for named numpy arrays, optionally zstd-compressed.

Layout: ``MAGIC`` (8 bytes), a little-endian uint32 header length, a JSON header
``{"meta": ..., "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}``, then the raw
array bytes, each starting at a 64-byte aligned offset from the start of the data section.
``dtype`` is numpy's ``dtype.str`` (byte order included); object and structured dtypes are
refused. A compressed container is a single zstd frame with its content size declared.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import zstandard

MAGIC = b"RRSTORE1"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ALIGN = 64
# Refuse to inflate a payload declaring more than this (guards against zstd bombs).
DEFAULT_MAX_RAW_BYTES = 1 << 36


def _check_dtype(name: str, dtype: np.dtype) -> None:
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V":
        raise ValueError(f"array {name!r}: dtype {dtype} cannot be stored (object/structured)")


def pack_arrays(arrays: Mapping[str, np.ndarray], meta: Any = None) -> bytes:
    """Serialise named arrays plus a JSON-able ``meta`` value into one bytes object."""
    entries = []
    parts: list[bytes | memoryview] = []
    offset = 0
    for name, value in arrays.items():
        arr = np.ascontiguousarray(value)
        _check_dtype(name, arr.dtype)
        pad = -offset % _ALIGN
        if pad:
            parts.append(b"\0" * pad)
            offset += pad
        entries.append(
            {
                "name": name,
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "offset": offset,
                "nbytes": arr.nbytes,
            }
        )
        parts.append(memoryview(arr).cast("B") if arr.nbytes else b"")
        offset += arr.nbytes
    header = json.dumps({"meta": meta, "arrays": entries}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *parts])


def unpack_arrays(data: bytes | bytearray | memoryview) -> tuple[dict[str, np.ndarray], Any]:
    """Inverse of :func:`pack_arrays`: ``(arrays, meta)``. Arrays are read-only views of data."""
    buf = memoryview(data).cast("B")
    if bytes(buf[: len(MAGIC)]) != MAGIC:
        raise ValueError(f"payload: expected magic {MAGIC!r}, got {bytes(buf[: len(MAGIC)])!r}")
    start = len(MAGIC) + 4
    if len(buf) < start:
        raise ValueError(f"payload: truncated header ({len(buf)} bytes)")
    (hlen,) = struct.unpack("<I", buf[len(MAGIC) : start])
    if start + hlen > len(buf):
        raise ValueError(f"payload: header length {hlen} exceeds payload size {len(buf)}")
    try:
        header = json.loads(bytes(buf[start : start + hlen]))
        entries = header["arrays"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"payload: malformed header ({exc})") from None
    body = buf[start + hlen :]
    arrays: dict[str, np.ndarray] = {}
    for e in entries:
        try:
            name, dtype = str(e["name"]), np.dtype(e["dtype"])
            shape = tuple(int(s) for s in e["shape"])
            offset, nbytes = int(e["offset"]), int(e["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"payload: malformed array entry {e!r} ({exc})") from None
        _check_dtype(name, dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if any(s < 0 for s in shape) or count * dtype.itemsize != nbytes:
            raise ValueError(f"array {name!r}: shape {shape} x {dtype} != {nbytes} bytes")
        if offset < 0 or offset + nbytes > len(body):
            raise ValueError(f"array {name!r}: bytes [{offset}, {offset + nbytes}) out of range")
        if nbytes:
            flat = np.frombuffer(body, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
            arrays[name] = flat.reshape(shape)
        else:
            arrays[name] = np.zeros(shape, dtype)
    return arrays, header.get("meta")


def compressor(level: int = 3) -> zstandard.ZstdCompressor:
    """A fresh compressor for :func:`compress` (reuse it within one thread to save setup)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True)


def compress(
    data: bytes, level: int = 3, *, using: zstandard.ZstdCompressor | None = None
) -> bytes:
    """One zstd frame with the content size declared; ``using`` (from :func:`compressor`,
    same level) avoids building a compressor per call and gives the same bytes."""
    return (using or compressor(level)).compress(data)


def decompress(data: bytes | bytearray | memoryview, max_raw: int = DEFAULT_MAX_RAW_BYTES) -> bytes:
    """Inflate one zstd frame, refusing undeclared or oversized content."""
    try:
        size = zstandard.frame_content_size(bytes(data[:18]))
        if size < 0:
            raise ValueError("payload: zstd frame does not declare its content size")
        if size > max_raw:
            raise ValueError(f"payload: declared size {size} exceeds the limit {max_raw}")
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"payload: corrupt zstd frame ({exc})") from None
    if len(out) != size:
        raise ValueError(f"payload: inflated {len(out)} bytes, declared {size}")
    return out


def maybe_decompress(data: bytes | bytearray | memoryview, max_raw: int = DEFAULT_MAX_RAW_BYTES):
    """Inflate ``data`` when it is a zstd frame, else return it unchanged."""
    if bytes(data[:4]) == ZSTD_MAGIC:
        return decompress(data, max_raw)
    return data
