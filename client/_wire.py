"""What the client and the server must agree on, without protobuf or gRPC.

- Arrays travel as (dtype string, shape, raw size, codec, bytes). Headers are checked before
  anything is allocated or decompressed: the raw size must match dtype and shape, stay under
  a limit, and a zstd frame must declare exactly the size its codec implies (no zstd bombs).
- Integer arrays whose values all fit a narrower type travel packed (``CODEC_ZSTD_U8`` ...):
  zstd then reads and writes 2-8x fewer bytes, and the receiver casts them back exactly.
- State-field names map to trajectory names (``player_positions`` -> ``positions``).
- Files (checkpoints, runtime states) travel in parts with a size and a sha256.
- Refusals carry a stable kind tag in trailing metadata.

The server's core imports this module and nothing else of the client's wire code.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import zstandard

# The proto's Codec enum values (a test checks they agree).
CODEC_RAW = 1
CODEC_ZSTD = 2
# Packed codecs: one zstd frame of the values cast to this narrower little-endian type.
PACKED: dict[int, np.dtype] = {
    3: np.dtype("u1"),
    4: np.dtype("i1"),
    5: np.dtype("<u2"),
    6: np.dtype("<i2"),
    7: np.dtype("<u4"),
    8: np.dtype("<i4"),
}
CODEC_NAMES: dict[int, str] = {
    CODEC_RAW: "CODEC_RAW",
    CODEC_ZSTD: "CODEC_ZSTD",
    **{c: f"CODEC_ZSTD_{t.kind.upper()}{t.itemsize * 8}" for c, t in PACKED.items()},
}
DEFAULT_LEVEL = 1
# Decoding a packed frame goes through a per-thread scratch buffer; bigger ones are not kept.
_KEEP_SCRATCH = 8 << 20
# Proving a frame decodes inflates into one too (the prover is one thread, readers a few).
_KEEP_PROOF = 64 << 20

# Trailing-metadata key whose value names the kind of a refusal (see recorder_server.errors).
ERROR_KIND_KEY = "rr-error-kind"
# Seconds after which a refusal may not hold any more (a worker id kept for its holder's
# reconnect): the client may wait that long and ask again.
RETRY_AFTER_KEY = "rr-retry-after-s"

# Streamed files are cut into parts of this many bytes.
PART_BYTES = 1 << 20

# Numeric and bool only: object, string and structured dtypes never go on the wire.
_ALLOWED_KINDS = frozenset("biuf")
_MAX_DIMS = 32

_local = threading.local()


class ArrayDecodeError(ValueError):
    """An array that cannot be decoded; the message names the field and what is wrong."""


# -- arrays ----------------------------------------------------------------------------------


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


def check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"{what}: expected a numeric or bool dtype, got {dtype.str!r} ({dtype})")


def parse_dtype(text: str, what: str) -> np.dtype:
    if len(text) > 16:
        raise ArrayDecodeError(f"{what}: expected a numpy dtype string, got {text[:32]!r}...")
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError) as exc:
        raise ArrayDecodeError(f"{what}: expected a numpy dtype string, got {text!r}") from exc
    try:
        check_dtype(dtype, what)
    except ValueError as exc:
        raise ArrayDecodeError(str(exc)) from None
    return dtype


def check_header(
    dtype: str, shape: Sequence[int], raw_size: int, what: str, max_raw: int
) -> tuple[np.dtype, tuple[int, ...]]:
    """The parsed dtype and shape of an array header, checked without touching its data:
    sizes are Python ints (no overflow), and the raw size must match and stay <= max_raw."""
    parsed = parse_dtype(dtype, f"{what}.dtype")
    if len(shape) > _MAX_DIMS:
        raise ArrayDecodeError(
            f"{what}.shape: expected at most {_MAX_DIMS} dimensions, got {len(shape)}"
        )
    dims = tuple(int(s) for s in shape)
    if any(s < 0 for s in dims):
        raise ArrayDecodeError(f"{what}.shape: expected non-negative sizes, got {list(dims)}")
    expected = parsed.itemsize
    for s in dims:
        expected *= s
    if raw_size != expected:
        raise ArrayDecodeError(
            f"{what}.raw_size: expected {expected} bytes for dtype {dtype} and shape "
            f"{list(dims)}, got {raw_size}"
        )
    if expected > max_raw:
        raise ArrayDecodeError(f"{what}.raw_size: expected at most {max_raw} bytes, got {expected}")
    return parsed, dims


def _packing(arr: np.ndarray) -> int | None:
    """The packed codec of the narrowest type holding every value of an integer array, or
    None when no type narrower than its own does (two reductions over the array)."""
    if arr.dtype.kind not in "iu" or arr.itemsize == 1 or arr.size == 0:
        return None
    lo, hi = int(arr.min()), int(arr.max())
    for codec, packed in PACKED.items():
        if packed.itemsize >= arr.itemsize:
            break
        info = np.iinfo(packed)
        if info.min <= lo and hi <= info.max:
            return codec
    return None


def encode(arr: np.ndarray, level: int = DEFAULT_LEVEL, pack: bool = False) -> tuple[int, bytes]:
    """(codec, data) of a numeric array's C-order bytes: raw when level < 0, else one zstd
    frame; with ``pack`` (the receiver takes packed codecs), of the values packed into a
    narrower integer type when they all fit one."""
    arr = np.ascontiguousarray(arr)
    if level < 0:
        return CODEC_RAW, bytes(memoryview(arr).cast("B")) if arr.size else b""
    codec = _packing(arr) if pack else None
    if codec is None:
        codec, src = CODEC_ZSTD, arr
    else:
        src = arr.astype(PACKED[codec])
    raw = memoryview(src).cast("B") if src.size else b""
    return codec, _compressor(level).compress(raw)


def frame_bytes(codec: int, dtype: np.dtype, raw_size: int, what: str) -> int:
    """How many bytes of content ``codec`` carries for ``raw_size`` bytes of ``dtype``;
    ArrayDecodeError for an unknown codec, or a packed one whose type ``dtype`` cannot hold."""
    if codec in (CODEC_RAW, CODEC_ZSTD):
        return raw_size
    packed = PACKED.get(codec)
    if packed is None:
        raise ArrayDecodeError(
            f"{what}.codec: expected CODEC_RAW (1), CODEC_ZSTD (2) or a packed "
            f"CODEC_ZSTD_<type> (3-8), got {codec}"
        )
    if dtype.kind not in "iu" or not np.can_cast(packed, dtype, "safe"):
        raise ArrayDecodeError(
            f"{what}.codec: expected a codec whose values dtype {dtype.str} holds, got "
            f"{CODEC_NAMES[codec]} ({codec}), which packs {packed.str} values"
        )
    return raw_size // dtype.itemsize * packed.itemsize


def _scratch(nbytes: int, name: str = "scratch", keep: int = _KEEP_SCRATCH) -> np.ndarray:
    if nbytes > keep:
        return np.empty(nbytes, dtype=np.uint8)
    buf = getattr(_local, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


def prove(codec: int, data: bytes, dtype: np.dtype, raw_size: int, what: str) -> None:
    """ArrayDecodeError unless ``data`` decodes to ``raw_size`` bytes of ``dtype``: inflated
    into scratch and dropped (a packed frame's values always fit ``dtype``, so the cast back
    cannot fail and is skipped)."""
    content = frame_bytes(codec, dtype, raw_size, what)
    if codec == CODEC_RAW:
        _check_raw(data, raw_size, what)
        return
    _inflate(data, memoryview(_scratch(content, "proof", _KEEP_PROOF)), content, what)


def decode_into(codec: int, data: bytes, out: np.ndarray, what: str) -> None:
    """Decode ``data`` straight into the C-contiguous buffer ``out`` (its size is the raw size;
    a packed frame is inflated into scratch and cast into it)."""
    raw_size = out.nbytes
    content = frame_bytes(codec, out.dtype, raw_size, what)
    packed = PACKED.get(codec)
    if packed is not None and raw_size:
        staged = _scratch(content)
        _inflate(data, memoryview(staged), content, what)
        np.copyto(out.reshape(-1), staged.view(packed), casting="safe")
        return
    dest = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(bytearray())
    if codec == CODEC_RAW:
        _check_raw(data, raw_size, what)
        dest[:] = data
        return
    _inflate(data, dest, raw_size, what)


def _check_raw(data: bytes, raw_size: int, what: str) -> None:
    if len(data) != raw_size:
        raise ArrayDecodeError(f"{what}.data: expected {raw_size} raw bytes, got {len(data)}")


def _inflate(data: bytes, dest: memoryview, size: int, what: str) -> None:
    """Inflate one zstd frame that must declare exactly ``size`` bytes into ``dest``."""
    try:
        content = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise ArrayDecodeError(f"{what}.data: not a zstd frame ({exc})") from None
    if content != size:
        raise ArrayDecodeError(f"{what}.data: zstd frame declares {content} bytes, expected {size}")
    if size == 0:
        return
    try:
        reader = _decompressor().stream_reader(data, read_across_frames=False)
        got = 0
        while got < size:
            n = reader.readinto(dest[got:])
            if n == 0:
                break
            got += n
    except zstandard.ZstdError as exc:
        raise ArrayDecodeError(f"{what}.data: corrupt zstd frame ({exc})") from None
    if got != size:
        raise ArrayDecodeError(f"{what}.data: expected {size} bytes, frame gave {got}")


def decode(
    codec: int, data: bytes, dtype: np.dtype, shape: tuple[int, ...], what: str
) -> np.ndarray:
    """A fresh array of ``dtype`` and ``shape`` decoded from ``data`` (header already checked)."""
    out = np.empty(shape, dtype=dtype)
    decode_into(codec, data, out, what)
    return out


# -- names -----------------------------------------------------------------------------------

# Only the names that differ; every other name passes through unchanged.
STATE_TO_TRAJECTORY: dict[str, str] = {
    "player_positions": "positions",
    "map": "block_map",
}

# Either spelling of a renamed field finds the other (player_positions <-> positions).
STATE_ALIASES: dict[str, str] = {
    **STATE_TO_TRAJECTORY,
    **{v: k for k, v in STATE_TO_TRAJECTORY.items()},
}

# Names a Trajectory already uses for its own arrays; a state field may not take them.
RESERVED_NAMES = frozenset(
    {
        "actions",
        "rewards",
        "lengths",
        "episode_worker",
        "episode_env",
        "episode_start",
        "episode_done",
        "episode_terminated",
        "episode_truncated",
        "final_states",
        "worker_ids",
    }
)


SESSION_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


# -- the producer contract's value rules (record() and the server apply the same) -----------


def first_cell(mask: np.ndarray) -> tuple[int, int] | None:
    """(row, env) of the first True of a (T, N) mask, or None."""
    if not mask.any():
        return None
    row, env = (int(i) for i in np.argwhere(mask)[0])
    return row, env


def flags_disagree(
    done: np.ndarray, terminated: np.ndarray, truncated: np.ndarray
) -> tuple[int, int] | None:
    """Where ``done`` is not ``terminated | truncated``, or None."""
    either = terminated | truncated
    return None if np.array_equal(either, done) else first_cell(either != done)


def flag_on_invalid_row(
    valid: np.ndarray, done: np.ndarray, invalid: np.ndarray | None = None
) -> tuple[int, int] | None:
    """Where a row the valid mask marks False carries a flag, or None. ``invalid``:
    ``~valid``, from a caller that made it after finding a False row."""
    if invalid is None:
        if valid.all():
            return None
        invalid = ~valid
    return first_cell(invalid & done)


def invalid_row_in_episode(
    valid: np.ndarray,
    done: np.ndarray,
    open_empty: np.ndarray | None,
    invalid: np.ndarray | None = None,
) -> tuple[int, int] | None:
    """Where a False row stands inside an episode, or None. A False row may stand only
    where its env's open episode has no step yet: its first row (``open_empty``: (N,)
    before the chunk, None when every env's is empty), right after a done, or after
    another False row. ``invalid`` as for flag_on_invalid_row."""
    if invalid is None:
        if not valid.shape[0] or valid.all():
            return None
        invalid = ~valid
    allowed = np.empty_like(valid)
    allowed[0] = True if open_empty is None else open_empty
    allowed[1:] = done[:-1] | invalid[:-1]
    return first_cell(invalid > allowed)  # False where no False row may stand


def shown(text: str, limit: int = 64) -> str:
    """``text`` for an error message: quoted, and cut after ``limit`` characters."""
    if not isinstance(text, str):
        return repr(text)[:limit]
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def check_session_name(name: str) -> str:
    """The session naming rule (ValueError naming the field)."""
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise ValueError(
            "session: expected 1-128 characters from [A-Za-z0-9._-] not starting with '.', "
            f"got {shown(name)}"
        )
    return name


def check_worker_id(worker_id: str) -> str:
    """The worker id rule (ValueError naming the field)."""
    if (
        not isinstance(worker_id, str)
        or not worker_id
        or len(worker_id) > 128
        or not worker_id.isprintable()
    ):
        raise ValueError(f"worker_id: expected 1-128 printable characters, got {shown(worker_id)}")
    return worker_id


def check_options(
    max_episodes: Any,
    on_backpressure: str,
    keepalive_seconds: float,
    max_bytes_in_flight: int,
    linger_ms: float,
) -> None:
    """RolloutRecorder's plain arguments: ValueError naming the first one out of range."""
    if max_episodes is not None and (
        isinstance(max_episodes, bool) or int(max_episodes) != max_episodes or max_episodes < 0
    ):
        raise ValueError(
            f"max_episodes: expected None or a non-negative integer, got {max_episodes!r}"
        )
    if on_backpressure not in ("block", "drop"):
        raise ValueError(f"on_backpressure: expected 'block' or 'drop', got {on_backpressure!r}")
    if not keepalive_seconds >= 1:
        raise ValueError(f"keepalive_seconds: expected >= 1, got {keepalive_seconds!r}")
    if max_bytes_in_flight <= 0:
        raise ValueError(f"max_bytes_in_flight: expected > 0, got {max_bytes_in_flight}")
    if not 0 <= linger_ms <= 10_000:
        raise ValueError(f"linger_ms: expected 0 to 10000, got {linger_ms!r}")


#: Characters a state field name may have (the observation fields' included).
MAX_FIELD_NAME = 128
#: State fields one chunk may carry (observation fields included): each costs the session a
#: schema entry and finish() an output array.
MAX_STATE_FIELDS = 1024


def obs_names_error(names: Sequence[str]) -> str | None:
    """Why observation field names (``obs``, ``obs.<key>``, ``obs.<key>.<key>`` ...) cannot
    be recorded together, or None: each printable, at most MAX_FIELD_NAME characters, no
    key empty, and none also the prefix of another (a field that holds fields cannot be
    rebuilt into a dict)."""
    taken = set(names)
    for name in names:
        if len(name) > MAX_FIELD_NAME or not name.isprintable() or "" in name.split("."):
            return (
                f"expected observation fields named 'obs' or 'obs.<key>...' with non-empty "
                f"printable keys, at most {MAX_FIELD_NAME} characters, got {shown(name)}"
            )
        parts = name.split(".")
        for i in range(1, len(parts)):
            inner = ".".join(parts[:i])
            if inner in taken:
                return (
                    f"expected no observation field that also holds fields, got "
                    f"{shown(inner)} and {shown(name)}"
                )
    return None


def trajectory_name(state_field: str) -> str:
    return STATE_TO_TRAJECTORY.get(state_field, state_field)


def check_state_fields(state_fields: list[str] | tuple[str, ...]) -> list[str]:
    """Validate a state_fields list; returns it as a list of str."""
    if isinstance(state_fields, str):
        raise ValueError(f"state_fields: expected a list of names, got the string {state_fields!r}")
    fields = list(state_fields)
    seen: dict[str, str] = {}
    for name in fields:
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 128:
            shown = name[:64] + "..." if isinstance(name, str) and len(name) > 64 else name
            raise ValueError(
                f"state_fields: expected non-empty printable names of at most 128 characters, "
                f"got {shown!r}"
            )
        traj = trajectory_name(name)
        if traj in RESERVED_NAMES:
            raise ValueError(
                f"state_fields: {name!r} maps to the trajectory name {traj!r}, which is reserved"
            )
        if traj in seen:
            raise ValueError(
                f"state_fields: {name!r} and {seen[traj]!r} both map to trajectory name {traj!r}"
            )
        seen[traj] = name
    return fields


# -- files -----------------------------------------------------------------------------------


def file_pieces(data: bytes) -> Iterator[bytes]:
    """``data`` cut into parts of PART_BYTES (one empty part for empty data)."""
    view = memoryview(data)
    yield bytes(view[:PART_BYTES])
    for offset in range(PART_BYTES, len(data), PART_BYTES):
        yield bytes(view[offset : offset + PART_BYTES])


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_file(name: str, size: int, sha256: str, data: bytes) -> None:
    """ValueError unless ``data`` has the declared size and sha256."""
    got = digest(data)
    if len(data) != size or got != sha256:
        raise ValueError(
            f"file {name!r}: expected {size} bytes with sha256 {sha256}, "
            f"got {len(data)} bytes with sha256 {got}"
        )
