"""Start-cell selection: weight ``1 / (times_chosen + 1) ** power`` per cell (power 0.5 by
default, i.e. ``1/sqrt``), plus the per-cell count of episodes started from a cell
("midpoint starts")."""

from __future__ import annotations

from typing import Any

import numpy as np

from recorder_client.capture_types import TrajectoryKey


def start_weights(times_chosen: np.ndarray, power: float) -> np.ndarray:
    """Unnormalised selection weight of each cell."""
    return (times_chosen.astype(np.float64) + 1.0) ** -power


def draw(times_chosen: np.ndarray, power: float, rng: np.random.Generator) -> int:
    """One cell index drawn with probability proportional to :func:`start_weights`."""
    cumulative = np.cumsum(start_weights(times_chosen, power))
    u = rng.random() * cumulative[-1]
    return min(int(np.searchsorted(cumulative, u, side="right")), cumulative.size - 1)


def entropy(times_chosen: np.ndarray, power: float) -> float:
    """Shannon entropy (nats) of the start distribution; 0 for an empty archive."""
    if times_chosen.size == 0:
        return 0.0
    w = start_weights(times_chosen, power)
    p = w / w.sum()
    return float(-(p * np.log(p)).sum())


class Curriculum:
    """The random generator, the start counter and the midpoint-start counts."""

    def __init__(self, power: float, seed: int | None = None) -> None:
        self.power = power
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.starts = 0
        self.midpoint_counts: dict[TrajectoryKey, int] = {}
        self.midpoint_total = 0  # sum(midpoint_counts.values()), kept as they change
        self.unresolved_midpoint_starts = 0

    def choose(self, times_chosen: np.ndarray) -> int:
        """Draw a start cell (the caller increments its times_chosen)."""
        index = draw(times_chosen, self.power, self.rng)
        self.starts += 1
        return index

    def count_midpoint_start(self, key: TrajectoryKey | None) -> None:
        if key is None:
            self.unresolved_midpoint_starts += 1
        else:
            self.midpoint_counts[key] = self.midpoint_counts.get(key, 0) + 1
            self.midpoint_total += 1

    def set_midpoint_counts(self, counts: dict[TrajectoryKey, int]) -> None:
        self.midpoint_counts = counts
        self.midpoint_total = sum(counts.values())

    def runtime_state(self) -> dict[str, Any]:
        """JSON-able generator state and counter (big ints as strings)."""
        state = self.rng.bit_generator.state
        return {
            "starts": self.starts,
            "unresolved_midpoint_starts": self.unresolved_midpoint_starts,
            "rng": {
                "bit_generator": state["bit_generator"],
                "state": str(state["state"]["state"]),
                "inc": str(state["state"]["inc"]),
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            },
        }

    def load_runtime_state(self, state: dict[str, Any]) -> None:
        try:
            rng = state["rng"]
            if rng["bit_generator"] != "PCG64":
                raise ValueError(f"curriculum.rng.bit_generator: expected 'PCG64', got {rng!r}")
            self.rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(rng["state"]), "inc": int(rng["inc"])},
                "has_uint32": int(rng["has_uint32"]),
                "uinteger": int(rng["uinteger"]),
            }
            self.starts = int(state["starts"])
            self.unresolved_midpoint_starts = int(state.get("unresolved_midpoint_starts", 0))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"curriculum: malformed runtime state ({exc!r})") from None
