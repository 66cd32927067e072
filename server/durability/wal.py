"""Segmented write-ahead log of opaque records (the server logs each chunk before its ack).

The layout on disk, and reading a log back (:func:`replay`), are in wal_replay.py.

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

Concurrency: ``append`` is thread-safe.  One ``WriteAheadLog`` per directory (an ``flock``
on ``wal.lock`` enforces it across processes); run :func:`replay` before opening the
writer, and iterate its result before calling :meth:`WriteAheadLog.truncate_before`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Self

from . import files
from .wal_replay import (
    _REC,
    _SEG,
    RECORD_MARKER,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    Corruption,
    ReplayResult,
    TornTail,
    WALCorruptionError,
    WALError,
    WALFormatError,
    _DirLock,
    _list_segments,
    _record_header,
    _resume_index,
    _scan_segment,
    _segment_header,
    _truncate,
    replay,
    segment_name,
)

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "FSYNC_POLICIES",
    "MAX_RECORD_BYTES",
    "RECORD_MARKER",
    "SEGMENT_MAGIC",
    "SEGMENT_VERSION",
    "Corruption",
    "ReplayResult",
    "TornTail",
    "WALCorruptionError",
    "WALError",
    "WALFormatError",
    "WriteAheadLog",
    "replay",
    "segment_name",
]

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
FsyncPolicy = Literal["always", "batch", "never"]
FSYNC_POLICIES: tuple[str, ...] = ("always", "batch", "never")
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
MAX_RECORD_BYTES = 0xFFFF_FFFF


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
