"""Crash safety: the write-ahead log of everything that changes a session, checkpoints,
and recovery (newest good checkpoint, then the log after it).

Data directory layout: `wal/` (segments, see wal.py; records, see records.py) and
`checkpoints/` (`ckpt-<wal index>.rrc`, see checkpoint.py). A checkpoint holds every session
(snapshot.py) and the log index it covers. At least two checkpoints are kept, and the log
behind the older one (recovery.py falls back to it when the newest does not load).
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..periodic import Periodic
from . import recovery, snapshot
from .checkpoint import CheckpointDirectory
from .recovery import RecoveryReport
from .wal import WriteAheadLog

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
    # Checkpoints kept on disk: at least two, so that one that does not load has a
    # fallback.
    keep: int = 3
    segment_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 2:
            raise ValueError(
                f"--keep-checkpoints: expected at least 2 (a corrupt newest checkpoint falls "
                f"back to an older one), got {self.keep!r}"
            )


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
        """Load the newest checkpoint that loads into ``sessions`` (the registry), replay the
        log after it, record what was provably lost on the sessions, then open the log for
        appending."""
        report = RecoveryReport()
        cut, newest_skipped = recovery.load_checkpoint(self.checkpoints, sessions, report)
        wal_dir = self.root / "wal"
        result = recovery.replay_log(wal_dir, cut, sessions, report)
        report.fallback_loss = recovery.fallback_loss(wal_dir, cut, newest_skipped, result)
        self.wal = WriteAheadLog(
            wal_dir,
            fsync=self.options.fsync,
            batch_window_s=self.options.batch_window_s,
            segment_bytes=self.options.segment_bytes,
            start_index=max(cut, result.next_index),
        )
        sessions.drain()
        causes = recovery.record_causes(sessions, report, result.torn_tail)
        if report.lossy or causes:
            # Reported once: the next start replays from this checkpoint, past the loss.
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
        """Write every session atomically, then drop the log behind the oldest kept one.

        At least two checkpoints are kept, with the log behind the older: when the newest
        does not load, recovery falls back to the older and replays the log after it.
        ``purge`` (after a session was dropped: nothing of it stays on disk): the state is
        written twice, and every older checkpoint and every log record written so far go."""
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
                # Dropped sessions' recorders stay refused after a restart.
                tombstones = sessions.tombstones.entries()
            meta = {
                "format": snapshot.CHECKPOINT_FORMAT,
                "wal_next_index": cut,
                "sessions": entries,
                "tombstones": tombstones,
            }
            payload = snapshot.pack(meta, blobs)
            path = self.checkpoints.save(payload, cut, compress=False)
            if purge:
                # Two copies of the state without the dropped session stand in for the
                # older checkpoints, which held it.
                copy = self.checkpoints.save(payload, cut, compress=False, copy=1)
                older = [p for _, p in self.checkpoints.checkpoints() if p not in (path, copy)]
                self.checkpoints.remove(older)
                self.wal.truncate_before(cut)
            else:
                self.checkpoints.keep(self.options.keep)
                kept = self.checkpoints.checkpoints()
                # With one checkpoint only, the whole log stays: it stands in for an
                # older one.
                if len(kept) >= 2:
                    self.wal.truncate_before(kept[0][0])
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
