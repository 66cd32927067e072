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
import math
import struct
from typing import Any

import numpy as np

from recorder_client import _wire
from recorder_client._wire import shown

from ..chunks import (
    ALWAYS_DECODED,
    FLAGS,
    STATE,
    EncodedArray,
    Schema,
    SessionConfig,
    array_label,
    check_contract_headers,
    check_size,
    encoded_array,
    in_schema,
    is_obs_field,
)
from ..dataset.cursor import DatasetCursor
from ..episodes import EpisodeTable, StoredChunk
from ..errors import RequestError
from ..limits import ServiceLimits
from .state_fields import (
    MAX_LOSS_CAUSES,
    SnapshotError,
    array,
    blob,
    corrupt_messages,
    count,
    dims_of,
    feeder,
    list_of,
    loss_causes,
    mapping,
    restore_lifecycle,
)

MAGIC = b"RRSTATE1"
# 3: the causes of loss recovery found (loss_causes). A v2 state reads as one without any.
FORMAT = "recorder.session_state.v3"
READ_FORMATS = ("recorder.session_state.v2", FORMAT)
# What a checkpoint holds around the sessions' states. 2: the dropped sessions' tombstones
# (a v1 checkpoint, without a "format", has none).
CHECKPOINT_FORMAT = "recorder.checkpoint.v2"
CHECKPOINT_READ_FORMATS = ("recorder.checkpoint.v1", CHECKPOINT_FORMAT)
# Session counters a state carries, each an int in [0, 2**63).
COUNTERS = ("done_count", "num_recorded_steps", "env_steps", "chunks_stored", "chunks_dropped")


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
        raise SnapshotError(f"state: unreadable header ({shown(str(exc))})") from None
    except RecursionError:
        raise SnapshotError("state: unreadable header (nested too deeply)") from None
    if any(size < 0 for size in sizes):
        raise SnapshotError("state.sizes: expected blob sizes >= 0")
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
            saved = {"t0": c.t0, "length": c.length, "wire_bytes": c.wire_bytes, "arrays": arrays}
            if c.sequence:
                saved["sequence"] = c.sequence
            if c.corrupt:  # its frames are saved as the zeros they read as
                saved["corrupt"] = list(c.corrupt)
            if c.outcome is not None:
                saved["outcome"] = {
                    "dtype": c.outcome.dtype.str,
                    "shape": list(c.outcome.shape),
                    "codec": c.outcome.codec,
                    "blob": blobs.add(memoryview(c.outcome.data)),
                }
            chunks.append(saved)
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
            "joined_unix": session.joined_at.get(worker_id, 0.0),
            "holder": session.identity.holder(worker_id),  # its lease, after a restart
            "chunks": chunks,
            "table": [blobs.array(env), blobs.array(start), blobs.array(end)],
        }
        if tl.open_start is not None:
            entry["open_start"] = blobs.array(tl.open_start)
            entry["finished_per_env"] = blobs.array(tl.finished_per_env)
        gaps = tl.gap_state()
        if gaps is not None:  # where sequence gaps cut its episodes
            entry["gaps"] = gaps
        tails = session.feeder.state()
        if tl.index in tails:
            entry["feeder"] = {k: blobs.array(v) for k, v in tails[tl.index].items()}
        if session.processor.store is not None:
            entry["trajectory_ids"] = blobs.array(session.feeder.trajectory_id_table(tl.index))
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
        "lifecycle": {
            "active": sorted(session.active),
            "forgotten": [[w, seq] for w, seq in session.forgotten.items()],
            "next_index": session.next_index,
            "sequences_lost": dict(session.sequences_lost),
        },
        "capture_runtime": session.processor.runtime_state_dict(),
        "store": store_blob,
        "dataset": session.dataset.state(),
        "loss_causes": [
            [c.kind.value, c.detail, c.worker_id, c.first_sequence]
            for c in session.loss_causes[-MAX_LOSS_CAUSES:]
        ],
    }
    return meta, blobs.items


def session_config(meta: dict[str, Any]) -> SessionConfig:
    """The configuration a state was saved with (checked)."""
    if not isinstance(meta, dict) or meta.get("format") not in READ_FORMATS:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise SnapshotError(
            f"state: expected format {' or '.join(map(repr, READ_FORMATS))}, got {got!r} "
            "(written by another version of "
            "rollout-recorder?)"
        )
    try:
        return SessionConfig.from_dict(meta.get("config"))
    except RequestError as exc:
        raise SnapshotError(f"state: {exc}") from None


def restore_session(
    session: Any, meta: dict[str, Any], blobs: list[memoryview], limits: Any = None
) -> None:
    """Fill a new, empty Session (built from session_config) with the saved state, checked
    like live input (SnapshotError naming the field). ``limits`` (a ServiceLimits) bounds its
    chunks and store as the server bounds live ones; None: sizes are only checked for
    consistency (a checkpoint this server wrote)."""
    _guarded(_restore, session, meta, blobs, limits or _unlimited())


def check_limits(meta: Any, blobs: list[memoryview], limits: Any) -> None:
    """SnapshotError unless every chunk of a state is within ``limits`` (a ServiceLimits),
    read from its headers: run on an uploaded state before anything of it is built."""

    def run() -> None:
        for k, entry in enumerate(list_of(meta["workers"], "state.workers")):
            for i, c in enumerate(list_of(entry["chunks"], f"state.workers[{k}].chunks")):
                _chunk_arrays(c, blobs, f"state.workers[{k}].chunks[{i}]", limits, copy=False)

    if not isinstance(meta, dict):
        raise SnapshotError(f"state: expected a mapping, got {type(meta).__name__}")
    _guarded(run)


def _guarded(fn: Any, *args: Any) -> None:
    """``fn(*args)``, any error of a malformed state turned into a SnapshotError."""
    try:
        fn(*args)
    except SnapshotError:
        raise
    except RequestError as exc:
        text = str(exc)
        raise SnapshotError(text if text.startswith("state") else f"state: {text}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise SnapshotError(f"state: missing or malformed entry ({shown(repr(exc))})") from None
    except RecursionError:
        raise SnapshotError("state: nested too deeply") from None


def _unlimited() -> Any:
    big = 1 << 62
    return ServiceLimits(
        max_array_bytes=big, max_chunk_bytes=big, max_chunk_env_steps=big, max_upload_bytes=big
    )


def _schema(value: Any, config: SessionConfig, max_raw: int) -> Schema | None:
    if value is None:
        return None
    allowed = {"action", "reward"} | {STATE + f for f in config.state_fields}
    schema: Schema = {}
    for key, spec in mapping(value, "state.schema").items():
        what = f"state.schema[{shown(key)}]"
        if key not in allowed and not (key.startswith(STATE) and is_obs_field(key[len(STATE) :])):
            raise SnapshotError(f"{what}: expected a key from {sorted(allowed)}")
        dtype_text, trailing = list_of(spec, what)
        try:
            dtype = _wire.parse_dtype(dtype_text, f"{what}.dtype")
        except ValueError as exc:
            raise SnapshotError(str(exc)) from None
        dims = dims_of(trailing, what)
        if dtype.itemsize * math.prod(max(d, 1) for d in dims) > max_raw:
            raise SnapshotError(f"{what}.shape: expected at most {max_raw} bytes, got {dims}")
        schema[key] = (dtype, tuple(dims))
    fields = [k[len(STATE) :] for k in schema if k.startswith(STATE)]
    observed = [name for name in fields if is_obs_field(name)]
    problem = _wire.obs_names_error(observed) if observed else None
    if problem is None and len(fields) > _wire.MAX_STATE_FIELDS:
        problem = f"expected at most {_wire.MAX_STATE_FIELDS} state fields, got {len(fields)}"
    if problem is not None:  # what a received chunk may carry, no more
        raise SnapshotError(f"state.schema: {problem}")
    return schema


def _chunk_arrays(
    c: Any, blobs: list[memoryview], what: str, limits: Any, *, copy: bool = True
) -> dict[str, EncodedArray]:
    """A saved chunk's arrays, each header checked as a received one is (sizes, frames)."""
    max_raw = min(limits.max_array_bytes, limits.max_chunk_bytes)
    arrays: dict[str, EncodedArray] = {}
    for key, spec in mapping(mapping(c, what)["arrays"], f"{what}.arrays").items():
        label = array_label(what, str(key))
        spec = mapping(spec, label)
        dims = dims_of(spec.get("shape"), label)
        dtype = spec.get("dtype")
        if not isinstance(dtype, str):
            raise SnapshotError(f"{label}.dtype: expected a dtype string, got {shown(dtype)}")
        try:
            raw = _wire.parse_dtype(dtype, f"{label}.dtype").itemsize * math.prod(dims)
        except ValueError as exc:
            raise SnapshotError(str(exc)) from None
        data = blob(blobs, spec.get("blob"), label)
        codec = spec.get("codec")
        if isinstance(codec, bool) or not isinstance(codec, int):
            raise SnapshotError(f"{label}.codec: expected an int, got {shown(codec)}")
        arrays[str(key)] = encoded_array(
            dtype, dims, raw, codec, bytes(data) if copy else data, label, max_raw
        )
    check_size(arrays, what, limits.max_chunk_bytes, limits.max_chunk_env_steps, time_axes=2)
    return arrays


def _check_chunk(
    arrays: dict[str, EncodedArray],
    what: str,
    length: int,
    num_envs: int,
    schema: Schema | None,
) -> None:
    """A saved chunk's arrays agree with its place on the worker's time axis and the
    session's schema (a finish allocates from them)."""
    tn = (length, num_envs)
    for key in ("action", "reward", "done"):
        if key not in arrays:
            raise SnapshotError(f"{what}.arrays: expected {key!r}, got {sorted(arrays)}")
    for key, a in arrays.items():
        if a.shape[:2] != tn or (key in _PER_STEP and len(a.shape) != 2):
            raise SnapshotError(
                f"{array_label(what, key)}.shape: expected (T, N) = {list(tn)} (the chunk's "
                f"length and the worker's num_envs), got {list(a.shape)}"
            )
    if len(arrays["action"].shape) not in (2, 3):
        raise SnapshotError(
            f"{what}.action.shape: expected (T, N) or (T, N, P), got {list(arrays['action'].shape)}"
        )
    try:  # the contract's optional arrays, as a received chunk's are checked
        check_contract_headers(arrays, list(tn))
    except RequestError as exc:
        raise SnapshotError(f"{what}: {exc}") from None
    for key in ("done", "valid", *FLAGS):
        if key in arrays and arrays[key].dtype != np.bool_:
            raise SnapshotError(
                f"{what}.{key}.dtype: expected '|b1', got {arrays[key].dtype.str!r}"
            )
    got = {k: (a.dtype, a.shape[2:]) for k, a in arrays.items() if in_schema(k)}
    if schema is None or got != schema:
        raise SnapshotError(
            f"{what}.arrays: expected dtypes and trailing shapes "
            f"{_describe(schema)} (state.schema), got {_describe(got)}"
        )


# Arrays of one value per step (T, N).
_PER_STEP = ("reward", "done", "valid", *FLAGS)


def _describe(schema: Schema | None) -> str:
    if schema is None:
        return "none"
    return shown({k: f"{d.str}{list(t)}" for k, (d, t) in sorted(schema.items())}, 256)


def _restore(session: Any, meta: dict[str, Any], blobs: list[memoryview], limits: Any) -> None:
    from ..session import check_worker_id

    schema = _schema(meta["schema"], session.config, limits.max_chunk_bytes)
    counters = mapping(meta["counters"], "state.counters")
    unknown = sorted(str(name) for name in counters if name not in COUNTERS)
    missing = sorted(set(COUNTERS) - set(counters))
    if unknown or missing:
        raise SnapshotError(
            f"state.counters: expected exactly {list(COUNTERS)}, got "
            + (f"unknown {shown(unknown[0])}" if unknown else f"no {missing[0]!r}")
        )
    values = {name: count(counters[name], f"counters.{name}") for name in COUNTERS}
    session.schema = schema
    session.done_count = values["done_count"]
    session.num_recorded_steps = values["num_recorded_steps"]
    session.env_steps = values["env_steps"]
    session.chunks_stored = values["chunks_stored"]
    session.chunks_dropped = values["chunks_dropped"]
    session.publish_counters()
    tails = {}
    trajectory_ids: dict[int, np.ndarray] = {}
    entries = [mapping(w, "state.workers[]") for w in list_of(meta["workers"], "state.workers")]
    workers = sorted(entries, key=lambda w: count(w["index"], "workers.index"))
    indexes = [w["index"] for w in workers]
    if len(set(indexes)) != len(indexes) or (indexes and indexes[-1] >= 1 << 31):
        raise SnapshotError(
            "state.workers: expected distinct indexes below 2**31 in join order, got "
            f"{indexes[:8]}{'...' if len(indexes) > 8 else ''}"
        )
    ids = []
    for entry in workers:
        worker_id = entry["id"]
        if not isinstance(worker_id, str):
            raise SnapshotError(f"state.workers.id: expected a string, got {shown(worker_id)}")
        ids.append(check_worker_id(worker_id))
    restore_lifecycle(session, meta, ids, indexes)
    for entry, worker_id in zip(workers, ids, strict=True):
        what = f"state.workers[{shown(worker_id)}]"
        if worker_id in session.workers:
            raise SnapshotError(f"state.workers: worker {shown(worker_id)} appears twice")
        tl = session.add_worker(
            worker_id, entry["index"], count(entry["last_sequence"], "last_sequence")
        )
        joined = entry.get("joined_unix", 0.0)
        if isinstance(joined, bool) or not isinstance(joined, (int, float)):
            raise SnapshotError(f"state.workers.joined_unix: expected seconds, got {joined!r}")
        session.joined_at[worker_id] = float(joined)
        session.identity.restore(worker_id, entry.get("holder"))
        n = entry["num_envs"]
        n = None if n is None else count(n, "num_envs")
        saved = list_of(entry["chunks"], f"{what}.chunks")
        if (n is None) != (not saved):
            raise SnapshotError(
                f"{what}.num_envs: expected a count exactly when the worker has chunks, got "
                f"{shown(n)} with {len(saved)} chunks"
            )
        t = 0
        for i, c in enumerate(saved):
            where = f"{what}.chunks[{i}]"
            arrays = _chunk_arrays(c, blobs, where, limits)
            length = arrays["action"].shape[0] if "action" in arrays else 0
            if count(c["t0"], "t0") != t or count(c["length"], "length") != length:
                raise SnapshotError(
                    f"{where}: expected t0={t} and length={length} (the steps before it and "
                    f"its arrays), got t0={shown(c['t0'])} and length={shown(c['length'])}"
                )
            _check_chunk(arrays, where, length, n, schema)
            outcome = None
            if "outcome" in c:
                outcome = _chunk_arrays({"arrays": {"outcome": c["outcome"]}}, blobs, where, limits)
                outcome = outcome["outcome"]
                if list(outcome.shape) != [length, n] or outcome.dtype.kind not in "iu":
                    raise SnapshotError(
                        f"{where}.outcome: expected integer codes of shape {[length, n]}, got "
                        f"{outcome.dtype} {list(outcome.shape)}"
                    )
            wire = count(c["wire_bytes"], "wire_bytes")
            # Frames are checked from their headers here; their content is proved when
            # they are read (a checkpoint may precede the background verifier).
            later = tuple(k for k in arrays if k not in ALWAYS_DECODED)
            sequence = count(c.get("sequence", 0), "sequence")
            corrupt = corrupt_messages(c.get("corrupt", []), f"{where}.corrupt", len(arrays))
            tl.chunks.append(
                StoredChunk(t, length, arrays, wire, outcome, later, worker_id, sequence, corrupt)
            )
            t += length
        if count(entry["t_total"], "t_total") != t:
            raise SnapshotError(
                f"{what}.t_total: expected {t} (the chunks' steps), got {entry['t_total']}"
            )
        tl.t_total = t
        env, start, end = (
            array(spec, blobs, f"{what}.table[{j}]", "<i8")
            for j, spec in enumerate(list_of(entry["table"], f"{what}.table"))
        )
        if not env.ndim == start.ndim == end.ndim == 1 or not env.size == start.size == end.size:
            raise SnapshotError(f"{what}.table: expected three arrays (E,) of equal length")
        if env.size and (
            env.min() < 0
            or env.max() >= (n or 0)
            or start.min() < 0
            or (start > end).any()
            or end.max() > t
        ):
            raise SnapshotError(
                f"{what}.table: expected envs in [0, {n}) and 0 <= start <= end <= {t}"
            )
        tl.table = EpisodeTable([env], [start], [end]) if env.size else EpisodeTable()
        if ("open_start" in entry) != (n is not None):
            raise SnapshotError(f"{what}.open_start: expected one exactly when num_envs is set")
        if n is not None:
            tl.num_envs = n
            tl.open_start = array(entry["open_start"], blobs, f"{what}.open_start", "<i8", (n,))
            tl.finished_per_env = array(
                entry["finished_per_env"], blobs, f"{what}.finished_per_env", "<i8", (n,)
            )
            if n and (tl.open_start.min() < 0 or tl.open_start.max() > t):
                raise SnapshotError(f"{what}.open_start: expected steps in [0, {t}]")
            if n and tl.finished_per_env.min() < 0:
                raise SnapshotError(f"{what}.finished_per_env: expected counts >= 0")
        try:
            tl.load_gap_state(entry.get("gaps"))
        except ValueError as exc:
            raise SnapshotError(f"{what}.{exc}") from None
        tl.episodes_finished = count(entry["episodes_finished"], "episodes_finished")
        tl.raw_bytes = count(entry["raw_bytes"], "raw_bytes")
        tl.wire_bytes = count(entry["wire_bytes"], "wire_bytes")
        tl.chunks_dropped = count(entry["chunks_dropped"], "chunks_dropped")
        if "feeder" in entry:
            tails[tl.index] = feeder(entry["feeder"], blobs, f"{what}.feeder", n)
        if "trajectory_ids" in entry:
            ids = array(entry["trajectory_ids"], blobs, f"{what}.trajectory_ids", "<i8")
            if ids.ndim != 1 or ids.size > env.size or (ids.size and ids.min() < -1):
                raise SnapshotError(
                    f"{what}.trajectory_ids: expected at most {env.size} ids >= -1 (one per "
                    "finished episode)"
                )
            trajectory_ids[tl.index] = ids
    try:
        session.processor.load_state_dict(meta["capture_runtime"])
    except ValueError as exc:
        text = str(exc)
        text = f".{text[6:]}" if text.startswith("state.") else f": {text}"
        raise SnapshotError(f"state.capture_runtime{text}") from None
    store = meta["store"]
    if store is not None and session.processor.store is not None:
        data = bytes(blob(blobs, store, "state.store"))
        try:
            session.processor.load_trajectory_store_checkpoint_data(
                data, max_bytes=limits.max_upload_bytes
            )
        except ValueError as exc:
            raise SnapshotError(f"state.store: {exc}") from None
    session.feeder.restore(tails, list(session.workers.values()))
    session.queue_unverified()
    session.feeder.trajectory_ids = {i: [ids] for i, ids in trajectory_ids.items()}
    session.loss_causes = loss_causes(meta.get("loss_causes", []))
    if "dataset" in meta:  # a state from before the dataset sink has none
        try:
            session.dataset = DatasetCursor.from_state(meta["dataset"])
        except ValueError as exc:
            raise SnapshotError(f"state.dataset: {exc}") from None
