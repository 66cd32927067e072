"""Gymnasium spaces for exported episodes: derived from the recorded dtypes and values, or
given as a short spec (the export command's --action-space and --observation-space).

Spec syntax (``SPEC_HELP``)::

    discrete:N      Discrete(N): integer values 0..N-1 (scalar integer fields only)
    box             Box over the field's dtype range (-inf..inf for floats, 0..1 for bool)
    box:LOW:HIGH    Box with these bounds (numbers, inf, -inf)

A Box always takes the field's shape and dtype. gymnasium is imported on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SPEC_HELP = (
    "discrete:N (integers 0..N-1; scalar integer fields only), box (the dtype's range), "
    "or box:LOW:HIGH (numbers, inf, -inf); a box takes the field's shape and dtype"
)


@dataclass(frozen=True)
class Spec:
    """A parsed space spec: ``kind`` is "discrete" (with ``n``) or "box" (with optional
    ``low`` and ``high``)."""

    kind: str
    n: int | None = None
    low: float | None = None
    high: float | None = None


def parse_spec(text: str, what: str) -> Spec:
    """The spec ``text``; ValueError naming ``what`` and the text when it is malformed."""
    parts = text.strip().split(":")
    kind = parts[0].lower()
    try:
        if kind == "discrete" and len(parts) == 2:
            n = int(parts[1])
            if n >= 1:
                return Spec("discrete", n=n)
        elif kind == "box" and len(parts) == 1:
            return Spec("box")
        elif kind == "box" and len(parts) == 3:
            low, high = float(parts[1]), float(parts[2])
            if not (math.isnan(low) or math.isnan(high)) and low <= high:
                return Spec("box", low=low, high=high)
    except ValueError:
        pass
    raise ValueError(f"{what}: expected {SPEC_HELP}; got {text!r}")


def _gym() -> Any:
    from gymnasium import spaces

    return spaces


def dtype_box(dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    """A Box over ``dtype``'s whole range: any value of that dtype is inside."""
    spaces = _gym()
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return spaces.Box(0, 1, shape, dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return spaces.Box(int(info.min), int(info.max), shape, dtype=dtype)
    return spaces.Box(-np.inf, np.inf, shape, dtype=dtype)


def derive_action(values: np.ndarray) -> Any:
    """Discrete for scalar integer actions (n = max + 1; starting at the minimum when that is
    negative), otherwise a Box over the dtype's range. ``values``: (steps, *shape)."""
    if values.ndim == 1 and values.dtype.kind in "iu" and values.size:
        start = min(0, int(values.min()))
        return _gym().Discrete(int(values.max()) - start + 1, start=start)
    return dtype_box(values.dtype, values.shape[1:])


def from_spec(spec: Spec, values: np.ndarray, what: str) -> Any:
    """The space ``spec`` describes for ``values`` (steps, *shape), checked to hold them."""
    spaces = _gym()
    shape, dtype = values.shape[1:], values.dtype
    if spec.kind == "discrete":
        if shape or dtype.kind not in "iu":
            raise ValueError(
                f"{what}: discrete:{spec.n} needs scalar integer values, got {dtype} of "
                f"trailing shape {shape}"
            )
        space = spaces.Discrete(spec.n)
    elif spec.low is None:
        space = dtype_box(dtype, shape)
    else:
        low, high = _bound(spec.low, dtype, what), _bound(spec.high, dtype, what)
        space = spaces.Box(low, high, shape, dtype=dtype)
    check(space, values, what)
    return space


def _bound(value: float, dtype: np.dtype, what: str) -> Any:
    if dtype.kind == "f":
        return value
    if math.isinf(value):  # an integer Box's infinite bound is the dtype's limit
        if dtype.kind == "b":
            return value > 0
        info = np.iinfo(dtype)
        return int(info.max if value > 0 else info.min)
    if value != int(value):
        raise ValueError(f"{what}: expected integer bounds for {dtype} values, got {value}")
    return int(value)


def check(space: Any, values: np.ndarray, what: str) -> None:
    """ValueError naming ``what`` when ``values`` (steps, *shape) do not fit ``space``."""
    spaces = _gym()
    shape = values.shape[1:]
    if isinstance(space, spaces.Discrete):
        if shape or values.dtype.kind not in "iub":
            raise ValueError(
                f"{what}: {space} needs scalar integer values, got {values.dtype} of trailing "
                f"shape {shape}"
            )
        lo, hi = int(space.start), int(space.start) + int(space.n) - 1
        outside = (values < lo) | (values > hi)
    elif isinstance(space, spaces.Box):
        if tuple(space.shape) != shape:
            raise ValueError(f"{what}: {space} has shape {space.shape}, the values {shape}")
        outside = ~((values >= space.low) & (values <= space.high))
    elif isinstance(space, (spaces.MultiDiscrete, spaces.MultiBinary)):
        if tuple(space.shape) != shape:
            raise ValueError(f"{what}: {space} has shape {space.shape}, the values {shape}")
        return
    else:
        raise ValueError(
            f"{what}: expected a Box, Discrete, MultiDiscrete or MultiBinary space, got {space}"
        )
    if outside.any():
        bad = values[outside.reshape(values.shape[0], -1).any(axis=1)][0]
        raise ValueError(f"{what}: {space} does not hold the recorded value {bad.tolist()}")


__all__ = ["SPEC_HELP", "Spec", "check", "derive_action", "dtype_box", "from_spec", "parse_spec"]
