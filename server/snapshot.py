"""A session's whole state as bytes, and back: checkpoints and runtime state.

Container: magic b"RRSTATE1", uint64 header length, a JSON header
({"meta": ..., "sizes": [...]}) and the blobs it refers to by index. No pickle:
runtime state can arrive from a client, so loading never executes anything.
Chunks are kept exactly as they arrived (compressed); the caller wraps the
container in the checksummed checkpoint format.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from recorder_client._proto import recorder_pb2 as pb

from .episodes import EncodedArray, EpisodeTable, StoredChunk, WorkerTimeline

MAGIC = b"RRSTATE1"
FORMAT = "recorder.session_state.v1"


class SnapshotError(ValueError):
    """A state container that cannot be read; the message says what is wrong."""


class _Blobs:
    def __init__(self) -> None:
        self.items: list[bytes | memoryview] = []

    def add(self, data: bytes | memoryview) -> int:
        self.items.append(data)
        return len(self.items) - 1

    def array(self, arr: np.ndarray) -> dict[str, Any]:
        arr = np.ascontiguousarray(arr)
        return {"dtype": arr.dtype.str, "shape": list(arr.shape), "blob": self.add(arr.tobytes())}


def pack(meta: dict[str, Any], blobs: list[bytes | memoryview]) -> bytes:
    header = json.dumps({"meta": meta, "sizes": [len(b) for b in blobs]}).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *blobs])


def unpack(data: bytes | memoryview) -> tuple[dict[str, Any], list[memoryview]]:
    view = memoryview(data)
    if bytes(view[:8]) != MAGIC:
        raise SnapshotError(f"state: expected magic {MAGIC!r}, got {bytes(view[:8])!r}")
    if len(view) < 16:
        raise SnapshotError("state: truncated header")
    (length,) = struct.unpack("<Q", view[8:16])
    if 16 + length > len(view):
        raise SnapshotError(f"state: header of {length} bytes, only {len(view) - 16} present")
    try:
        header = json.loads(bytes(view[16 : 16 + length]))
        sizes = [int(s) for s in header["sizes"]]
        meta = header["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"state: unreadable header ({exc})") from None
    offset = 16 + length
    if offset + sum(sizes) != len(view):
        raise SnapshotError(
            f"state: expected {offset + sum(sizes)} bytes, got {len(view)} (truncated or padded)"
        )
    blobs = []
    for size in sizes:
        blobs.append(view[offset : offset + size])
        offset += size
    return meta, blobs


def _array(spec: dict[str, Any], blobs: list[memoryview]) -> np.ndarray:
    dtype = np.dtype(spec["dtype"])
    if dtype.kind not in "biuf":
        raise SnapshotError(f"state: array dtype {spec['dtype']!r} is not numeric")
    arr = np.frombuffer(blobs[spec["blob"]], dtype=dtype).copy()
    return arr.reshape(spec["shape"])


def session_state(session: Any) -> tuple[dict[str, Any], list[bytes | memoryview]]:
    """The session's state; call with its lock held and its feeder drained."""
    blobs = _Blobs()
    workers = []
    for worker_id, tl in session.workers.items():
        chunks = []
        for c in tl.chunks:
            arrays = {
                key: {
                    "dtype": a.dtype.str,
                    "shape": list(a.shape),
                    "codec": a.codec,
                    "blob": blobs.add(memoryview(a.data)),
                }
                for key, a in c.arrays.items()
            }
            chunks.append(
                {"t0": c.t0, "length": c.length, "wire_bytes": c.wire_bytes, "arrays": arrays}
            )
        env, start, end = tl.table.arrays()
        entry = {
            "id": worker_id,
            "index": tl.index,
            "last_sequence": session.last_sequence[worker_id],
            "num_envs": tl.num_envs,
            "state_names": None if tl.state_names is None else list(tl.state_names),
            "t_total": tl.t_total,
            "episodes_finished": tl.episodes_finished,
            "raw_bytes": tl.raw_bytes,
            "wire_bytes": tl.wire_bytes,
            "chunks_dropped": tl.chunks_dropped,
            "chunks": chunks,
            "table": [blobs.array(env), blobs.array(start), blobs.array(end)],
        }
        if tl.open_start is not None:
            entry["open_start"] = blobs.array(tl.open_start)
            entry["finished_per_env"] = blobs.array(tl.finished_per_env)
        tails = session.feeder.tails_state()
        if tl.index in tails:
            entry["feeder"] = {k: blobs.array(v) for k, v in tails[tl.index].items()}
        workers.append(entry)
    store_blob = None
    file = session.processor.trajectory_store_checkpoint_file(False, checkpoint_step=0)
    if file is not None:
        store_blob = blobs.add(file.data)
    meta = {
        "format": FORMAT,
        "name": session.name,
        "config": blobs.add(session.config.to_proto().SerializeToString()),
        "schema": (
            None
            if session.schema is None
            else {k: [d.str, list(t)] for k, (d, t) in session.schema.items()}
        ),
        "counters": {
            "done_count": session.done_count,
            "num_recorded_steps": session.num_recorded_steps,
            "env_steps": session.env_steps,
            "chunks_stored": session.chunks_stored,
            "chunks_dropped": session.chunks_dropped,
        },
        "workers": workers,
        "capture_runtime": session.processor.runtime_state_dict(),
        "store": store_blob,
    }
    return meta, blobs.items


def session_config(meta: dict[str, Any], blobs: list[memoryview]) -> pb.SessionConfig:
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"state: expected format {FORMAT!r}, got {meta.get('format')!r}")
    return pb.SessionConfig.FromString(bytes(blobs[meta["config"]]))


def restore_session(session: Any, meta: dict[str, Any], blobs: list[memoryview]) -> None:
    """Fill a new, empty Session (built from session_config) with the saved state."""
    try:
        _restore(session, meta, blobs)
    except (KeyError, IndexError, TypeError) as exc:
        raise SnapshotError(f"state: missing or malformed entry ({exc!r})") from None


def _restore(session: Any, meta: dict[str, Any], blobs: list[memoryview]) -> None:
    import threading

    if meta["schema"] is not None:
        session.schema = {
            k: (np.dtype(d), tuple(int(x) for x in t)) for k, (d, t) in meta["schema"].items()
        }
    for name, value in meta["counters"].items():
        setattr(session, name, int(value))
    tails = {}
    for entry in sorted(meta["workers"], key=lambda w: w["index"]):
        tl = WorkerTimeline(entry["id"], int(entry["index"]))
        tl.num_envs = entry["num_envs"]
        tl.state_names = None if entry["state_names"] is None else tuple(entry["state_names"])
        for c in entry["chunks"]:
            arrays = {
                key: EncodedArray(
                    np.dtype(a["dtype"]),
                    tuple(a["shape"]),
                    int(a["codec"]),
                    bytes(blobs[a["blob"]]),
                )
                for key, a in c["arrays"].items()
            }
            tl.chunks.append(
                StoredChunk(int(c["t0"]), int(c["length"]), arrays, int(c["wire_bytes"]))
            )
        tl.t_total = int(entry["t_total"])
        table = [_array(spec, blobs) for spec in entry["table"]]
        tl.table = (
            EpisodeTable([table[0]], [table[1]], [table[2]]) if table[0].size else EpisodeTable()
        )
        if "open_start" in entry:
            tl.open_start = _array(entry["open_start"], blobs)
            tl.finished_per_env = _array(entry["finished_per_env"], blobs)
        for name in ("episodes_finished", "raw_bytes", "wire_bytes", "chunks_dropped"):
            setattr(tl, name, int(entry[name]))
        session.workers[tl.worker_id] = tl
        session.last_sequence[tl.worker_id] = int(entry["last_sequence"])
        session.worker_locks[tl.worker_id] = threading.Lock()
        if "feeder" in entry:
            tails[tl.index] = {k: _array(v, blobs) for k, v in entry["feeder"].items()}
    session.processor.load_state_dict(meta["capture_runtime"])
    if meta["store"] is not None and session.processor.store is not None:
        session.processor.load_trajectory_store_checkpoint_data(bytes(blobs[meta["store"]]))
    session.feeder.restore_tails(tails, list(session.workers.values()))
