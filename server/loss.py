"""Why acknowledged chunks are not held: one provable cause per lost range.

The server reports a loss only when it can name its cause. Recovery records the causes it
finds (a torn log tail, a fallback to an older checkpoint); a drop records its own. A
worker's join reads them to say what happened, and its claim of acknowledged chunks is
checked against them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LossKind(enum.Enum):
    TORN_TAIL = "torn_tail"
    """The log's last records were cut short (a crash between write and fsync)."""
    CHECKPOINT_FALLBACK = "checkpoint_fallback"
    """The newest checkpoint did not load and an older one was used."""
    DROP = "drop"
    """The session was dropped."""
    UNSYNCED_TAIL = "unsynced_tail"
    """The server stopped before its log synced them (--wal-fsync batch or never, or no
    log): what the fsync policy allows a power cut to take."""


@dataclass(frozen=True)
class LossCause:
    """One cause of loss, with what the server can prove about it."""

    kind: LossKind
    detail: str
    """For people: e.g. "a torn log tail of 812 bytes at offset 40960 of wal-000003.log"."""
    worker_id: str = ""
    """The worker whose chunks it may have cost ("" for every worker of the session)."""
    first_sequence: int = 0
    """The first of that worker's sequences it may have cost (0: not known)."""
