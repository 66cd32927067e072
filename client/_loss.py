"""What a worker is told when the server lost chunks it had acknowledged: the cause the
server names in its join's loss report."""

from __future__ import annotations

from typing import Any

from ._proto import recorder_pb2 as pb
from .errors import DataLossError

# What each cause says, before the server's own detail.
_CAUSES = {
    pb.LossReport.CAUSE_TORN_TAIL: "its write-ahead log ended in a torn record",
    pb.LossReport.CAUSE_CHECKPOINT_FALLBACK: (
        "its newest checkpoint did not load and it fell back to an older one"
    ),
    pb.LossReport.CAUSE_DROP: "the session was dropped",
    pb.LossReport.CAUSE_UNSYNCED_TAIL: "it stopped before its write-ahead log synced them",
}


def cause_of(report: Any) -> str:
    """A JoinReply.loss's cause for people (a server that sends none: the old guess)."""
    if report is None or report.cause not in _CAUSES:
        return "its write-ahead log lost its last unsynced records, e.g. in a power cut"
    cause = _CAUSES[report.cause]
    return f"{cause}: {report.detail}" if report.detail else cause


def data_loss_error(
    target: str, worker_id: str, session: str, first: int, last: int, report: Any = None
) -> DataLossError:
    return DataLossError(
        f"the recorder server at {target} lost chunks {first}..{last} of worker "
        f"{worker_id!r} in session {session!r} after acknowledging them ({cause_of(report)}); "
        f"recording goes on from chunk {last + 1}",
        worker_id=worker_id,
        first=first,
        last=last,
    )
