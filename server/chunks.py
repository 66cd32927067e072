"""What a session takes in: its configuration and chunks, as plain Python and numpy.

A chunk arrives with its arrays still encoded (`EncodedArray`: a checked header and the
bytes as they travelled). `decode_chunk` checks it against the session's configuration
(shapes agree, dtypes allowed, the fields the configuration asks for) and decodes it.
Array keys: ``action``, ``reward``, ``done``, ``outcome``, ``state:<env-state name>``, and
the producer contract's optional ``terminated``, ``truncated``, ``valid`` and
``final:<state name>`` (the state after each step, read where an episode ends).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from recorder_client import _wire
from recorder_client.capture_types import EpisodeOutcome, TrajectoryTrainingConfiguration

from .errors import RequestError, invalid

STATE = "state:"
FINAL = "final:"
FLAGS = ("terminated", "truncated")
_NUM_OUTCOMES = len(EpisodeOutcome)
# State fields one chunk may carry (record() refuses more as well).
MAX_STATE_FIELDS = _wire.MAX_STATE_FIELDS
# Decoded before every ack: episodes are split and counted from them.
ALWAYS_DECODED = frozenset({"done", "reward", "outcome", "terminated", "truncated", "valid"})
# Optional chunk by chunk, so outside the session's schema (a finish reads them per chunk).
_UNSCHEMED = frozenset({"done", "outcome", "terminated", "truncated", "valid"})
_CONTRACT_MASKS = frozenset({"terminated", "truncated", "valid"})


def in_schema(key: str) -> bool:
    """Whether array ``key`` must keep its dtype and trailing shape across chunks."""
    return key not in _UNSCHEMED and not key.startswith(FINAL)


def is_obs_field(name: str) -> bool:
    """Observation state fields (``obs``, ``obs.pos``): recorded whatever record_states says."""
    return name == "obs" or name.startswith("obs.")


@dataclass(frozen=True)
class EncodedArray:
    """An array held in its wire encoding (header checked); `decode` gives it back."""

    dtype: np.dtype
    shape: tuple[int, ...]
    codec: int
    data: bytes

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def decode(self, what: str = "stored") -> np.ndarray:
        return _wire.decode(self.codec, self.data, self.dtype, self.shape, what)

    def decode_into(self, out: np.ndarray, what: str) -> None:
        _wire.decode_into(self.codec, self.data, out, what)

    def prove(self, what: str) -> None:
        """ArrayDecodeError unless it decodes (the values are not kept)."""
        _wire.prove(self.codec, self.data, self.dtype, self.nbytes, what)


def zero_frame(enc: EncodedArray) -> EncodedArray:
    """An array like `enc` holding zeros: what stands for a frame found not to decode."""
    data = zstandard.ZstdCompressor(level=1).compress(bytes(enc.nbytes))
    return EncodedArray(enc.dtype, enc.shape, _wire.CODEC_ZSTD, data)


def encoded_array(
    dtype: str,
    shape: Sequence[int],
    raw_size: int,
    codec: int,
    data: bytes,
    what: str,
    max_raw: int,
) -> EncodedArray:
    """An EncodedArray from a received header, checked before anything is allocated or
    decompressed: sizes in Python ints (no overflow), at most ``max_raw`` bytes even when a
    dimension is empty, and the bytes exactly one zstd frame of the size its codec implies (or
    the raw bytes)."""
    try:
        parsed, dims = _wire.check_header(dtype, shape, raw_size, what, max_raw)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    # An empty dimension makes the raw size 0 whatever the others are; numpy and every
    # per-step or per-environment buffer still see them, so they are bounded as well.
    extent = parsed.itemsize
    for s in dims:
        extent *= max(s, 1)
    if extent > max_raw:
        raise invalid(
            f"{what}.shape: expected at most {max_raw} bytes counting each empty dimension as "
            f"one, got shape {list(dims)} of {parsed.str!r}"
        )
    try:
        content = _wire.frame_bytes(codec, parsed, raw_size, what)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if codec == _wire.CODEC_RAW:
        if len(data) != raw_size:
            raise invalid(f"{what}.data: expected {raw_size} raw bytes, got {len(data)}")
    else:
        check_frame(data, content, f"{what}.data")
    return EncodedArray(parsed, dims, codec, data)


def array_label(what: str, key: str) -> str:
    """How messages name array ``key`` of a chunk or episode (``chunk.states['x']``)."""
    if key.startswith(STATE):
        return f"{what}.states[{_wire.shown(key[len(STATE) :])}]"
    return f"{what}.{key}"


def check_size(
    arrays: Mapping[str, EncodedArray],
    what: str,
    max_bytes: int,
    max_env_steps: int,
    *,
    time_axes: int,
) -> None:
    """RequestError INVALID when a chunk (``time_axes=2``: arrays are (T, N, ...)) or an
    episode (``time_axes=1``: (L, ...)) is bigger than a server takes: the raw bytes of all its
    arrays together, and its env steps (T x N or L, an empty axis counted as one), which cost
    the server bookkeeping whatever their bytes. Headers only: nothing is decompressed."""
    total = sum(a.nbytes for a in arrays.values())
    if total > max_bytes:
        raise invalid(
            f"{what}.raw_size: expected at most {max_bytes} bytes in all its arrays together "
            f"(the server's --max-chunk-mib), got {total}"
        )
    for key, a in arrays.items():
        steps = 1
        for s in a.shape[:time_axes]:
            steps *= max(s, 1)
        if steps > max_env_steps:
            axes = "T x N" if time_axes == 2 else "L"
            raise invalid(
                f"{array_label(what, key)}.shape: expected at most {max_env_steps} env steps "
                f"({axes}, the server's --max-chunk-env-steps), got shape {list(a.shape)}"
            )


def check_parts(lengths: Sequence[int], arrays: Mapping[str, EncodedArray]) -> tuple[int, ...]:
    """A joined chunk's part lengths (``chunk.part_lengths``): each >= 1, summing to its T;
    () for a chunk of one call. RequestError INVALID naming what arrived."""
    if not lengths:
        return ()
    action = arrays.get("action")
    if action is None or not action.shape:
        raise invalid("chunk.part_lengths: expected them only with chunk.action, got no action")
    t = action.shape[0]
    if len(lengths) > max(t, 1):  # counted before anything is built from them
        raise invalid(f"chunk.part_lengths: expected at most T = {t} parts, got {len(lengths)}")
    parts = tuple(int(n) for n in lengths)
    if min(parts) < 1 or sum(parts) != t:
        shown = list(parts[:8]) + (["..."] if len(parts) > 8 else [])
        raise invalid(
            f"chunk.part_lengths: expected lengths >= 1 summing to T = {t}, got {shown} "
            f"(sum {sum(parts)})"
        )
    return parts if len(parts) > 1 else ()


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DICT_ID_BYTES = (0, 1, 2, 4)
_CONTENT_SIZE_BYTES = (0, 2, 4, 8)


def zstd_frame_size(data: bytes | memoryview) -> int:
    """How many bytes the zstd frame at the start of ``data`` takes, read from its frame and
    block headers (RFC 8878), without decompressing; ValueError when there is no complete
    frame."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size < 5 or bytes(view[:4]) != _ZSTD_MAGIC:
        raise ValueError("not a zstd frame (bad magic)")
    descriptor = view[4]
    if descriptor & 0x08:
        raise ValueError("not a zstd frame (reserved header bit set)")
    single_segment = (descriptor >> 5) & 1
    content_bytes = _CONTENT_SIZE_BYTES[descriptor >> 6] or single_segment
    pos = 5 + (1 - single_segment) + _DICT_ID_BYTES[descriptor & 3] + content_bytes
    while True:
        if pos + 3 > size:
            raise ValueError(f"truncated zstd frame (a block header at byte {pos} of {size})")
        header = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
        kind = (header >> 1) & 3
        if kind == 3:
            raise ValueError(f"corrupt zstd frame (reserved block type at byte {pos})")
        pos += 3 + (1 if kind == 1 else header >> 3)
        if pos > size:
            raise ValueError(f"truncated zstd frame (a block ends at byte {pos} of {size})")
        if header & 1:
            break
    if (descriptor >> 2) & 1:
        pos += 4
        if pos > size:
            raise ValueError(f"truncated zstd frame (its checksum ends at byte {pos} of {size})")
    return pos


def check_frame(data: bytes | memoryview, raw_size: int, what: str) -> None:
    """RequestError INVALID unless ``data`` is exactly one zstd frame that declares
    ``raw_size`` bytes of content (a bomb declares less than it holds, or trails junk)."""
    try:
        content = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise invalid(f"{what}: expected a zstd frame, got {len(data)} bytes ({exc})") from None
    if content != raw_size:
        declared = "no size" if content < 0 else f"{content} bytes"
        raise invalid(f"{what}: expected a zstd frame of {raw_size} bytes, it declares {declared}")
    try:
        end = zstd_frame_size(data)
    except ValueError as exc:
        raise invalid(f"{what}: expected one whole zstd frame, got {exc}") from None
    if end != len(data):
        raise invalid(
            f"{what}: expected the zstd frame alone, got {len(data) - end} bytes after its "
            f"{end} bytes"
        )


@dataclass
class Chunk:
    """One (T, N) chunk of one worker, as received."""

    sequence: int
    arrays: dict[str, EncodedArray]
    refused: RequestError | None = None
    """Why its headers were refused on arrival (its sequence number is still taken)."""
    parts: tuple[int, ...] = ()
    """T of each record() call joined into it (a client's linger), or () for one call."""
    cut_before: bool = False
    """The client dropped chunks of this worker just before it: a hole, as a refusal."""
    fresh_start: bool = False
    """A new recorder instance's first chunk of this worker: its envs start new episodes."""

    @property
    def wire_bytes(self) -> int:
        return sum(len(a.data) for a in self.arrays.values())


@dataclass
class SubmittedEpisode:
    """One whole episode sent to the trajectory store (emulator-style producers)."""

    arrays: dict[str, EncodedArray]
    """``actions``, ``rewards`` and ``state:<env-state name>``, each with leading length L."""
    episode_data: dict[str, float]
    step: int
    outcome: int
    start_reference: tuple[int, int] | None = None
    """(trajectory id, step) when the episode started from a curriculum start."""


@dataclass(frozen=True)
class SessionConfig:
    """A session's recording configuration; every worker of the session has the same."""

    max_episodes: int | None
    record_states: bool
    state_fields: tuple[str, ...]
    capture: TrajectoryTrainingConfiguration | None = None

    @classmethod
    def create(
        cls,
        max_episodes: int | None,
        record_states: bool,
        state_fields: Sequence[str],
        capture: Mapping[str, Any] | None = None,
    ) -> SessionConfig:
        """A checked configuration from received values (RequestError INVALID otherwise)."""
        if max_episodes is not None and (
            isinstance(max_episodes, bool) or not isinstance(max_episodes, int) or max_episodes < 0
        ):
            raise invalid(
                f"config.max_episodes: expected a non-negative integer or unset, got {max_episodes}"
            )
        try:
            fields = tuple(_wire.check_state_fields(list(state_fields)))
        except ValueError as exc:
            raise invalid(f"config.{exc}") from None
        trajectory = None
        if capture is not None:
            try:
                trajectory = TrajectoryTrainingConfiguration.from_dict(capture)
            except (ValueError, TypeError, KeyError) as exc:
                raise invalid(f"config.capture: {exc}") from None
        return cls(max_episodes, bool(record_states), fields, trajectory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_episodes": self.max_episodes,
            "record_states": self.record_states,
            "state_fields": list(self.state_fields),
            "capture": None if self.capture is None else self.capture.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> SessionConfig:
        if not isinstance(data, Mapping):
            raise invalid(f"config: expected a mapping, got {type(data).__name__}")
        return cls.create(
            data.get("max_episodes"),
            bool(data.get("record_states", False)),
            data.get("state_fields") or (),
            data.get("capture"),
        )

    def describe_difference(self, other: SessionConfig) -> str:
        diffs = [
            f"{name}={getattr(self, name)!r} (this worker asked for {getattr(other, name)!r})"
            for name in ("max_episodes", "record_states", "state_fields", "capture")
            if getattr(self, name) != getattr(other, name)
        ]
        return ", ".join(diffs)


# Trailing dtype and shape after (T, N) of each stored array key ("action", "state:x", ...).
Schema = dict[str, tuple[np.dtype, tuple[int, ...]]]

# (array key, shape, dtype) -> a C-contiguous array to decode that array into.
Allocator = Callable[[str, tuple[int, ...], np.dtype], np.ndarray]


@dataclass
class DecodedChunk:
    """A checked chunk: its done flags, its decoded arrays and their schema."""

    sequence: int
    length: int
    num_envs: int
    dones: np.ndarray
    arrays: dict[str, np.ndarray]
    schema: Schema = field(default_factory=dict)
    unverified: tuple[str, ...] = ()
    """Keys whose frames were checked from their headers only (see `decode_chunk`)."""


def _fresh(key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def decode_chunk(
    chunk: Chunk,
    config: SessionConfig,
    alloc: Allocator | None = None,
    lazy: Callable[[str], bool] | None = None,
) -> DecodedChunk:
    """Check one chunk on its own (shapes agree, dtypes and fields allowed, frames intact)
    and decode it; ``alloc`` gives the buffers the arrays are decoded into.

    The arrays for which ``lazy(key)`` is true are not decoded: their frames were checked
    from their headers (`encoded_array`: one whole frame that declares the array's size),
    and the entropy-coded content is proved later, off the ack path
    (`Session.verify`). The done flags, rewards and outcome codes are always decoded."""
    arrays = chunk.arrays
    for name in ("action", "reward", "done"):
        if name not in arrays:
            raise invalid(f"chunk.{name}: expected an array, got none")
    action = arrays["action"]
    if len(action.shape) not in (2, 3):
        raise invalid(f"chunk.action: expected shape (T, N) or (T, N, P), got {list(action.shape)}")
    length, n = action.shape[:2]
    if n < 1:  # the worker's N would be fixed at 0, and every later chunk refused
        raise invalid(f"chunk.action: expected N >= 1 environments, got shape {list(action.shape)}")
    tn = [length, n]
    for name in ("reward", "done"):
        if list(arrays[name].shape) != tn:
            raise invalid(
                f"chunk.{name}: expected shape {tn} (T, N) like chunk.action, "
                f"got {list(arrays[name].shape)}"
            )
    if arrays["done"].dtype != np.bool_:
        raise invalid(f"chunk.done.dtype: expected '|b1' (bool), got {arrays['done'].dtype.str!r}")
    allowed = set(config.state_fields) if config.record_states else set()
    sent = [k[len(STATE) :] for k in arrays if k.startswith(STATE)]
    if len(sent) > MAX_STATE_FIELDS:  # observation fields come unannounced: bounded here
        raise invalid(
            f"chunk.states: expected at most {MAX_STATE_FIELDS} state fields (observation "
            f"fields included), got {len(sent)}"
        )
    for name in sent:
        what = array_label("chunk", STATE + name)
        if name not in allowed and not is_obs_field(name):
            expected = sorted(allowed) if allowed else "none (record_states is off)"
            raise invalid(
                f"chunk.states: expected fields from {expected} or observation fields "
                f"('obs', 'obs.<key>'), got {_wire.shown(name)}"
            )
        shape = list(arrays[STATE + name].shape)
        if len(shape) < 2 or shape[:2] != tn:
            raise invalid(f"{what}: expected shape starting with {tn} (T, N), got {shape}")
    observed = [name for name in sent if is_obs_field(name)]
    problem = _wire.obs_names_error(observed) if observed else None
    if problem is not None:  # their names come unannounced: checked as the client does
        raise invalid(f"chunk.states: {problem}")
    if config.capture is not None:
        # The store keys cells on state fields; a chunk without them cannot feed it.
        for cell in config.capture.cell_fields:
            if cell.state_field not in sent:
                raise invalid(
                    f"chunk.states: expected the cell-key field {cell.state_field!r} of the "
                    f"session's capture configuration (record it with record_states=True), "
                    f"got fields {sorted(sent)}"
                )
    outcome = arrays.get("outcome")
    if outcome is not None and (list(outcome.shape) != tn or outcome.dtype.kind not in "iu"):
        raise invalid(
            f"chunk.outcome: expected integer codes of shape {tn} (T, N), "
            f"got {outcome.dtype} {list(outcome.shape)}"
        )
    check_contract_headers(arrays, tn)
    take = alloc or _fresh
    decoded: dict[str, np.ndarray] = {}
    schema: Schema = {}
    later: list[str] = []
    for key, enc in arrays.items():
        if in_schema(key):
            schema[key] = (enc.dtype, enc.shape[2:])
        if lazy is not None and key not in ALWAYS_DECODED and lazy(key):
            later.append(key)
            continue
        # The flags and the mask are read after the next decode: never into shared scratch.
        out = (_fresh if key in _CONTRACT_MASKS else take)(key, enc.shape, enc.dtype)
        try:
            enc.decode_into(out, f"chunk.{key}")
        except ValueError as exc:
            raise invalid(str(exc)) from None
        decoded[key] = out
    codes = decoded.get("outcome")
    if codes is not None and codes.size:
        bad = (codes < 0) | (codes >= _NUM_OUTCOMES)
        if bad.any():
            t, e = (int(i) for i in np.argwhere(bad)[0])
            raise invalid(
                f"chunk.outcome: expected codes 0..{_NUM_OUTCOMES - 1} (EpisodeOutcome), "
                f"got {int(codes[t, e])} at step {t} of environment {e}"
            )
    check_contract_values(decoded)
    return DecodedChunk(chunk.sequence, length, n, decoded["done"], decoded, schema, tuple(later))


def check_schema(
    expected: Schema | None,
    num_envs: int | None,
    chunk: DecodedChunk,
    open_empty: np.ndarray | None = None,
) -> None:
    """A chunk must match its worker's N and the session's dtypes, trailing shapes and state
    fields so far (None: nothing stored yet), and its valid mask the worker's open episodes
    (``open_empty``, see `check_open_rows`)."""
    if num_envs is not None and chunk.num_envs != num_envs:
        raise invalid(
            f"chunk.N: expected {num_envs} environments like this worker's earlier chunks, "
            f"got {chunk.num_envs}"
        )
    valid = chunk.arrays.get("valid")
    if valid is not None:
        check_open_rows(valid, chunk.dones, open_empty)
    if expected is None:
        return
    want = sorted(k[len(STATE) :] for k in expected if k.startswith(STATE))
    got = sorted(k[len(STATE) :] for k in chunk.schema if k.startswith(STATE))
    if want != got:
        raise invalid(
            f"chunk.states: expected fields {want} like the session's earlier chunks, got {got}"
        )
    for key, (dtype, trailing) in expected.items():
        got_dtype, got_trailing = chunk.schema[key]
        if got_dtype != dtype:
            raise invalid(
                f"chunk.{key}.dtype: expected {dtype} like the session's earlier chunks, "
                f"got {got_dtype}"
            )
        if got_trailing != trailing:
            raise invalid(
                f"chunk.{key}.shape: expected trailing shape {list(trailing)} after (T, N) like "
                f"the session's earlier chunks, got {list(got_trailing)}"
            )


def check_contract_headers(arrays: Mapping[str, EncodedArray], tn: list[int]) -> None:
    """The contract's optional arrays, from their headers (nothing decoded yet): the flags
    and the valid mask (T, N) bool, terminated and truncated together, and each
    ``final:<name>`` shaped like the chunk's ``state:<name>``."""
    for key in (*FLAGS, "valid"):
        enc = arrays.get(key)
        if enc is None:
            continue
        if list(enc.shape) != tn or enc.dtype != np.bool_:
            raise invalid(
                f"chunk.{key}: expected bool of shape {tn} (T, N) like chunk.action, "
                f"got {enc.dtype} {list(enc.shape)}"
            )
    if ("terminated" in arrays) != ("truncated" in arrays):
        given, missing = ("terminated", "truncated")[:: 1 if "terminated" in arrays else -1]
        raise invalid(
            f"chunk.{missing}: expected it alongside chunk.{given} (both or neither), got none"
        )
    for key, enc in arrays.items():
        if not key.startswith(FINAL):
            continue
        name = key[len(FINAL) :]
        state = arrays.get(STATE + name)
        what = f"chunk.finals[{_wire.shown(name)}]"
        if state is None:
            raise invalid(
                f"{what}: expected the state field {_wire.shown(name)} in the same chunk "
                "(a final state pairs with a recorded one), got none"
            )
        if state.dtype != enc.dtype or state.shape != enc.shape:
            raise invalid(
                f"{what}: expected {state.dtype} of shape {list(state.shape)} like "
                f"{array_label('chunk', STATE + name)}, got {enc.dtype} {list(enc.shape)}"
            )


def check_contract_values(decoded: dict[str, np.ndarray]) -> None:
    """``done`` is terminated | truncated, and a row the valid mask marks False carries no
    flag. Invalid rows' rewards and outcome codes read as zero from here on (the decoded
    copies only; the stored frames keep what was sent): no episode sums them."""
    done = decoded["done"]
    if "terminated" in decoded:
        term, trunc = decoded["terminated"], decoded["truncated"]
        cell = _wire.flags_disagree(done, term, trunc)
        if cell is not None:
            row, env = cell
            raise invalid(
                "chunk.done: expected terminated | truncated, got "
                f"done={bool(done[row, env])} with terminated={bool(term[row, env])} and "
                f"truncated={bool(trunc[row, env])} at row {row} of environment {env}"
            )
    valid = decoded.get("valid")
    if valid is None or valid.all():
        return
    cell = _wire.flag_on_invalid_row(valid, done)
    if cell is not None:
        row, env = cell
        raise invalid(
            f"chunk.valid: expected no done, terminated or truncated flag on a row marked "
            f"False, got one at row {row} of environment {env}"
        )
    for key in ("reward", "outcome"):
        if key in decoded:
            decoded[key][~valid] = 0


def check_open_rows(valid: np.ndarray, done: np.ndarray, open_empty: np.ndarray | None) -> None:
    """A False row of the valid mask only where that environment's open episode has no step
    yet: its first row, right after a done, or after another False row. ``open_empty``: (N,)
    whether each environment's open episode had no step before the chunk (None: none did)."""
    cell = _wire.invalid_row_in_episode(valid, done, open_empty)
    if cell is not None:
        row, env = cell
        raise invalid(
            f"chunk.valid: expected True at row {row} of environment {env}, got False: a row "
            "outside every episode may only stand where the environment's open episode has "
            "no step yet (its first row, right after a done, or after another False row)"
        )
