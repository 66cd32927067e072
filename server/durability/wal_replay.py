"""Reading a write-ahead log back (the writer is wal.py): the on-disk layout, validation of
segments, torn tails and corruption, and replay.

On-disk layout (all integers little-endian)
-------------------------------------------
A log is one directory holding segment files ``wal-{first_index:016d}.log`` and a lock
file ``wal.lock``.  Each segment starts with a 24-byte segment header::

    magic b"RRWALSEG" (8) | version uint16 = 2 | flags uint16 = 0 | first_index uint64
    | crc32 of the preceding 20 bytes (uint32)

followed by records, each a 24-byte record header and the body::

    marker b"RRWL" (4) | length uint32 | index uint64 | crc32(body) uint32
    | crc32 of the preceding 20 header bytes (uint32) | body (length bytes)

Record indexes are consecutive from 0 (or ``start_index`` for a new log) across segments.
A new segment starts when the next record would push the current one past
``segment_bytes``; a record larger than that gets a segment of its own.

Recovery (see :func:`replay`)
-----------------------------
*Torn tail*: in the **last** segment, a final record that is incomplete (short header,
short body), whose body checksum fails while it ends exactly at end of file, or that is
followed by nothing but zero bytes, is what an interrupted append leaves behind.  It is
dropped, reported (:class:`TornTail`: segment, offset, bytes) and truncated from the file,
so appending continues cleanly.

*Corruption*: any other bad record (a checksum failure with data after it, a wrong index,
a bad header in a non-last segment, a gap between segments).  Framing cannot be trusted
past a bad record, so the rest of **that segment** is not read; replay reports it
(:class:`Corruption`, with the range of indexes lost) and **continues with the next
segment**, whose records are independently framed and indexed.  Good data in later
segments is therefore never thrown away, and nothing is skipped silently: a clean log has
``result.clean`` true.  Corrupt bytes are never deleted automatically; when the *last*
segment is corrupt, :class:`WriteAheadLog` leaves it in place and starts a new segment at
an index past anything the corrupt bytes could hold, so new records stay reachable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("recorder_server.durability.wal")

SEGMENT_MAGIC = b"RRWALSEG"
# 2: record bodies are durability/records.py's (1 held protobuf messages).
SEGMENT_VERSION = 2
RECORD_MARKER = b"RRWL"
_SEG = struct.Struct("<8sHHQI")
_REC = struct.Struct("<4sIQII")
RECORD_HEADER_BYTES = _REC.size
_NAME_RE = re.compile(r"^wal-(\d{16})\.log$")
_LOCK_NAME = "wal.lock"
_ZERO_SCAN_CHUNK = 1 << 20
# Bytes of a torn tail kept for the report.
TORN_HEAD_BYTES = 1024


class WALError(Exception):
    """Base class for write-ahead log errors (closed, unusable, locked…)."""


class WALFormatError(WALError):
    """A segment written in a format version this code does not know."""


class WALCorruptionError(WALError):
    """Data changed under a reader, or cannot be trusted."""


@dataclasses.dataclass(frozen=True)
class TornTail:
    """An interrupted append at the end of the last segment, dropped and truncated."""

    segment: Path
    offset: int
    """Byte offset in ``segment`` where the dropped bytes started (the new file size)."""
    dropped_bytes: int
    reason: str
    index: int | None = None
    """Index the dropped record would have had."""
    head: bytes = b""
    """The first dropped bytes (at most TORN_HEAD_BYTES): whose record it was, if they
    hold that much."""

    def __str__(self) -> str:
        record = "" if self.index is None else f" (record {self.index}, never wholly written)"
        return (
            f"{self.segment}: dropped a torn tail of {self.dropped_bytes} bytes at offset "
            f"{self.offset}{record}: {self.reason}"
        )


@dataclasses.dataclass(frozen=True)
class Corruption:
    """A bad record (or a gap); the rest of ``segment`` after ``offset`` was not read."""

    segment: Path
    offset: int
    first_missing: int
    """Index of the first record that could not be recovered."""
    missing_until: int | None
    """Index where readable records resume (None: unknown, nothing follows)."""
    reason: str
    unread_bytes: int = 0
    """Bytes from ``offset`` to the end of ``segment`` that could not be read."""

    def __str__(self) -> str:
        where = f"{self.segment}: {self.reason} at offset {self.offset}"
        first, until, unread = self.first_missing, self.missing_until, self.unread_bytes
        # Every record takes more than a record header: a bound on what the bytes held.
        most = max(1, unread // _REC.size) if unread else None
        if until is None:
            return (
                f"{where}; its last {unread} bytes are unreadable: the record at index {first} "
                f"and any after it in those bytes are lost (at most {most})"
            )
        if until <= first:
            return f"{where}; no record is lost"
        if until == first + 1:
            return f"{where}; record {first} is lost"
        if most is not None and most < until - first:
            return (
                f"{where}; records from index {first} are lost: at most {most} of indexes "
                f"{first} to {until - 1}, in {unread} unreadable bytes"
            )
        return f"{where}; records {first} to {until - 1} are lost"


def segment_name(first_index: int) -> str:
    return f"wal-{first_index:016d}.log"


def _list_segments(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in os.scandir(directory):
        match = _NAME_RE.match(entry.name)
        if match and entry.is_file(follow_symlinks=False):
            found.append((int(match.group(1)), Path(entry.path)))
    found.sort()
    return found


def _segment_header(first_index: int) -> bytes:
    head = _SEG.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, first_index, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def _record_header(index: int, parts: list[memoryview], length: int) -> bytes:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    head = _REC.pack(RECORD_MARKER, length, index, crc, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


class _Scan(NamedTuple):
    size: int
    valid_end: int  # offset after the last good record; 0 when the segment header is bad
    next_index: int  # index of the first record not recovered
    problem: str | None
    problem_offset: int
    torn: bool


def _rest_is_zero(f: BinaryIO, offset: int, size: int) -> bool:
    f.seek(offset)
    while offset < size:
        chunk = f.read(min(_ZERO_SCAN_CHUNK, size - offset))
        if not chunk or chunk.count(0) != len(chunk):
            return False
        offset += len(chunk)
    return True


def _scan_segment(path: Path, first_index: int, is_last: bool) -> _Scan:
    """Validate one segment; classify the first bad spot as torn (last segment) or corrupt."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def bad(offset: int, index: int, valid_end: int, reason: str, torn_like: bool) -> _Scan:
            torn = is_last and (torn_like or _rest_is_zero(f, offset, size))
            return _Scan(size, valid_end, index, reason, offset, torn)

        head = f.read(_SEG.size)
        if len(head) < _SEG.size:
            return bad(0, first_index, 0, f"short segment header ({len(head)} bytes)", True)
        magic, version, _flags, seg_first, crc = _SEG.unpack(head)
        if magic != SEGMENT_MAGIC or zlib.crc32(head[:-4]) != crc:
            return bad(0, first_index, 0, "bad segment header (magic or crc32)", False)
        if version != SEGMENT_VERSION:
            raise WALFormatError(
                f"{path}: segment format version {version} is not supported "
                f"(this code reads version {SEGMENT_VERSION}; a log written by another version "
                "of rollout-recorder: recover it with that version, or move it away)"
            )
        if seg_first != first_index:
            return bad(0, first_index, 0, f"segment header says first index {seg_first}", False)
        offset, index = _SEG.size, first_index
        while offset < size:
            remaining = size - offset
            if remaining < _REC.size:
                reason = f"short record header ({remaining} of {_REC.size} bytes)"
                return bad(offset, index, offset, reason, True)
            rec = f.read(_REC.size)
            marker, length, rec_index, body_crc, head_crc = _REC.unpack(rec)
            if marker != RECORD_MARKER or zlib.crc32(rec[:-4]) != head_crc:
                return bad(offset, index, offset, "bad record header (marker or crc32)", False)
            if rec_index != index:
                reason = f"record index {rec_index}, expected {index}"
                return bad(offset, index, offset, reason, False)
            if remaining - _REC.size < length:
                reason = f"short record body ({remaining - _REC.size} of {length} bytes)"
                return bad(offset, index, offset, reason, True)
            body = f.read(length)
            end = offset + _REC.size + length
            if zlib.crc32(body) != body_crc:
                return bad(offset, index, offset, "record body crc32 mismatch", end == size)
            offset, index = end, index + 1
        return _Scan(size, offset, index, None, offset, False)


def _resume_index(scan: _Scan) -> int:
    """First index safely past anything the unreadable bytes of a segment could hold."""
    return scan.next_index + max(1, (scan.size - scan.problem_offset) // _REC.size)


class _DirLock:
    def __init__(self, directory: Path) -> None:
        self._path = directory / _LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise WALError(
                    f"write-ahead log {self._path.parent} is in use "
                    f"(another writer holds {self._path})"
                ) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Span(NamedTuple):
    path: Path
    first_index: int
    count: int


@dataclasses.dataclass
class ReplayResult:
    """What :func:`replay` found.  Iterate it for ``(index, record)`` in index order."""

    directory: Path
    start_index: int
    next_index: int
    """The index :class:`WriteAheadLog` will give the next record."""
    records: int
    """Number of records the iteration yields (those with index >= start_index)."""
    segments: int
    """Number of segment files read."""
    torn_tail: TornTail | None = None
    corruptions: list[Corruption] = dataclasses.field(default_factory=list)
    _spans: list[_Span] = dataclasses.field(default_factory=list, repr=False)

    @property
    def clean(self) -> bool:
        return self.torn_tail is None and not self.corruptions

    @property
    def dropped_bytes(self) -> int:
        return self.torn_tail.dropped_bytes if self.torn_tail else 0

    @property
    def dropped_records(self) -> int:
        """Partial records dropped from the tail (0 or 1)."""
        return 1 if self.dropped_bytes else 0

    @property
    def dropped_segment(self) -> Path | None:
        return self.torn_tail.segment if self.torn_tail else None

    def __len__(self) -> int:
        return self.records

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        for span in self._spans:
            with open(span.path, "rb") as f:
                f.seek(_SEG.size)
                for index in range(span.first_index, span.first_index + span.count):
                    rec = f.read(_REC.size)
                    if len(rec) < _REC.size:
                        raise WALCorruptionError(f"{span.path}: shrank while being replayed")
                    _, length, rec_index, body_crc, _ = _REC.unpack(rec)
                    if index < self.start_index:
                        f.seek(length, os.SEEK_CUR)
                        continue
                    body = f.read(length)
                    if rec_index != index or len(body) != length or zlib.crc32(body) != body_crc:
                        raise WALCorruptionError(
                            f"{span.path}: record {index} changed while being replayed"
                        )
                    yield index, body


def replay(
    directory: str | os.PathLike[str], *, start_index: int = 0, repair: bool = True
) -> ReplayResult:
    """Validate the log in ``directory`` and return what can be replayed from ``start_index``.

    Segments entirely below ``start_index`` are not read.  With ``repair`` (the default) a
    torn tail is truncated from the last segment; this takes the directory lock, so it
    refuses to run while a :class:`WriteAheadLog` has the directory open.  With
    ``repair=False`` nothing is written or locked.  A missing directory is an empty log.
    """
    root = Path(directory)
    if not root.is_dir():
        return ReplayResult(root, start_index, start_index, 0, 0)
    lock = _DirLock(root)
    if repair:
        lock.acquire()
    try:
        return _replay(root, start_index, repair)
    finally:
        lock.release()


def _replay(root: Path, start_index: int, repair: bool) -> ReplayResult:
    segments = _list_segments(root)
    if not segments:
        return ReplayResult(root, start_index, start_index, 0, 0)
    first = 0
    while first + 1 < len(segments) and segments[first + 1][0] <= start_index:
        first += 1
    result = ReplayResult(root, start_index, start_index, 0, 0)
    expected: int | None = None
    for i in range(first, len(segments)):
        seg_first, path = segments[i]
        is_last = i == len(segments) - 1
        if expected is not None and seg_first != expected:
            result.corruptions.append(
                Corruption(
                    path,
                    0,
                    min(expected, seg_first),
                    max(expected, seg_first),
                    f"segment starts at index {seg_first}, previous segment ended before "
                    f"{expected}",
                )
            )
            if seg_first < expected:  # overlapping segments: trust neither, skip this one
                continue
        scan = _scan_segment(path, seg_first, is_last)
        result.segments += 1
        count = scan.next_index - seg_first
        if count:
            result._spans.append(_Span(path, seg_first, count))
            result.records += max(0, scan.next_index - max(seg_first, start_index))
        expected = scan.next_index
        if scan.problem is None:
            continue
        if scan.torn:
            dropped = scan.size - scan.problem_offset
            with open(path, "rb") as f:
                f.seek(scan.problem_offset)
                head = f.read(min(dropped, TORN_HEAD_BYTES))
            if repair:
                _truncate(path, scan.valid_end)
            logger.warning(
                "write-ahead log %s: dropped torn tail of %d bytes at offset %d: %s",
                path,
                dropped,
                scan.problem_offset,
                scan.problem,
            )
            result.torn_tail = TornTail(
                path, scan.problem_offset, dropped, scan.problem, scan.next_index, head
            )
        else:
            until = segments[i + 1][0] if not is_last else None
            corruption = Corruption(
                path,
                scan.problem_offset,
                scan.next_index,
                until,
                scan.problem,
                scan.size - scan.problem_offset,
            )
            logger.error("write-ahead log %s", corruption)
            result.corruptions.append(corruption)
            expected = until if until is not None else _resume_index(scan)
    result.next_index = max(expected if expected is not None else start_index, start_index)
    return result


def _truncate(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
