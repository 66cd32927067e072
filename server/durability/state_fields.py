"""Checked reading of a saved state's fields (durability/snapshot.py): each reader names the
field, what it expected and what arrived, as for live input."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from recorder_client._wire import shown
from recorder_client.capture_types import EpisodeOutcome

from ..loss import LossCause, LossKind

_NUM_OUTCOMES = len(EpisodeOutcome)
# Longest saved message about a frame that reads as zeros.
_MAX_MESSAGE = 4096
# Most causes of loss one session's state keeps.
MAX_LOSS_CAUSES = 256


class SnapshotError(ValueError):
    """A state container that cannot be read; the message says what is wrong."""


def count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise SnapshotError(f"state.{what}: expected an int in [0, 2**63), got {shown(value)}")
    return value


def corrupt_messages(value: Any, what: str, frames: int) -> tuple[str, ...]:
    """A saved chunk's messages about frames that read as zeros: at most one per frame."""
    messages = list_of(value, what)
    if len(messages) > frames or not all(
        isinstance(m, str) and len(m) <= _MAX_MESSAGE for m in messages
    ):
        raise SnapshotError(
            f"{what}: expected at most {frames} messages (one per frame) of at most "
            f"{_MAX_MESSAGE} characters, got {shown(messages)}"
        )
    return tuple(messages)


def list_of(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise SnapshotError(f"{what}: expected a list, got {type(value).__name__}")
    return value


def mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise SnapshotError(f"{what}: expected a mapping, got {type(value).__name__}")
    return value


def blob(blobs: list[memoryview], index: Any, what: str) -> memoryview:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(blobs):
        raise SnapshotError(
            f"{what}.blob: expected an index in [0, {len(blobs)}), got {shown(index)}"
        )
    return blobs[index]


def dims_of(value: Any, what: str) -> list[int]:
    dims = list_of(value, f"{what}.shape")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 1 << 62:
            raise SnapshotError(f"{what}.shape: expected sizes in [0, 2**62), got {shown(dims)}")
    return dims


def array(
    spec: Any,
    blobs: list[memoryview],
    what: str,
    dtype: str,
    shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """A saved bookkeeping array of exactly ``dtype`` (and ``shape`` when given) whose blob
    holds exactly its bytes."""
    spec = mapping(spec, what)
    if spec.get("dtype") != np.dtype(dtype).str:
        raise SnapshotError(
            f"{what}.dtype: expected {np.dtype(dtype).str!r}, got {shown(spec.get('dtype'))}"
        )
    dims = dims_of(spec.get("shape"), what)
    if shape is not None and tuple(dims) != shape:
        raise SnapshotError(f"{what}.shape: expected {list(shape)}, got {shown(dims)}")
    data = blob(blobs, spec.get("blob"), what)
    nbytes = np.dtype(dtype).itemsize * math.prod(dims)
    if nbytes != len(data):
        raise SnapshotError(
            f"{what}: shape {dims} of {dtype} is {nbytes} bytes, its blob holds {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).copy().reshape(dims)


def feeder(spec: Any, blobs: list[memoryview], what: str, n: int | None) -> dict[str, np.ndarray]:
    """A worker's open-episode sums: a return and an outcome code per environment."""
    spec = mapping(spec, what)
    if set(spec) != {"open_return", "open_code"} or n is None:
        raise SnapshotError(
            f"{what}: expected 'open_return' and 'open_code' of a worker with chunks, got "
            f"{shown(sorted(map(str, spec)))}"
        )
    codes = array(spec["open_code"], blobs, f"{what}.open_code", "<i8", (n,))
    if codes.size and (codes.min() < 0 or codes.max() >= _NUM_OUTCOMES):
        raise SnapshotError(f"{what}.open_code: expected codes 0..{_NUM_OUTCOMES - 1}")
    returns = array(spec["open_return"], blobs, f"{what}.open_return", "<f8", (n,))
    return {"open_return": returns, "open_code": codes}


def restore_lifecycle(
    session: Any, meta: dict[str, Any], worker_ids: list[str], indexes: list[int]
) -> None:
    """Active workers, forgotten ones and lost sequences (a state without them: every
    worker active)."""
    from ..session import MAX_FORGOTTEN, check_worker_id

    life = meta.get("lifecycle")
    if life is None:
        life = {"active": worker_ids, "forgotten": [], "next_index": len(worker_ids)}
    active = life["active"]
    if not isinstance(active, list) or not set(active) <= set(worker_ids):
        raise SnapshotError("state.lifecycle.active: expected ids of the state's workers")
    if len(active) > session.max_workers:
        raise SnapshotError(
            f"state.lifecycle.active: this server allows at most {session.max_workers} "
            f"active workers per session, got {len(active)}"
        )
    forgotten = life["forgotten"]
    if not isinstance(forgotten, list) or len(forgotten) > MAX_FORGOTTEN:
        raise SnapshotError(
            f"state.lifecycle.forgotten: expected at most {MAX_FORGOTTEN} [id, sequence] pairs"
        )
    for worker_id, seq in forgotten:
        session.forgotten[check_worker_id(str(worker_id))] = count(seq, "forgotten.sequence")
    lost = life.get("sequences_lost", {})
    if not isinstance(lost, dict) or not set(lost) <= set(worker_ids) | set(session.forgotten):
        raise SnapshotError("state.lifecycle.sequences_lost: expected counts of known workers")
    session.sequences_lost = {str(w): count(n, "sequences_lost") for w, n in lost.items()}
    session.active = set(active)
    session.next_index = max(
        count(life["next_index"], "lifecycle.next_index"), indexes[-1] + 1 if indexes else 0
    )


def loss_causes(value: Any) -> list[LossCause]:
    """A state's causes of loss: [kind, detail, worker id, first sequence] each."""
    entries = list_of(value, "state.loss_causes")
    if len(entries) > MAX_LOSS_CAUSES:
        raise SnapshotError(
            f"state.loss_causes: expected at most {MAX_LOSS_CAUSES}, got {len(entries)}"
        )
    kinds = {k.value: k for k in LossKind}
    causes = []
    for i, entry in enumerate(entries):
        what = f"state.loss_causes[{i}]"
        if (
            not isinstance(entry, list)
            or len(entry) != 4
            or entry[0] not in kinds
            or not isinstance(entry[1], str)
            or len(entry[1]) > _MAX_MESSAGE
            or not isinstance(entry[2], str)
        ):
            raise SnapshotError(
                f"{what}: expected [kind in {sorted(kinds)}, detail of at most {_MAX_MESSAGE} "
                f"characters, worker id, first sequence], got {shown(entry)}"
            )
        first = count(entry[3], f"loss_causes[{i}].first_sequence")
        causes.append(LossCause(kinds[entry[0]], entry[1], entry[2], first))
    return causes
