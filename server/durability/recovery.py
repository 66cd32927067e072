"""Recovery at start: the newest checkpoint that loads, then the log after it.

A checkpoint that does not load (a flipped byte, a truncated file, a state that does not
restore) is skipped for the next older one, and the longer log behind that one is replayed.
Nothing intact is thrown away: a log record that cannot be applied is reported with its
session, worker and sequence numbers. What the server can prove was lost is recorded on the
sessions as loss causes (server/loss.py), for the workers' joins to name.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RequestError
from ..loss import LossCause, LossKind
from . import records, snapshot
from .checkpoint import CheckpointDirectory, CheckpointError, read_checkpoint
from .wal import ReplayResult, TornTail, replay
from .wal_replay import RECORD_HEADER_BYTES

logger = logging.getLogger(__name__)

_SEGMENT = re.compile(r"^wal-(\d{16})\.log$")
# Records that change nothing when their session is gone (dropped, or never restored).
_HARMLESS = (records.LEAVE, records.DROP, records.RESET)


@dataclass
class Unreplayed:
    """Log records of one session and worker that could not be applied."""

    kind: str
    records: int = 0
    first_sequence: int = 0
    last_sequence: int = 0
    reason: str = ""

    def add(self, sequence: int) -> None:
        self.records += 1
        if sequence:
            self.first_sequence = min(self.first_sequence or sequence, sequence)
            self.last_sequence = max(self.last_sequence, sequence)


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
    fallback_loss: str | None = None
    """Why the log behind the checkpoint fallen back to is incomplete (None: it is whole,
    and nothing was lost by the fallback)."""
    unreplayed: dict[tuple[str, str], Unreplayed] = field(default_factory=dict)
    """(session, worker) -> log records that could not be applied."""
    torn_owner: str | None = None
    """Whose record the torn tail was, when its first bytes say."""
    loss_checkpoint: str | None = None
    """A checkpoint written at once after a loss, so that the next start replays from past
    it and reports nothing again."""

    @property
    def notable(self) -> bool:
        return bool(
            self.checkpoint
            or self.replayed_records
            or self.skipped_checkpoints
            or self.dropped_bytes
            or self.dropped_records
            or self.corruptions
            or self.unreplayed
        )

    @property
    def lossy(self) -> bool:
        return bool(self.corruptions or self.fallback_loss or self.unreplayed)

    def lines(self) -> list[str]:
        out = []
        for path, reason in self.skipped_checkpoints:
            out.append(f"skipped checkpoint {path}: {reason}")
        if self.checkpoint:
            out.append(f"loaded checkpoint {self.checkpoint} ({self.sessions} sessions)")
        if self.skipped_checkpoints:
            out.append(
                "fell back to an older checkpoint: "
                + (self.fallback_loss or "the log behind it is whole, nothing is lost")
            )
        out.append(f"replayed {self.replayed_records} log records")
        if self.dropped_bytes or self.dropped_records:
            index = "" if self.dropped_index is None else f" (index {self.dropped_index})"
            out.append(
                f"dropped a torn log tail: {self.dropped_records} record(s){index}, never "
                f"wholly written: {self.dropped_bytes} bytes at offset {self.dropped_offset} "
                f"of {self.dropped_segment}" + (f", a {self.torn_owner}" if self.torn_owner else "")
            )
        out.extend(f"log corruption: {c}" for c in self.corruptions)
        for (session, worker), u in sorted(self.unreplayed.items()):
            who = f", worker {worker!r}" if worker else ""
            seqs = f" (sequences {u.first_sequence}..{u.last_sequence})" if u.last_sequence else ""
            out.append(
                f"not replayed: {u.records} {u.kind} record(s) of session {session!r}{who}"
                f"{seqs}: {u.reason}"
            )
        if self.loss_checkpoint:
            out.append(
                f"wrote checkpoint {self.loss_checkpoint} so that the next start replays from "
                "past the loss"
            )
        return out


def load_checkpoint(
    checkpoints: CheckpointDirectory, sessions: Any, report: RecoveryReport
) -> tuple[int, int | None]:
    """Restore the newest checkpoint that reads and restores whole into ``sessions``.
    Returns its log index (0: none) and the log index of the newest one skipped (None:
    none)."""
    newest_skipped = None
    for step, path in reversed(checkpoints.checkpoints()):
        try:
            meta, blobs = snapshot.unpack(read_checkpoint(path))
            form = meta.get("format", "recorder.checkpoint.v1")
            if form not in snapshot.CHECKPOINT_READ_FORMATS:
                raise snapshot.SnapshotError(
                    f"checkpoint: expected format {' or '.join(snapshot.CHECKPOINT_READ_FORMATS)}"
                    f", got {form!r}"
                )
            cut = int(meta["wal_next_index"])
            for entry in meta["sessions"]:
                first, count = int(entry["first_blob"]), int(entry["count"])
                state = json.loads(bytes(blobs[entry["meta"]]))
                sessions.restore(state, blobs[first : first + count])
        except (CheckpointError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            logger.warning("skipping unusable checkpoint %s: %s", path, reason)
            report.skipped_checkpoints.append((str(path), reason))
            sessions.discard_all()  # a partly restored checkpoint leaves nothing behind
            newest_skipped = step if newest_skipped is None else newest_skipped
            continue
        sessions.tombstones.load(meta.get("tombstones", []))
        report.checkpoint = str(path)
        report.sessions = len(meta["sessions"])
        return cut, newest_skipped
    return 0, newest_skipped


def replay_log(wal_dir: Path, cut: int, sessions: Any, report: RecoveryReport) -> ReplayResult:
    """Apply every record of the log from ``cut``; one that does not apply is reported."""
    result = replay(wal_dir, start_index=cut)
    for _index, data in result:
        try:
            record = records.decode(data)
        except (ValueError, KeyError, TypeError) as exc:
            report.corruptions.append(f"record {_index} does not decode: {exc}")
            continue
        try:
            sessions.replay(record)
        except RequestError as err:
            if record.kind in _HARMLESS:
                logger.info(
                    "log record %r of gone session %r: nothing to do", record.kind, record.session
                )
                continue
            key = (record.session, record.worker)
            kind = {records.CHUNK: "chunk", records.EPISODE: "episode"}.get(
                record.kind, record.kind.decode()
            )
            entry = report.unreplayed.setdefault(key, Unreplayed(kind, reason=str(err)))
            entry.add(record.body.sequence if record.kind == records.CHUNK else 0)
            continue
        report.replayed_records += 1
    report.dropped_bytes = result.dropped_bytes
    report.dropped_records = result.dropped_records
    report.dropped_segment = None if result.dropped_segment is None else str(result.dropped_segment)
    if result.torn_tail is not None:
        report.dropped_offset = result.torn_tail.offset
        report.dropped_index = result.torn_tail.index
    report.corruptions.extend(str(c) for c in result.corruptions)
    return result


def fallback_loss(
    wal_dir: Path, cut: int, newest_skipped: int | None, result: ReplayResult
) -> str | None:
    """Why falling back to the checkpoint at log index ``cut`` lost records, or None when
    the log behind it reaches past the newest skipped checkpoint without a hole."""
    if newest_skipped is None:
        return None
    firsts = sorted(
        int(m.group(1))
        for p in (wal_dir.iterdir() if wal_dir.is_dir() else ())
        if (m := _SEGMENT.match(p.name))
    )
    if not any(first <= cut for first in firsts):
        start = firsts[0] if firsts else result.next_index
        return (
            f"the log behind it starts at index {start}, after the checkpoint's {cut}: "
            f"records {cut}..{start - 1} are gone"
        )
    if result.corruptions:
        return "the log behind it has unreadable records (see the log corruption lines)"
    if result.next_index < newest_skipped:
        return (
            f"the log ends at index {result.next_index}, before the skipped checkpoint's "
            f"{newest_skipped}"
        )
    return None


def record_causes(sessions: Any, report: RecoveryReport, torn: TornTail | None) -> int:
    """Put the losses recovery can prove on the sessions they may have cost; returns how
    many causes were recorded."""
    causes = 0
    if report.fallback_loss:
        detail = (
            f"a fallback to the older checkpoint {report.checkpoint or '(none)'}: "
            f"{report.fallback_loss}"
        )
        for session in sessions.all():
            session.loss_causes.append(LossCause(LossKind.CHECKPOINT_FALLBACK, detail))
            causes += 1
    if torn is not None:
        detail = (
            f"a torn log tail of {torn.dropped_bytes} bytes at offset {torn.offset} of "
            f"{torn.segment.name}"
        )
        # The record header (24 bytes) and the start of its body may name whose it was.
        owner = records.whose(torn.head[RECORD_HEADER_BYTES:])
        if owner is None:  # it could have been anyone's
            targets = [(s, "", 0) for s in sessions.all()]
        else:
            kind, name, worker, sequence = owner
            session = next((s for s in sessions.all() if s.name == name), None)
            if kind != records.CHUNK or session is None:
                targets = []  # not a chunk, or of a session that is gone
            else:
                # Its sequence, when it survived; else the worker's next.
                held = session.last_sequence.get(worker, 0)
                targets = [(session, worker, sequence or held + 1)]
            report.torn_owner = f"{kind.decode()} record of session {name!r}, worker {worker!r}"
        for session, worker, first in targets:
            session.loss_causes.append(LossCause(LossKind.TORN_TAIL, detail, worker, first))
            causes += 1
    return causes
