"""Durable, versioned checkpoint files.

A checkpoint is one opaque payload (the server's serialised state) framed by a header that
lets a reader refuse anything it cannot trust: a foreign file, a format it does not know, a
truncated copy or flipped bits.  A checkpoint is either returned whole or not at all.

File layout, format version 1 (all integers little-endian)::

    offset  size  field
    0       8     magic            b"RRCKPT\\r\\n"  (the CR LF catches text-mode mangling)
    8       2     format_version   uint16, currently 1
    10      2     flags            uint16; bit 0 = payload is zstd-compressed, others zero
    12      2     writer_len       uint16, length W of the next field (at most 64)
    14      W     writer_version   UTF-8, the version of the package that wrote the file
    14+W    8     stored_length    uint64, bytes of payload as stored (after compression)
    22+W    8     raw_length       uint64, bytes of payload after decompression
    30+W    32    sha256           SHA-256 of the stored payload bytes
    62+W    4     header_crc32     zlib.crc32 of header bytes [0, 62+W)
    66+W    ...   payload          exactly stored_length bytes, then end of file

The magic and the format version come first and never move, so a future reader can tell
which layout follows.  ``raw_length`` is checked against the caller's limit *before*
decompression, so a checkpoint shipped over the network cannot be a zstd bomb.

Writes are atomic: the bytes go to a temporary file in the destination directory, which is
flushed and fsynced, renamed over the final name with :func:`os.replace`, and the directory
is fsynced.  A crash or a full disk leaves either the old file or the new one under the
final name, never a mixture; the temporary file is removed on failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

import zstandard

from . import files

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "SUPPORTED_FORMAT_VERSIONS",
    "WRITER_VERSION",
    "CheckpointCorruptError",
    "CheckpointDirectory",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointInfo",
    "CheckpointTruncatedError",
    "NewestGood",
    "decode_checkpoint",
    "encode_checkpoint",
    "read_checkpoint",
    "safe_join",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

MAGIC = b"RRCKPT\r\n"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (1,)
WRITER_VERSION = "0.1.0"

FLAG_ZSTD = 0x0001
_KNOWN_FLAGS = FLAG_ZSTD
_MAX_WRITER_LEN = 64
_ZSTD_LEVEL = 3

_PREFIX = struct.Struct("<8sHHH")  # magic, format_version, flags, writer_len
_TAIL = struct.Struct("<QQ32s")  # stored_length, raw_length, sha256
_CRC = struct.Struct("<I")


class CheckpointError(Exception):
    """Base class: the checkpoint cannot be used.  Nothing was loaded."""


class CheckpointFormatError(CheckpointError):
    """Not a checkpoint, or a format version / flag this reader does not know."""


class CheckpointTruncatedError(CheckpointError):
    """The file ends before the header or the payload is complete."""


class CheckpointCorruptError(CheckpointError):
    """Checksum mismatch, undecodable payload or trailing bytes."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint header says (and, for a written file, where it is)."""

    format_version: int
    writer_version: str
    compressed: bool
    payload_bytes: int
    """Length of the payload as given to the writer (uncompressed)."""
    stored_bytes: int
    """Length of the payload as stored (compressed when ``compressed``)."""
    sha256: str
    """Hex SHA-256 of the stored payload bytes."""
    path: Path | None = None


# --------------------------------------------------------------------------- in memory


def _encode(payload: bytes, compress: bool, writer_version: str) -> tuple[bytes, CheckpointInfo]:
    raw = bytes(payload) if not isinstance(payload, bytes) else payload
    writer = writer_version.encode("utf-8")
    if len(writer) > _MAX_WRITER_LEN:
        raise ValueError(
            f"writer_version {writer_version!r} is {len(writer)} bytes of UTF-8; "
            f"at most {_MAX_WRITER_LEN} are allowed"
        )
    stored = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw) if compress else raw
    digest = hashlib.sha256(stored).digest()
    header = (
        _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_ZSTD if compress else 0, len(writer))
        + writer
        + _TAIL.pack(len(stored), len(raw), digest)
    )
    header += _CRC.pack(zlib.crc32(header))
    info = CheckpointInfo(
        format_version=FORMAT_VERSION,
        writer_version=writer_version,
        compressed=compress,
        payload_bytes=len(raw),
        stored_bytes=len(stored),
        sha256=digest.hex(),
    )
    return header + stored, info


def encode_checkpoint(
    payload: bytes, compress: bool = True, *, writer_version: str = WRITER_VERSION
) -> bytes:
    """Frame ``payload`` as checkpoint bytes (the file format), e.g. to ship it over a wire."""
    return _encode(payload, compress, writer_version)[0]


def _decode(
    data: bytes | memoryview, source: str, max_payload_bytes: int | None
) -> tuple[bytes, CheckpointInfo]:
    view = memoryview(data).cast("B")
    size = len(view)
    if size < len(MAGIC):
        if MAGIC.startswith(bytes(view)):
            raise CheckpointTruncatedError(
                f"{source}: truncated checkpoint: expected at least {_PREFIX.size} header "
                f"bytes, got {size}"
            )
        raise CheckpointFormatError(f"{source}: not a checkpoint (bad magic)")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise CheckpointFormatError(
            f"{source}: not a checkpoint: magic is {bytes(view[: len(MAGIC)])!r}, "
            f"expected {MAGIC!r}"
        )
    if size < _PREFIX.size:
        raise CheckpointTruncatedError(
            f"{source}: truncated checkpoint: expected at least {_PREFIX.size} header bytes, "
            f"got {size}"
        )
    _, version, flags, writer_len = _PREFIX.unpack_from(view)
    if version not in SUPPORTED_FORMAT_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_FORMAT_VERSIONS)
        raise CheckpointFormatError(
            f"{source}: checkpoint format version {version} is not supported; "
            f"this reader supports version(s) {supported}"
        )
    header_len = _PREFIX.size + writer_len + _TAIL.size + _CRC.size
    if size < header_len:
        raise CheckpointTruncatedError(
            f"{source}: truncated checkpoint: expected {header_len} header bytes, got {size}"
        )
    (crc,) = _CRC.unpack_from(view, header_len - _CRC.size)
    actual_crc = zlib.crc32(view[: header_len - _CRC.size])
    if crc != actual_crc:
        raise CheckpointCorruptError(
            f"{source}: checkpoint header checksum mismatch "
            f"(stored crc32 {crc:#010x}, computed {actual_crc:#010x})"
        )
    if flags & ~_KNOWN_FLAGS:
        raise CheckpointFormatError(
            f"{source}: unknown checkpoint flags {flags:#06x} (known: {_KNOWN_FLAGS:#06x})"
        )
    writer = bytes(view[_PREFIX.size : _PREFIX.size + writer_len]).decode("utf-8", "replace")
    stored_len, raw_len, digest = _TAIL.unpack_from(view, _PREFIX.size + writer_len)
    compressed = bool(flags & FLAG_ZSTD)
    if max_payload_bytes is not None and raw_len > max_payload_bytes:
        raise CheckpointFormatError(
            f"{source}: checkpoint payload declares {raw_len} bytes, "
            f"more than the limit of {max_payload_bytes}"
        )
    if not compressed and stored_len != raw_len:
        raise CheckpointCorruptError(
            f"{source}: uncompressed checkpoint declares stored length {stored_len} "
            f"!= raw length {raw_len}"
        )
    got = size - header_len
    if got < stored_len:
        raise CheckpointTruncatedError(
            f"{source}: truncated checkpoint: expected {stored_len} payload bytes, got {got}"
        )
    if got > stored_len:
        raise CheckpointCorruptError(
            f"{source}: {got - stored_len} unexpected bytes after the {stored_len}-byte payload"
        )
    stored = view[header_len:]
    actual = hashlib.sha256(stored).digest()
    if actual != digest:
        raise CheckpointCorruptError(
            f"{source}: sha256 mismatch: header says {digest.hex()}, "
            f"payload hashes to {actual.hex()}; the checkpoint is corrupt"
        )
    if compressed:
        try:
            payload = zstandard.ZstdDecompressor().decompress(
                stored, max_output_size=max(raw_len, 1)
            )
        except zstandard.ZstdError as exc:
            raise CheckpointCorruptError(f"{source}: cannot decompress payload: {exc}") from exc
        if len(payload) != raw_len:
            raise CheckpointCorruptError(
                f"{source}: payload decompressed to {len(payload)} bytes, header says {raw_len}"
            )
    else:
        payload = bytes(stored)
    info = CheckpointInfo(
        format_version=version,
        writer_version=writer,
        compressed=compressed,
        payload_bytes=raw_len,
        stored_bytes=stored_len,
        sha256=digest.hex(),
    )
    return payload, info


def decode_checkpoint(
    data: bytes | bytearray | memoryview,
    *,
    max_payload_bytes: int | None = None,
    source: str = "<checkpoint bytes>",
) -> bytes:
    """Verify and unframe checkpoint bytes; raise a :class:`CheckpointError` on any defect.

    ``max_payload_bytes`` bounds the declared uncompressed size (checked before any
    decompression); ``source`` names the data in error messages.
    """
    return _decode(data, source, max_payload_bytes)[0]


# --------------------------------------------------------------------------- files


def write_checkpoint(
    path: str | os.PathLike[str],
    payload: bytes,
    *,
    compress: bool,
    writer_version: str = WRITER_VERSION,
) -> CheckpointInfo:
    """Atomically write ``payload`` as a checkpoint file at ``path``.

    Returns the header information.  On any error (``OSError`` such as ``ENOSPC``
    propagates unchanged) the temporary file is removed and whatever was at ``path``
    before is left untouched.
    """
    target = Path(path)
    data, info = _encode(payload, compress, writer_version)
    files.atomic_write(target, data)
    return dataclasses.replace(info, path=target)


def read_checkpoint(path: str | os.PathLike[str], *, max_payload_bytes: int | None = None) -> bytes:
    """Read and verify a checkpoint file; return its payload or raise CheckpointError.

    ``OSError`` (missing file, permissions) propagates as is.
    """
    target = Path(path)
    data = target.read_bytes()
    return _decode(data, str(target), max_payload_bytes)[0]


# --------------------------------------------------------------------------- names


_FORBIDDEN_CHARS = {"/", "\\", "\x00"}


def safe_join(root: str | os.PathLike[str], name: str) -> Path:
    """Return ``root / name`` if ``name`` is one harmless path component, else ValueError.

    Refused (ValueError): the empty string, ``.`` and ``..``, absolute paths, and names
    containing ``/``, ``\\``, NUL or other control characters, or longer than 255 bytes.
    A name that is not a ``str`` raises TypeError.
    """
    if not isinstance(name, str):
        raise TypeError(f"unsafe name {name!r}: expected a str, got {type(name).__name__}")
    reason = None
    if name in ("", ".", ".."):
        reason = "empty, '.' and '..' are not names"
    elif os.path.isabs(name):
        reason = "absolute paths are not allowed"
    elif any(ch in _FORBIDDEN_CHARS for ch in name):
        reason = "path separators and NUL are not allowed"
    elif any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        reason = "control characters are not allowed"
    elif len(name.encode("utf-8", "surrogatepass")) > 255:
        reason = "longer than 255 bytes"
    if reason is not None:
        raise ValueError(f"unsafe name {name!r}: {reason}")
    base = Path(root)
    joined = base / name
    if joined.parent != base:  # belt and braces: must be a direct child of root
        raise ValueError(f"unsafe name {name!r}: escapes {str(base)!r}")
    return joined


# --------------------------------------------------------------------------- directory


# ckpt-<step>.rrc, and ckpt-<step>.<copy>.rrc for a second copy of the same state.
_NAME_RE = re.compile(r"^ckpt-(\d{12})(?:\.([1-9]))?\.rrc$")
_TMP_RE = re.compile(r"^\.ckpt-\d{12}(?:\.[1-9])?\.rrc\..*\.tmp$")


class NewestGood(NamedTuple):
    """Result of :meth:`CheckpointDirectory.newest_good`."""

    path: Path | None
    """The newest readable checkpoint, or None when there is none."""
    payload: bytes | None
    skipped: list[tuple[Path, str]]
    """Newer checkpoints that could not be used, newest first, with the reason."""


class CheckpointDirectory:
    """Checkpoints of one session in one directory, named ``ckpt-{step:012d}.rrc``.

    Names are generated from the integer step, never taken from user input.  One writer
    per directory is assumed (the server holds the session).
    """

    def __init__(
        self, root: str | os.PathLike[str], *, writer_version: str = WRITER_VERSION
    ) -> None:
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._writer_version = writer_version

    @property
    def root(self) -> Path:
        return self._root

    def path_for(self, step: int, copy: int = 0) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
            raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
        if copy not in range(10):
            raise ValueError(f"copy must be an int in [0, 10), got {copy!r}")
        suffix = f".{copy}" if copy else ""
        return self._root / f"ckpt-{step:012d}{suffix}.rrc"

    def save(self, payload: bytes, step: int, compress: bool = True, *, copy: int = 0) -> Path:
        """Atomically write the checkpoint for ``step`` (replacing one of the same step and
        copy). ``copy`` > 0: another copy of the same state, a fallback when the first copy
        is found corrupt."""
        path = self.path_for(step, copy)
        write_checkpoint(path, payload, compress=compress, writer_version=self._writer_version)
        return path

    def checkpoints(self) -> list[tuple[int, Path]]:
        """All checkpoint files as ``(step, path)``, oldest first (of one step, the further
        copies before the first, which is tried first)."""
        found = []
        for entry in os.scandir(self._root):
            match = _NAME_RE.match(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                copy = int(match.group(2) or 0)
                found.append((int(match.group(1)), -copy, Path(entry.path)))
        found.sort()
        return [(step, path) for step, _, path in found]

    def remove(self, paths: list[Path]) -> None:
        """Delete checkpoint files (then fsync the directory)."""
        for path in paths:
            path.unlink(missing_ok=True)
        if paths:
            files.fsync_directory(self._root)

    def keep(self, k: int) -> list[Path]:
        """Delete all but the newest ``k`` checkpoints (and stale temporary files).

        Call it after a successful :meth:`save`; it goes by step, not by readability.
        Returns the removed checkpoint paths.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        checkpoints = self.checkpoints()
        doomed = [path for _, path in checkpoints[:-k]] if len(checkpoints) > k else []
        for entry in os.scandir(self._root):
            if _TMP_RE.match(entry.name):
                logger.info("removing stale temporary checkpoint %s", entry.path)
                Path(entry.path).unlink(missing_ok=True)
        self.remove(doomed)
        return doomed

    def newest_good(self, *, max_payload_bytes: int | None = None) -> NewestGood:
        """Load the newest checkpoint that verifies, skipping (and reporting) bad ones."""
        skipped: list[tuple[Path, str]] = []
        for _, path in reversed(self.checkpoints()):
            try:
                payload = read_checkpoint(path, max_payload_bytes=max_payload_bytes)
            except (CheckpointError, OSError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                logger.warning("skipping unusable checkpoint %s: %s", path, reason)
                skipped.append((path, reason))
                continue
            return NewestGood(path, payload, skipped)
        return NewestGood(None, None, skipped)
