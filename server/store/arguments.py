"""Checks of record()'s per-episode arguments, and the outcome rule applied to a batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from recorder_client.capture_types import EpisodeOutcome, OutcomeRule, TrajectorySliceReference

from .results import _OUTCOMES


def _resolve_outcomes(rule: OutcomeRule, codes: np.ndarray, returns: np.ndarray) -> np.ndarray:
    """(E,) int64 codes of :meth:`OutcomeRule.resolve` applied to every episode's code, given
    their returns (0.0 for an empty episode), for the whole batch at once."""
    if rule.kind == "none":
        return codes
    unknown = codes == EpisodeOutcome.UNKNOWN
    if unknown.any():
        derived = np.where(
            returns > rule.threshold,
            int(EpisodeOutcome.WIN),
            np.where(returns < -rule.threshold, int(EpisodeOutcome.LOSS), int(EpisodeOutcome.DRAW)),
        )
        codes = np.where(unknown, derived, codes)
    return codes


def _check_step(step: Any, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(f"{where}: expected an int, got {step!r}")
    return int(step)


def _batch_args(
    steps: Any, outcomes: Any, start_references: Any, count: int
) -> tuple[np.ndarray, np.ndarray, list[TrajectorySliceReference | None]]:
    """A batch's per-episode arguments, checked: (steps (E,), outcome codes (E,), references)."""
    return (
        _batch_steps(steps, count),
        _batch_outcomes(outcomes, count),
        _batch_references(start_references, count),
    )


def _batch_steps(steps: Any, count: int) -> np.ndarray:
    """(E,) int64 global steps from one int or one per episode."""
    if isinstance(steps, (int, np.integer)) and not isinstance(steps, bool):
        return np.full(count, int(steps), dtype=np.int64)
    if isinstance(steps, np.ndarray) and steps.dtype.kind in "iu" and steps.ndim == 1:
        values = steps.astype(np.int64)
    elif isinstance(steps, Sequence) and not isinstance(steps, str):
        if count == 1 and len(steps) == 1:
            return np.array([_check_step(steps[0], "step")], dtype=np.int64)
        values = np.array(
            [_check_step(s, f"steps[{i}]") for i, s in enumerate(steps)], dtype=np.int64
        )
    else:
        raise ValueError(f"steps: expected an int or one int per episode, got {steps!r}")
    if values.shape[0] != count:
        raise ValueError(f"steps: expected {count} values (one per episode), got {len(values)}")
    return values


def _batch_outcomes(outcomes: Any, count: int) -> np.ndarray:
    """(E,) int64 outcome codes, one per episode, from one outcome (enum, code or name) or a
    sequence (or int array) of them; each checked as EpisodeOutcome.coerce checks it."""
    if isinstance(outcomes, (EpisodeOutcome, int, str, np.integer)):
        value = int(outcomes) if isinstance(outcomes, np.integer) else outcomes
        return np.full(count, int(EpisodeOutcome.coerce(value)), dtype=np.int64)
    if isinstance(outcomes, np.ndarray):
        if outcomes.ndim == 1 and outcomes.dtype.kind in "iu" and outcomes.shape[0] == count:
            # Int codes: a range check (out-of-range codes take the checked path).
            if not count or (outcomes.min() >= 0 and outcomes.max() < len(_OUTCOMES)):
                return outcomes.astype(np.int64)
        outcomes = outcomes.tolist()
    if not isinstance(outcomes, Sequence):
        raise ValueError(f"outcomes: expected an outcome or one per episode, got {outcomes!r}")
    if len(outcomes) != count:
        raise ValueError(
            f"outcomes: expected {count} values (one per episode), got {len(outcomes)}"
        )
    coerce = EpisodeOutcome.coerce
    return np.fromiter(
        (o if type(o) is EpisodeOutcome else coerce(o) for o in outcomes),
        dtype=np.int64,
        count=count,
    )


def _batch_references(refs: Any, count: int) -> list[TrajectorySliceReference | None]:
    if refs is None:
        return [None] * count
    if not isinstance(refs, Sequence) or isinstance(refs, (str, TrajectorySliceReference)):
        raise ValueError(f"start_references: expected None or one per episode, got {refs!r}")
    if len(refs) != count:
        raise ValueError(
            f"start_references: expected {count} values (one per episode), got {len(refs)}"
        )
    for ref in refs:
        if ref is not None and not isinstance(ref, TrajectorySliceReference):
            raise ValueError(f"start_reference: expected a TrajectorySliceReference, got {ref!r}")
    return list(refs)
