"""Segmented write-ahead log of opaque records (the server logs each chunk before its ack).

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

Durability (``fsync=``)
-----------------------
``"always"``  append() returns after the record is fdatasync'ed.  Concurrent appenders
              share one fdatasync (group commit).
``"batch"``   append() returns once the record is in the page cache; a background thread
              fdatasyncs at most every ``batch_window_s``.  Window of exposure: records
              appended in the last ``batch_window_s`` (plus the duration of one fsync) can
              be lost on power failure or kernel crash, never on a process kill, because
              they are already in the kernel's page cache.
``"never"``   the OS decides when to write back (``sync()`` still forces it).  Process kills
              lose nothing; a power failure can lose or tear any unsynced record.
In ``always`` and ``batch`` a finished segment is fsynced before the next one is created and
the directory is fsynced after a segment is created or removed.

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

Concurrency: ``append`` is thread-safe.  One ``WriteAheadLog`` per directory (an ``flock``
on ``wal.lock`` enforces it across processes); run :func:`replay` before opening the
writer, and iterate its result before calling :meth:`WriteAheadLog.truncate_before`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Literal, NamedTuple, Self

from . import files

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "FSYNC_POLICIES",
    "MAX_RECORD_BYTES",
    "Corruption",
    "ReplayResult",
    "TornTail",
    "WALCorruptionError",
    "WALError",
    "WALFormatError",
    "WriteAheadLog",
    "replay",
]

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
FsyncPolicy = Literal["always", "batch", "never"]
FSYNC_POLICIES: tuple[str, ...] = ("always", "batch", "never")
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
MAX_RECORD_BYTES = 0xFFFF_FFFF

SEGMENT_MAGIC = b"RRWALSEG"
# 2: record bodies are durability/records.py's (1 held protobuf messages).
SEGMENT_VERSION = 2
RECORD_MARKER = b"RRWL"
_SEG = struct.Struct("<8sHHQI")
_REC = struct.Struct("<4sIQII")
_NAME_RE = re.compile(r"^wal-(\d{16})\.log$")
_LOCK_NAME = "wal.lock"
_ZERO_SCAN_CHUNK = 1 << 20


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
                path, scan.problem_offset, dropped, scan.problem, scan.next_index
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


class WriteAheadLog:
    """Append-only, segmented, crash-safe record log (see the module docstring).

    ``start_index`` is the lowest index the next record may get: pass the index the last
    checkpoint expects next.  A new log starts there; a log that ends below it (its tail
    was lost, or its directory was wiped) continues in a new segment starting there, so a
    record is never given an index the checkpoint already covers (and replay from the
    checkpoint would skip).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "always",
        batch_window_s: float = 0.05,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        start_index: int = 0,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if not batch_window_s > 0:
            raise ValueError(f"batch_window_s must be > 0, got {batch_window_s!r}")
        if segment_bytes <= _SEG.size + _REC.size:
            raise ValueError(
                f"segment_bytes must be > {_SEG.size + _REC.size}, got {segment_bytes!r}"
            )
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index!r}")
        self._dir = Path(directory)
        self._fsync = fsync
        self._window = float(batch_window_s)
        self._segment_bytes = segment_bytes
        self._lock = threading.Lock()  # guards every field below
        self._sync_lock = threading.Lock()  # serialises fdatasync callers (group commit)
        self._closed = False
        self._failed: OSError | None = None
        self._segments: list[tuple[int, Path]] = []
        self._fd = -1
        self._dir.mkdir(parents=True, exist_ok=True)
        self._dirlock = _DirLock(self._dir)
        self._dirlock.acquire()
        try:
            self._open(start_index)
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
            self._dirlock.release()
            raise
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if fsync == "batch":
            self._flusher = threading.Thread(
                target=self._flush_loop, name=f"wal-flush:{self._dir.name}", daemon=True
            )
            self._flusher.start()

    # ------------------------------------------------------------------ opening

    def _open(self, start_index: int) -> None:
        self._segments = _list_segments(self._dir)
        if not self._segments:
            self._start_segment(start_index)
            return
        seg_first, path = self._segments[-1]
        scan = _scan_segment(path, seg_first, is_last=True)
        if scan.problem is not None and not scan.torn:
            resume = max(_resume_index(scan), start_index)
            logger.error(
                "write-ahead log %s: last segment corrupt at offset %d (%s); leaving it in "
                "place and continuing in a new segment at index %d",
                path,
                scan.problem_offset,
                scan.problem,
                resume,
            )
            self._start_segment(resume)
            return
        if scan.problem is not None:
            logger.warning(
                "write-ahead log %s: truncating torn tail of %d bytes at offset %d: %s",
                path,
                scan.size - scan.problem_offset,
                scan.problem_offset,
                scan.problem,
            )
            if scan.valid_end < _SEG.size:  # not even a segment header: start it afresh
                path.unlink()
                self._segments.pop()
                self._start_segment(max(seg_first, start_index))
                return
            _truncate(path, scan.valid_end)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._size = scan.valid_end
        self._next = scan.next_index
        self._synced = self._next
        if self._fsync != "never":
            files.fdatasync(self._fd)
        if self._next < start_index:
            logger.warning(
                "write-ahead log %s ends before index %d (next would be %d); continuing in "
                "a new segment at %d",
                self._dir,
                start_index,
                self._next,
                start_index,
            )
            self._roll(start_index)

    def _create_segment(self, first_index: int) -> tuple[int, Path]:
        path = self._dir / segment_name(first_index)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            files.write_all(fd, [_segment_header(first_index)])
            if self._fsync != "never":
                files.fdatasync(fd)
                files.fsync_directory(self._dir)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return fd, path

    def _start_segment(self, first_index: int) -> None:
        """Create and switch to a new segment when no segment is open."""
        self._fd, path = self._create_segment(first_index)
        self._segments.append((first_index, path))
        self._size = _SEG.size
        self._next = first_index
        self._synced = first_index

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def fsync_policy(self) -> str:
        return self._fsync

    @property
    def next_index(self) -> int:
        """Index the next appended record will get."""
        with self._lock:
            return self._next

    def segment_paths(self) -> list[Path]:
        with self._lock:
            return [path for _, path in self._segments]

    # ------------------------------------------------------------------ writing

    def _check_usable(self) -> None:
        if self._closed:
            raise WALError(f"write-ahead log {self._dir} is closed")
        if self._failed is not None:
            raise WALError(
                f"write-ahead log {self._dir} is unusable after an I/O error "
                f"({self._failed}); reopen it to recover"
            ) from self._failed

    def _fail(self, exc: OSError) -> None:
        if self._failed is None:
            self._failed = exc
            logger.error("write-ahead log %s: refusing further appends: %s", self._dir, exc)

    def append(self, record: bytes | bytearray | memoryview | Sequence[Buffer]) -> int:
        """Append one record (a buffer, or a sequence of buffers that make one record body
        together, written without joining them); return its index.  Thread-safe.

        With ``fsync="always"`` the record is on disk when this returns.  An ``OSError``
        (e.g. ENOSPC) propagates; the partial record is truncated away so the log stays
        consistent and the index is not consumed.  If even that truncation fails, the log
        refuses further appends (:class:`WALError`) until reopened, and the partial record
        is dropped as a torn tail on the next open.
        """
        pieces = record if isinstance(record, (list, tuple)) else [record]
        parts = [memoryview(p).cast("B") for p in pieces]
        length = sum(p.nbytes for p in parts)
        if length > MAX_RECORD_BYTES:
            raise ValueError(f"record is {length} bytes; at most {MAX_RECORD_BYTES} are allowed")
        with self._lock:
            self._check_usable()
            if self._size > _SEG.size and self._size + _REC.size + length > self._segment_bytes:
                self._roll(self._next)
            index = self._next
            try:
                files.write_all(self._fd, [_record_header(index, parts, length), *parts])
            except BaseException:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError as exc:
                    self._fail(exc)
                raise
            self._size += _REC.size + length
            self._next = index + 1
        if self._fsync == "always":
            self._sync_through(index + 1)
        return index

    def rotate(self) -> None:
        """Go on in a new segment (unless the current one is empty), so that truncate_before
        can delete every record written so far."""
        with self._lock:
            self._check_usable()
            if self._size > _SEG.size:
                self._roll(self._next)

    def _roll(self, first_index: int) -> None:
        """Finish the current segment and continue in a new one (caller holds the lock)."""
        fd, path = self._create_segment(first_index)
        old = self._fd
        if self._fsync != "never":
            try:
                files.fdatasync(old)
            except OSError as exc:
                os.close(fd)
                self._fail(exc)
                raise
        os.close(old)
        self._fd = fd
        self._segments.append((first_index, path))
        self._size = _SEG.size
        self._next = first_index
        if self._fsync != "never":
            self._synced = first_index

    def _sync_through(self, need: int | None) -> None:
        """fdatasync until records below ``need`` (default: all written) are durable."""
        with self._sync_lock:
            with self._lock:
                target = self._next if need is None else need
                if self._synced >= target:
                    return
                self._check_usable()
                target = self._next
                fd = os.dup(self._fd)  # the segment may be rolled and closed meanwhile
            try:
                files.fdatasync(fd)
            except OSError as exc:
                with self._lock:
                    self._fail(exc)
                raise
            finally:
                os.close(fd)
            with self._lock:
                self._synced = max(self._synced, target)

    def sync(self) -> None:
        """Make every record appended so far durable, whatever the fsync policy."""
        self._sync_through(None)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._window):
            try:
                self._sync_through(None)
            except WALError:
                return
            except OSError:
                logger.exception("write-ahead log %s: background fsync failed", self._dir)
                return

    def truncate_before(self, index: int) -> int:
        """Delete whole segments whose records all have indexes < ``index``.

        Call it once a durable checkpoint covers those records.  The current segment is
        never deleted.  Returns the number of segment files removed.
        """
        with self._lock:
            if self._closed:
                raise WALError(f"write-ahead log {self._dir} is closed")
            removed = 0
            while len(self._segments) >= 2 and self._segments[1][0] <= index:
                _, path = self._segments.pop(0)
                path.unlink(missing_ok=True)
                removed += 1
            if removed and self._fsync != "never":
                files.fsync_directory(self._dir)
            return removed

    def close(self) -> None:
        """Stop the flusher, sync (unless ``fsync="never"``) and release the directory."""
        self._stop.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()
        with self._sync_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._fsync != "never" and self._failed is None and self._synced < self._next:
                    files.fdatasync(self._fd)
                    self._synced = self._next
            finally:
                os.close(self._fd)
                self._dirlock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"WriteAheadLog({str(self._dir)!r}, fsync={self._fsync!r}, "
            f"next_index={self._next}, segments={len(self._segments)})"
        )
