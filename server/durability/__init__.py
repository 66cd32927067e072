"""Crash safety: the write-ahead log of everything that changes a session, checkpoints,
and recovery (newest good checkpoint, then the log after it).

Data directory layout: `wal/` (segments, see wal.py; records, see records.py) and
`checkpoints/` (`ckpt-<wal index>.rrc`, see checkpoint.py). A checkpoint holds every session
(snapshot.py) and the log index it covers; the log is truncated behind it.
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..periodic import Periodic
from . import snapshot
from .checkpoint import CheckpointDirectory
from .wal import WriteAheadLog, replay

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DurabilityOptions:
    """How the server keeps what it acknowledged."""

    # False: no log, no checkpoints (the embedded default's throwaway data dir).
    enabled: bool = True
    # "always": fsync before each ack; "batch": fsync at most every batch_window_s
    # (a power failure can lose that window; a process kill loses nothing);
    # "never": leave write-back to the OS.
    fsync: str = "batch"
    batch_window_s: float = 0.05
    # Seconds between timed checkpoints; 0 disables the timer.
    checkpoint_every_s: float = 0.0
    # Checkpoints kept on disk.
    keep: int = 3
    segment_bytes: int = 64 << 20


@dataclass
class RecoveryReport:
    checkpoint: str | None = None
    sessions: int = 0
    skipped_checkpoints: list[tuple[str, str]] = field(default_factory=list)
    replayed_records: int = 0
    dropped_bytes: int = 0
    dropped_records: int = 0
    dropped_segment: str | None = None
    dropped_offset: int = 0
    dropped_index: int | None = None
    """Index the torn record would have had."""
    corruptions: list[str] = field(default_factory=list)
    loss_checkpoint: str | None = None
    """A checkpoint written at once after unreadable records, so that the next start
    replays from past them and reports nothing again."""

    @property
    def notable(self) -> bool:
        return bool(
            self.checkpoint
            or self.replayed_records
            or self.skipped_checkpoints
            or self.dropped_bytes
            or self.dropped_records
            or self.corruptions
        )

    def lines(self) -> list[str]:
        out = []
        for path, reason in self.skipped_checkpoints:
            out.append(f"skipped checkpoint {path}: {reason}")
        if self.checkpoint:
            out.append(f"loaded checkpoint {self.checkpoint} ({self.sessions} sessions)")
        out.append(f"replayed {self.replayed_records} log records")
        if self.dropped_bytes or self.dropped_records:
            index = "" if self.dropped_index is None else f" (index {self.dropped_index})"
            out.append(
                f"dropped a torn log tail: {self.dropped_records} record(s){index}, never "
                f"wholly written: {self.dropped_bytes} bytes at offset {self.dropped_offset} "
                f"of {self.dropped_segment}"
            )
        out.extend(f"log corruption: {c}" for c in self.corruptions)
        if self.loss_checkpoint:
            out.append(
                f"wrote checkpoint {self.loss_checkpoint} so that the next start replays from "
                "past the unreadable records"
            )
        return out


class Durability:
    def __init__(self, data_dir: str | Path, options: DurabilityOptions) -> None:
        self.options = options
        self.root = Path(data_dir)
        self.checkpoints = CheckpointDirectory(self.root / "checkpoints")
        self.wal: WriteAheadLog | None = None
        self._timer: Periodic | None = None
        self._checkpoint_lock = threading.Lock()

    # -- recovery ----------------------------------------------------------
    def recover(self, sessions: Any) -> RecoveryReport:
        """Load the newest readable checkpoint into ``sessions`` (the registry), replay the
        log after it, then open the log for appending."""
        report = RecoveryReport()
        newest = self.checkpoints.newest_good()
        report.skipped_checkpoints = [(str(p), str(r)) for p, r in newest.skipped]
        cut = 0
        if newest.payload is not None:
            meta, blobs = snapshot.unpack(newest.payload)
            cut = int(meta["wal_next_index"])
            for entry in meta["sessions"]:
                sessions.restore(json.loads(bytes(blobs[entry["meta"]])), blobs_of(entry, blobs))
            report.checkpoint = str(newest.path)
            report.sessions = len(meta["sessions"])
        wal_dir = self.root / "wal"
        result = replay(wal_dir, start_index=cut)
        for _index, record in result:
            sessions.replay(bytes(record))
            report.replayed_records += 1
        report.dropped_bytes = result.dropped_bytes
        report.dropped_records = result.dropped_records
        report.dropped_segment = (
            None if result.dropped_segment is None else str(result.dropped_segment)
        )
        if result.torn_tail is not None:
            report.dropped_offset = result.torn_tail.offset
            report.dropped_index = result.torn_tail.index
        report.corruptions = [str(c) for c in result.corruptions]
        self.wal = WriteAheadLog(
            wal_dir,
            fsync=self.options.fsync,
            batch_window_s=self.options.batch_window_s,
            segment_bytes=self.options.segment_bytes,
            start_index=max(cut, result.next_index),
        )
        sessions.drain()
        if result.corruptions:
            # Reported once: the next start replays from this checkpoint, past them.
            try:
                report.loss_checkpoint = str(self.checkpoint(sessions)[0])
            except OSError as exc:
                logger.error("checkpoint after recovery failed: %s", exc)
        return report

    # -- writing -----------------------------------------------------------
    def journal(self, record: list) -> None:
        """Append one record (see records.py) to the log."""
        assert self.wal is not None
        self.wal.append(record)

    def checkpoint(self, sessions: Any, *, purge: bool = False) -> tuple[Path, int]:
        """Write every session atomically, then drop the log behind it.

        ``purge``: also delete every older checkpoint and every log record written so far
        (after a session was dropped: nothing of it stays on disk)."""
        assert self.wal is not None
        with self._checkpoint_lock:
            # Stored episodes still read from the sessions' chunks are encoded before every
            # lock is taken (each store's lock only): ingest keeps going meanwhile, and only
            # those stored since are left for the snapshot below.
            for session in sessions.all():
                if session.processor.store is not None:
                    session.processor.store.encode_deferred()
            with ExitStack() as stack:
                locked = sessions.lock_all(stack)
                if purge:
                    self.wal.rotate()
                cut = self.wal.next_index
                entries, blobs = [], []
                for session in locked:
                    meta, session_blobs = snapshot.session_state(session)
                    first = len(blobs) + 1
                    blobs.append(json.dumps(meta).encode())
                    blobs.extend(session_blobs)
                    entries.append(
                        {"meta": first - 1, "first_blob": first, "count": len(session_blobs)}
                    )
            payload = snapshot.pack({"wal_next_index": cut, "sessions": entries}, blobs)
            path = self.checkpoints.save(payload, cut, compress=False)
            self.checkpoints.keep(1 if purge else self.options.keep)
            # Keep the log back to the oldest kept checkpoint: if the newer ones turn
            # out unreadable, recovery falls back to it and still replays everything.
            kept = self.checkpoints.checkpoints()
            self.wal.truncate_before(kept[0][0] if kept else cut)
        logger.info("checkpoint %s (%d sessions, log index %d)", path, len(entries), cut)
        return path, cut

    def start_timer(self, sessions: Any) -> None:
        every = self.options.checkpoint_every_s
        if every <= 0:
            return

        def checkpoint() -> None:
            try:
                self.checkpoint(sessions)
            except OSError as exc:  # a full disk, say: one line, not a traceback
                logger.error("timed checkpoint failed: %s", exc)

        self._timer = Periodic(every, checkpoint, "timed checkpoint")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.stop(30)
        if self.wal is not None:
            self.wal.close()


def blobs_of(entry: dict[str, Any], blobs: list[memoryview]) -> list[memoryview]:
    first, count = int(entry["first_blob"]), int(entry["count"])
    return blobs[first : first + count]
