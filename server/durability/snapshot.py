"""A session's whole state as bytes, and back: checkpoints and runtime state.

Container: magic b"RRSTATE1", uint64 header length, a JSON header
({"meta": ..., "sizes": [...]}) and the blobs it refers to by index. No pickle:
runtime state can arrive from a client, so loading never executes anything.
Chunks are kept exactly as they arrived (compressed); the caller wraps the
container in the checksummed checkpoint format. A state is checked like live input when
it is loaded: names, counters and arrays.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from ..chunks import EncodedArray, SessionConfig
from ..episodes import EpisodeTable, StoredChunk
from ..errors import RequestError

MAGIC = b"RRSTATE1"
FORMAT = "recorder.session_state.v2"
# Session counters a state carries, each an int in [0, 2**63).
COUNTERS = ("done_count", "num_recorded_steps", "env_steps", "chunks_stored", "chunks_dropped")
_WORKER_COUNTERS = ("episodes_finished", "raw_bytes", "wire_bytes", "chunks_dropped")


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
        tails = session.feeder.state()
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
        "config": session.config.to_dict(),
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


def session_config(meta: dict[str, Any]) -> SessionConfig:
    """The configuration a state was saved with (checked)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise SnapshotError(
            f"state: expected format {FORMAT!r}, got {got!r} (written by another version of "
            "rollout-recorder?)"
        )
    try:
        return SessionConfig.from_dict(meta.get("config"))
    except RequestError as exc:
        raise SnapshotError(f"state: {exc}") from None


def restore_session(session: Any, meta: dict[str, Any], blobs: list[memoryview]) -> None:
    """Fill a new, empty Session (built from session_config) with the saved state."""
    try:
        _restore(session, meta, blobs)
    except RequestError as exc:
        raise SnapshotError(f"state: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"state: missing or malformed entry ({exc!r})") from None


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise SnapshotError(f"state.{what}: expected an int in [0, 2**63), got {value!r}")
    return value


def _restore(session: Any, meta: dict[str, Any], blobs: list[memoryview]) -> None:
    from ..session import check_worker_id

    if meta["schema"] is not None:
        session.schema = {
            str(k): (np.dtype(d), tuple(_count(x, "schema") for x in t))
            for k, (d, t) in meta["schema"].items()
        }
    counters = meta["counters"]
    if set(counters) != set(COUNTERS):
        raise SnapshotError(
            f"state.counters: expected {sorted(COUNTERS)}, got {sorted(map(str, counters))}"
        )
    for name in COUNTERS:
        setattr(session, name, _count(counters[name], f"counters.{name}"))
    tails = {}
    workers = sorted(meta["workers"], key=lambda w: _count(w["index"], "workers.index"))
    if [w["index"] for w in workers] != list(range(len(workers))):
        raise SnapshotError("state.workers: expected indexes 0, 1, 2, ... in join order")
    if len(workers) > session.max_workers:
        raise SnapshotError(
            f"state.workers: this server allows at most {session.max_workers} workers per "
            f"session, got {len(workers)}"
        )
    for entry in workers:
        worker_id = check_worker_id(str(entry["id"]))
        if worker_id in session.workers:
            raise SnapshotError(f"state.workers: worker {worker_id!r} appears twice")
        tl = session.add_worker(
            worker_id, entry["index"], _count(entry["last_sequence"], "last_sequence")
        )
        tl.num_envs = None if entry["num_envs"] is None else _count(entry["num_envs"], "num_envs")
        for c in entry["chunks"]:
            arrays = {
                str(key): EncodedArray(
                    np.dtype(a["dtype"]),
                    tuple(_count(x, "shape") for x in a["shape"]),
                    _count(a["codec"], "codec"),
                    bytes(blobs[a["blob"]]),
                )
                for key, a in c["arrays"].items()
            }
            tl.chunks.append(
                StoredChunk(
                    _count(c["t0"], "t0"),
                    _count(c["length"], "length"),
                    arrays,
                    _count(c["wire_bytes"], "wire_bytes"),
                )
            )
        tl.t_total = _count(entry["t_total"], "t_total")
        table = [_array(spec, blobs) for spec in entry["table"]]
        tl.table = (
            EpisodeTable([table[0]], [table[1]], [table[2]]) if table[0].size else EpisodeTable()
        )
        if "open_start" in entry:
            tl.open_start = _array(entry["open_start"], blobs)
            tl.finished_per_env = _array(entry["finished_per_env"], blobs)
        for name in _WORKER_COUNTERS:
            setattr(tl, name, _count(entry[name], name))
        if "feeder" in entry:
            tails[tl.index] = {k: _array(v, blobs) for k, v in entry["feeder"].items()}
    session.processor.load_state_dict(meta["capture_runtime"])
    if meta["store"] is not None and session.processor.store is not None:
        session.processor.load_trajectory_store_checkpoint_data(bytes(blobs[meta["store"]]))
    session.feeder.restore(tails, list(session.workers.values()))
