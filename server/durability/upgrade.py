"""Which format versions a data directory holds, and converting it in place to the current ones.

Versions carried on disk (the server reads the current one and the one before):

================  ==========================================  =======  ========
what              where the version is                         current  also read
================  ==========================================  =======  ========
log segment       segment header, uint16 (wal.py)              2        -
checkpoint file   header, uint16 format_version (checkpoint)   1        -
checkpoint        "format" of what it holds around the         v2       v1
contents          sessions (snapshot.CHECKPOINT_FORMAT)
session state     "format" of each session's state             v3       v2
                  (snapshot.py; checkpoints, runtime state)
dataset file      "layout" in each Parquet file's metadata     1        -
================  ==========================================  =======  ========

An upgrade loads the directory with recovery (which reads the previous versions), then
writes its whole state as a checkpoint in the current versions (two copies) and removes the
older checkpoints and the log behind. Every file is replaced atomically, and every step
leaves a directory the server can start from. The files as they were are copied first to
``backup-<UTC time>/`` inside the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..limits import ServiceLimits
from ..metrics import NullMetrics
from ..sessions import Sessions
from . import Durability, DurabilityOptions, snapshot, wal
from .checkpoint import FORMAT_VERSION, CheckpointDirectory, CheckpointError, read_checkpoint
from .files import fsync_directory

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

_SEGMENT_HEAD = struct.Struct("<8sH")


class UpgradeError(Exception):
    """The data directory cannot be upgraded; nothing was changed."""


@dataclass
class Versions:
    """What a data directory holds: file -> version, for each kind of file."""

    segments: dict[str, int] = field(default_factory=dict)
    checkpoints: dict[str, int] = field(default_factory=dict)
    payloads: dict[str, str] = field(default_factory=dict)
    """checkpoint file -> the format of what it holds around the session states."""
    states: dict[str, str] = field(default_factory=dict)
    """"<checkpoint file>:<session>" -> the session state's format."""
    unreadable: list[str] = field(default_factory=list)

    @property
    def current(self) -> bool:
        return (
            all(v == wal.SEGMENT_VERSION for v in self.segments.values())
            and all(v == FORMAT_VERSION for v in self.checkpoints.values())
            and all(v == snapshot.CHECKPOINT_FORMAT for v in self.payloads.values())
            and all(v == snapshot.FORMAT for v in self.states.values())
        )

    def lines(self) -> list[str]:
        def summary(name: str, found: dict[str, Any], current: Any) -> str:
            counts: dict[Any, int] = {}
            for value in found.values():
                counts[value] = counts.get(value, 0) + 1
            seen = ", ".join(f"{v} ({n})" for v, n in sorted(counts.items(), key=str)) or "none"
            return f"{name}: {seen}; current {current}"

        out = [
            summary("log segments", self.segments, wal.SEGMENT_VERSION),
            summary("checkpoint files", self.checkpoints, FORMAT_VERSION),
            summary("checkpoint contents", self.payloads, snapshot.CHECKPOINT_FORMAT),
            summary("session states", self.states, snapshot.FORMAT),
        ]
        out.extend(f"unreadable: {u}" for u in self.unreadable)
        return out


def inspect(data_dir: Path) -> Versions:
    """The format versions of every log segment, checkpoint and session state in
    ``data_dir`` (nothing is written)."""
    found = Versions()
    wal_dir = data_dir / "wal"
    for path in sorted(wal_dir.glob("wal-*.log")) if wal_dir.is_dir() else []:
        with open(path, "rb") as f:
            head = f.read(_SEGMENT_HEAD.size)
        if len(head) < _SEGMENT_HEAD.size or head[:8] != wal.SEGMENT_MAGIC:
            found.unreadable.append(f"{path.name}: not a log segment")
            continue
        found.segments[path.name] = _SEGMENT_HEAD.unpack(head)[1]
    ckpt_dir = data_dir / "checkpoints"
    for _, path in CheckpointDirectory(ckpt_dir).checkpoints() if ckpt_dir.is_dir() else []:
        data = path.read_bytes()
        if len(data) >= 10:
            found.checkpoints[path.name] = struct.unpack_from("<H", data, 8)[0]
        try:
            meta, blobs = snapshot.unpack(read_checkpoint(path))
            found.payloads[path.name] = meta.get("format", "recorder.checkpoint.v1")
            for entry in meta["sessions"]:
                state = json.loads(bytes(blobs[entry["meta"]]))
                found.states[f"{path.name}:{state.get('name')}"] = state.get("format")
        except (CheckpointError, ValueError, KeyError, TypeError, IndexError) as exc:
            found.unreadable.append(f"{path.name}: {exc}")
    return found


@contextmanager
def _exclusive(wal_dir: Path):
    """Hold the log's lock (a running server holds it)."""
    wal_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(wal_dir / "wal.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UpgradeError(
                    f"data directory {wal_dir.parent}: a server is running on it (it holds "
                    f"{wal_dir / 'wal.lock'}); stop it first"
                ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def backup(data_dir: Path) -> Path:
    """Copy the log segments and checkpoints to a new ``backup-<UTC time>/`` (fsynced)."""
    target = data_dir / time.strftime("backup-%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(target.name.split(".")[0] + f".{suffix}")
    for sub, pattern in (("wal", "wal-*.log"), ("checkpoints", "ckpt-*.rrc")):
        source = data_dir / sub
        if not source.is_dir():
            continue
        (target / sub).mkdir(parents=True)
        for path in sorted(source.glob(pattern)):
            copied = Path(shutil.copy2(path, target / sub / path.name))
            with open(copied, "rb") as f:
                os.fsync(f.fileno())
        fsync_directory(target / sub)
    fsync_directory(target)
    fsync_directory(data_dir)
    return target


@dataclass
class UpgradeReport:
    before: Versions
    after: Versions | None = None
    backup: Path | None = None
    recovery: list[str] = field(default_factory=list)
    checkpoint: Path | None = None


def upgrade(data_dir: str | os.PathLike[str]) -> UpgradeReport:
    """Convert ``data_dir`` in place to the current format versions, after a backup.
    Nothing is written when it holds them already."""
    root = Path(data_dir)
    if not (root / "wal").is_dir() and not (root / "checkpoints").is_dir():
        raise UpgradeError(
            f"--data-dir: expected a data directory (with wal/ or checkpoints/), got {str(root)!r}"
        )
    with _exclusive(root / "wal"):
        report = UpgradeReport(inspect(root))
        if report.before.unreadable:
            raise UpgradeError(
                f"data directory {root}: cannot read "
                + "; ".join(report.before.unreadable)
                + " (nothing was changed)"
            )
        if report.before.current:
            return report
        report.backup = backup(root)
    durability = Durability(root, DurabilityOptions(fsync="always", keep=2))
    sessions = Sessions(ServiceLimits(), NullMetrics(), durability.journal)
    try:
        recovered = durability.recover(sessions)
        report.recovery = recovered.lines()
        report.checkpoint, _ = durability.checkpoint(sessions, purge=True)
    finally:
        durability.close()
        sessions.close()
    report.after = inspect(root)
    return report
