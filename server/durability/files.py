"""File helpers for everything durability writes: whole writes, fsyncs, atomic replaces.

The write-ahead log and the checkpoints call these through the module (``files.write_all``),
so that a test can inject a torn write or a full disk in one place.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


# writev takes at most this many buffers a call (EINVAL beyond); a chunk with many state
# fields has more parts than that.
def _iov_max() -> int:
    try:
        return max(os.sysconf("SC_IOV_MAX"), 16)  # -1: no limit stated; 16, POSIX's least
    except (AttributeError, OSError, ValueError):
        return 16


_IOV_MAX = _iov_max()


def write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write every byte of ``parts`` in order (os.writev, resumed after short writes)."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while written and views:
            if written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][written:]
                written = 0


def fdatasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so that creates, renames and unlinks in it are durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsync, rename, fsync the directory.
    On any error the temporary file is removed and what was at ``path`` stays."""
    directory = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        try:
            write_all(fd, [data])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:  # best effort; the original error matters more
            logger.warning("could not remove temporary file %s", tmp)
        raise
    fsync_directory(directory)


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
