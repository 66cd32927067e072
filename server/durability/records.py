"""Write-ahead log records: every change to a session, as bytes, and back.

Record layout (integers little-endian)::

    kind (1 byte: J join, C chunk, R reset, E episode, L leave, D drop, W dataset write,
    K dataset commit, S skip) | session length uint16
    | worker length uint16 | session (UTF-8) | worker (UTF-8) | payload

Payloads: a join carries the session configuration, the client's acknowledged sequence and
(when it named one) the digest of its instance id as JSON; a dataset write its intent as JSON (file number, generation, rows per worker); a dataset
commit the file number as JSON; a skip (a chunk's sequence taken without storing the chunk:
refused, or dropped on a full session) the sequence and whether it cuts the worker's episodes
as JSON; a leave ``expired`` or nothing; a reset and a drop nothing; a chunk and an
episode a uint32 header length, a JSON header (the arrays' keys, dtypes, shapes, codecs and
sizes, plus the sequence or the episode's step, outcome, data and start reference) and the
arrays' bytes as they arrived, back to back. A record is a list of buffers, written without
joining them.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..chunks import Chunk, EncodedArray, SessionConfig, SubmittedEpisode, encoded_array
from ..dataset.cursor import Intent

JOIN = b"J"
CHUNK = b"C"
RESET = b"R"
EPISODE = b"E"
LEAVE = b"L"
DROP = b"D"
DATASET_WRITE = b"W"
DATASET_COMMIT = b"K"
SKIP = b"S"
_KINDS = (JOIN, CHUNK, RESET, EPISODE, LEAVE, DROP, DATASET_WRITE, DATASET_COMMIT, SKIP)
_NAMES = struct.Struct("<HH")
_HEADER = struct.Struct("<I")
# Arrays in the log were checked when they arrived.
_NO_LIMIT = 1 << 62


@dataclass
class Record:
    kind: bytes
    session: str
    worker: str
    body: Any
    """Join, Chunk, SubmittedEpisode, Intent (dataset write), a file number (dataset commit),
    Skip, "expired" or "" (leave), or None (reset, drop)."""


@dataclass(frozen=True)
class Join:
    config: SessionConfig
    acked: int = 0
    holder: str = ""
    """identity.proof() of the joining recorder's instance id ("": none named)."""


@dataclass(frozen=True)
class Skip:
    sequence: int
    cut: bool
    """Whether the chunk's steps are a hole in the worker's episodes (a refused chunk)."""


def _prefix(kind: bytes, session: str, worker: str) -> bytes:
    s, w = session.encode(), worker.encode()
    return b"".join([kind, _NAMES.pack(len(s), len(w)), s, w])


def _with_arrays(header: dict[str, Any], arrays: dict[str, EncodedArray]) -> list:
    header["arrays"] = [
        [key, a.dtype.str, list(a.shape), a.codec, len(a.data)] for key, a in arrays.items()
    ]
    text = json.dumps(header, separators=(",", ":")).encode()
    return [_HEADER.pack(len(text)), text, *(a.data for a in arrays.values())]


def join(
    session: str, worker: str, config: SessionConfig, acked: int = 0, holder: str = ""
) -> list:
    body: dict[str, Any] = {"config": config.to_dict(), "acked": acked}
    if holder:
        body["holder"] = holder
    return [_prefix(JOIN, session, worker), json.dumps(body).encode()]


def leave(session: str, worker: str, *, expired: bool = False) -> list:
    return [_prefix(LEAVE, session, worker), b"expired" if expired else b""]


def drop(session: str) -> list:
    return [_prefix(DROP, session, "")]


def dataset_write(session: str, intent: Intent) -> list:
    return [_prefix(DATASET_WRITE, session, ""), json.dumps(intent.to_dict()).encode()]


def dataset_commit(session: str, seq: int) -> list:
    return [_prefix(DATASET_COMMIT, session, ""), json.dumps({"seq": seq}).encode()]


def skip(session: str, worker: str, sequence: int, cut: bool) -> list:
    return [_prefix(SKIP, session, worker), json.dumps({"sequence": sequence, "cut": cut}).encode()]


def chunk(session: str, worker: str, value: Chunk) -> list:
    return [
        _prefix(CHUNK, session, worker),
        *_with_arrays(
            {
                "sequence": value.sequence,
                **({"parts": list(value.parts)} if value.parts else {}),
                **({"cut_before": True} if value.cut_before else {}),
                **({"fresh_start": True} if value.fresh_start else {}),
            },
            value.arrays,
        ),
    ]


def reset(session: str) -> list:
    return [_prefix(RESET, session, "")]


def episode(session: str, value: SubmittedEpisode) -> list:
    header = {
        "step": value.step,
        "outcome": value.outcome,
        "episode_data": value.episode_data,
        "start_reference": value.start_reference,
    }
    return [_prefix(EPISODE, session, ""), *_with_arrays(header, value.arrays)]


def _read_arrays(payload: memoryview) -> tuple[dict[str, Any], dict[str, EncodedArray]]:
    (length,) = _HEADER.unpack_from(payload, 0)
    header = json.loads(bytes(payload[4 : 4 + length]))
    offset = 4 + length
    arrays = {}
    for key, dtype, shape, codec, size in header["arrays"]:
        data = bytes(payload[offset : offset + size])
        if len(data) != size:
            raise ValueError(f"log record: array {key!r} is truncated")
        offset += size
        raw = np.dtype(dtype).itemsize * math.prod(shape)
        arrays[key] = encoded_array(dtype, shape, raw, codec, data, f"log.{key}", _NO_LIMIT)
    if offset != len(payload):
        raise ValueError(f"log record: {len(payload) - offset} bytes after the arrays")
    return header, arrays


def decode(data: bytes | memoryview) -> Record:
    """A record as written; ValueError when it is not one."""
    view = memoryview(data)
    kind = bytes(view[:1])
    if kind not in _KINDS:
        raise ValueError(f"log record: unknown kind {kind!r}")
    ls, lw = _NAMES.unpack_from(view, 1)
    session = bytes(view[5 : 5 + ls]).decode()
    worker = bytes(view[5 + ls : 5 + ls + lw]).decode()
    payload = view[5 + ls + lw :]
    body: Any = None
    if kind == JOIN:
        data = json.loads(bytes(payload))
        if "config" not in data:  # a join written before it carried the acknowledged sequence
            data = {"config": data, "acked": 0}
        holder = data.get("holder", "")
        if not isinstance(holder, str):
            raise ValueError(f"log record: join holder {holder!r}")
        body = Join(SessionConfig.from_dict(data["config"]), int(data["acked"]), holder)
    elif kind == LEAVE:
        body = bytes(payload).decode()
    elif kind == DATASET_WRITE:
        body = Intent.from_dict(json.loads(bytes(payload)))
    elif kind == DATASET_COMMIT:
        seq = json.loads(bytes(payload))["seq"]
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"log record: dataset commit of file {seq!r}")
        body = seq
    elif kind == SKIP:
        data = json.loads(bytes(payload))
        seq, cut = data.get("sequence"), data.get("cut")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise ValueError(f"log record: skip of sequence {seq!r}")
        if not isinstance(cut, bool):
            raise ValueError(f"log record: skip with cut {cut!r}")
        body = Skip(seq, cut)
    elif kind == CHUNK:
        header, arrays = _read_arrays(payload)
        flags = {k: header.get(k, False) for k in ("cut_before", "fresh_start")}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"log record: chunk with {key} {value!r}")
        body = Chunk(int(header["sequence"]), arrays, parts=tuple(header.get("parts", ())), **flags)
    elif kind == EPISODE:
        header, arrays = _read_arrays(payload)
        ref = header.get("start_reference")
        body = SubmittedEpisode(
            arrays,
            {str(k): float(v) for k, v in header["episode_data"].items()},
            int(header["step"]),
            int(header["outcome"]),
            None if ref is None else (int(ref[0]), int(ref[1])),
        )
    return Record(kind, session, worker, body)


def whose(prefix: bytes) -> tuple[bytes, str, str, int] | None:
    """Kind, session, worker and (for a chunk, when it survived, else 0) sequence of a
    record of which only ``prefix`` is left; None when the names did not survive."""
    if len(prefix) < 1 + _NAMES.size or prefix[:1] not in _KINDS:
        return None
    ls, lw = _NAMES.unpack_from(prefix, 1)
    end = 1 + _NAMES.size + ls + lw
    if len(prefix) < end:
        return None
    try:
        session = prefix[5 : 5 + ls].decode()
        worker = prefix[5 + ls : end].decode()
    except UnicodeDecodeError:
        return None
    sequence = 0
    match = re.match(rb'.{4}\{"sequence":(\d+)[,}]', prefix[end:], re.DOTALL)
    if prefix[:1] == CHUNK and match:
        sequence = int(match.group(1))
    return prefix[:1], session, worker, sequence
