"""Plain types shared by the client and the trajectory store (stdlib only).

The client sends a :class:`TrajectoryTrainingConfiguration` (as ``to_dict()`` JSON) to turn on the
server's Go-Explore-style trajectory store; the server answers with
:class:`TrajectorySliceReference` starts and :class:`CheckpointFile` payloads. Nothing here
imports numpy or gRPC.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

TrajectoryKey = tuple[int, ...]
"""A cell key: one int per configured :class:`CellField`, in configuration order."""

DEFAULT_REPOSITORY_CAPACITY_BYTES = 256 * 1024 * 1024


class EpisodeOutcome(enum.IntEnum):
    """How an episode ended.

    The integer values are the per-step outcome codes a client may stream next to the rewards:
    0 UNKNOWN (no outcome, the configured :class:`OutcomeRule` then decides), 1 WIN, 2 LOSS,
    3 DRAW, 4 INCOMPLETE (cut by the end of recording, never derived by a rule).
    """

    UNKNOWN = 0
    WIN = 1
    LOSS = 2
    DRAW = 3
    INCOMPLETE = 4

    @classmethod
    def coerce(cls, value: EpisodeOutcome | int | str) -> EpisodeOutcome:
        """Accept an EpisodeOutcome, its int code or its name (case-insensitive)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(
                    f"outcome: unknown name {value!r}; expected one of {[m.name for m in cls]}"
                ) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"outcome: expected an EpisodeOutcome, code or name, got {value!r}")
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"outcome: unknown code {value!r}; expected 0..{len(cls) - 1}"
            ) from None

    @classmethod
    def from_step_codes(cls, codes: Iterable[int]) -> EpisodeOutcome:
        """The outcome of an episode from its per-step codes: the last non-zero code.

        All zeros (or no steps) give UNKNOWN. A code outside 0..4 raises ValueError.
        """
        outcome = cls.UNKNOWN
        for code in codes:
            current = cls.coerce(int(code))
            if current is not cls.UNKNOWN:
                outcome = current
        return outcome


def _check_int(owner: str, name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name}: expected an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}.{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _check_name(owner: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise ValueError(f"{owner}.{name}: expected a non-empty printable string, got {value!r}")
    return value


def _check_keys(owner: str, data: Any, allowed: Iterable[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner}: expected a mapping, got {data!r}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{owner}: unknown keys {unknown}; expected a subset of {list(allowed)}")
    return data


def _as_tuple(owner: str, name: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{owner}.{name}: expected a sequence, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class CellField:
    """One int of the cell key: ``states[state_field][t][index] // bucket`` for each step t."""

    state_field: str
    """Env-state field name as recorded (original name, e.g. ``player_positions``)."""
    index: tuple[int, ...] = ()
    """Index into the per-step array of that field; ``()`` for a scalar field."""
    bucket: int = 1
    """Floor-divide the value by this (>= 1); 1 keeps the value as is."""
    name: str = ""
    """Name of this key field in ``snapshot_potential``; empty derives ``state_field[i,j]``
    (just ``state_field`` when ``index`` is ``()``)."""

    def __post_init__(self) -> None:
        _check_name("CellField", "state_field", self.state_field)
        index = _as_tuple("CellField", "index", self.index)
        for i in index:
            _check_int("CellField", "index", i, 0)
        object.__setattr__(self, "index", index)
        _check_int("CellField", "bucket", self.bucket, 1)
        if self.name:
            _check_name("CellField", "name", self.name)

    @property
    def key_name(self) -> str:
        """The name this field has in cell keys and ``snapshot_potential``."""
        if self.name:
            return self.name
        if not self.index:
            return self.state_field
        return f"{self.state_field}[{','.join(str(i) for i in self.index)}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_field": self.state_field,
            "index": list(self.index),
            "bucket": self.bucket,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CellField:
        data = _check_keys("CellField", data, ("state_field", "index", "bucket", "name"))
        return cls(**data)


@dataclass(frozen=True)
class UtilityConfig:
    """A per-cell value back-propagated from episode outcomes.

    A step k steps before the episode's end (the last step has k = 0) adds
    ``gamma**k * (+1 if outcome in positive_outcomes, -1 if in negative_outcomes, else 0)`` to its
    cell's sum; the cell's net value is that sum divided by its visit count.
    """

    name: str
    """Utility key, e.g. ``win_proximity``."""
    gamma: float = 0.99
    """Discount per step back from the episode's end, in [0, 1]."""
    positive_outcomes: tuple[str, ...] = ("WIN",)
    """EpisodeOutcome names that count +1."""
    negative_outcomes: tuple[str, ...] = ("LOSS",)
    """EpisodeOutcome names that count -1 (disjoint from positive_outcomes)."""

    def __post_init__(self) -> None:
        _check_name("UtilityConfig", "name", self.name)
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)):
            raise ValueError(f"UtilityConfig.gamma: expected a float in [0, 1], got {self.gamma!r}")
        if not 0.0 <= float(self.gamma) <= 1.0:
            raise ValueError(f"UtilityConfig.gamma: expected a float in [0, 1], got {self.gamma!r}")
        object.__setattr__(self, "gamma", float(self.gamma))
        valid = [m.name for m in EpisodeOutcome]
        for attr in ("positive_outcomes", "negative_outcomes"):
            names = _as_tuple("UtilityConfig", attr, getattr(self, attr))
            for n in names:
                if n not in valid:
                    raise ValueError(
                        f"UtilityConfig.{attr}: unknown outcome {n!r}; expected names from {valid}"
                    )
            object.__setattr__(self, attr, names)
        both = sorted(set(self.positive_outcomes) & set(self.negative_outcomes))
        if both:
            raise ValueError(
                f"UtilityConfig: outcomes {both} are both positive and negative in {self.name!r}"
            )

    def sign(self, outcome: EpisodeOutcome) -> float:
        """+1, -1 or 0 for an episode outcome."""
        if outcome.name in self.positive_outcomes:
            return 1.0
        if outcome.name in self.negative_outcomes:
            return -1.0
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gamma": self.gamma,
            "positive_outcomes": list(self.positive_outcomes),
            "negative_outcomes": list(self.negative_outcomes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UtilityConfig:
        keys = ("name", "gamma", "positive_outcomes", "negative_outcomes")
        return cls(**_check_keys("UtilityConfig", data, keys))


OUTCOME_RULE_KINDS = ("none", "reward_sign")


@dataclass(frozen=True)
class OutcomeRule:
    """How to derive an outcome for an episode that arrives as UNKNOWN.

    ``kind="none"``: it stays UNKNOWN. ``kind="reward_sign"``: episode return (sum of rewards)
    ``> threshold`` is WIN, ``< -threshold`` is LOSS, anything else DRAW. INCOMPLETE and explicit
    outcomes are never changed.
    """

    kind: str = "none"
    """One of ``"none"``, ``"reward_sign"``."""
    threshold: float = 0.0
    """Non-negative margin for ``reward_sign``."""

    def __post_init__(self) -> None:
        if self.kind not in OUTCOME_RULE_KINDS:
            raise ValueError(
                f"OutcomeRule.kind: unknown kind {self.kind!r}; expected one of {OUTCOME_RULE_KINDS}"
            )
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"OutcomeRule.threshold: expected a finite float >= 0, got {t!r}")
        object.__setattr__(self, "threshold", float(t))

    def resolve(self, outcome: EpisodeOutcome, episode_return: float) -> EpisodeOutcome:
        """The outcome to record: ``outcome`` unless it is UNKNOWN and the rule derives one."""
        if outcome is not EpisodeOutcome.UNKNOWN or self.kind == "none":
            return outcome
        if episode_return > self.threshold:
            return EpisodeOutcome.WIN
        if episode_return < -self.threshold:
            return EpisodeOutcome.LOSS
        return EpisodeOutcome.DRAW

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OutcomeRule:
        return cls(**_check_keys("OutcomeRule", data, ("kind", "threshold")))


@dataclass(frozen=True)
class TrajectoryTrainingConfiguration:
    """Turns on the trajectory store: how cells are keyed, outcomes, utilities, limits."""

    cell_fields: tuple[CellField, ...]
    """The cell key, one int per field, in this order (at least one; key names unique)."""
    outcome_rule: OutcomeRule = field(default_factory=OutcomeRule)
    """Derives outcomes for episodes that arrive as UNKNOWN."""
    utilities: tuple[UtilityConfig, ...] = ()
    """Back-propagated per-cell utilities (names unique)."""
    repository_capacity_bytes: int = DEFAULT_REPOSITORY_CAPACITY_BYTES
    """Byte cap on stored (compressed) trajectories; unreferenced ones are evicted above it."""
    selection_power: float = 0.5
    """Start weight of a cell is ``1 / (times_chosen + 1) ** selection_power`` (>= 0)."""

    def __post_init__(self) -> None:
        owner = "TrajectoryTrainingConfiguration"
        cells = _as_tuple(owner, "cell_fields", self.cell_fields)
        if not cells:
            raise ValueError(f"{owner}.cell_fields: expected at least one CellField, got ()")
        for c in cells:
            if not isinstance(c, CellField):
                raise ValueError(f"{owner}.cell_fields: expected CellField items, got {c!r}")
        names = [c.key_name for c in cells]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"{owner}.cell_fields: duplicate key names {dupes}")
        object.__setattr__(self, "cell_fields", cells)
        if not isinstance(self.outcome_rule, OutcomeRule):
            raise ValueError(
                f"{owner}.outcome_rule: expected an OutcomeRule, got {self.outcome_rule!r}"
            )
        utils = _as_tuple(owner, "utilities", self.utilities)
        for u in utils:
            if not isinstance(u, UtilityConfig):
                raise ValueError(f"{owner}.utilities: expected UtilityConfig items, got {u!r}")
        unames = [u.name for u in utils]
        dupes = sorted({n for n in unames if unames.count(n) > 1})
        if dupes:
            raise ValueError(f"{owner}.utilities: duplicate utility names {dupes}")
        object.__setattr__(self, "utilities", utils)
        _check_int(owner, "repository_capacity_bytes", self.repository_capacity_bytes, 1)
        p = self.selection_power
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0:
            raise ValueError(f"{owner}.selection_power: expected a finite float >= 0, got {p!r}")
        object.__setattr__(self, "selection_power", float(p))

    @property
    def key_names(self) -> tuple[str, ...]:
        """Names of the cell-key fields, in key order."""
        return tuple(c.key_name for c in self.cell_fields)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; ``from_dict`` inverts it."""
        return {
            "cell_fields": [c.to_dict() for c in self.cell_fields],
            "outcome_rule": self.outcome_rule.to_dict(),
            "utilities": [u.to_dict() for u in self.utilities],
            "repository_capacity_bytes": self.repository_capacity_bytes,
            "selection_power": self.selection_power,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrajectoryTrainingConfiguration:
        owner = "TrajectoryTrainingConfiguration"
        keys = (
            "cell_fields",
            "outcome_rule",
            "utilities",
            "repository_capacity_bytes",
            "selection_power",
        )
        data = dict(_check_keys(owner, data, keys))
        if "cell_fields" not in data:
            raise ValueError(f"{owner}: missing required key 'cell_fields'")
        data["cell_fields"] = tuple(
            CellField.from_dict(c) for c in _as_tuple(owner, "cell_fields", data["cell_fields"])
        )
        if "outcome_rule" in data:
            data["outcome_rule"] = OutcomeRule.from_dict(data["outcome_rule"])
        if "utilities" in data:
            data["utilities"] = tuple(
                UtilityConfig.from_dict(u) for u in _as_tuple(owner, "utilities", data["utilities"])
            )
        return cls(**data)


@dataclass(frozen=True)
class TrajectorySliceReference:
    """A place in the repository: step ``step`` (0-based) of trajectory ``trajectory_id``."""

    trajectory_id: int = 0
    """Repository id of the trajectory (ids grow with each episode the store records)."""
    step: int = 0
    """0-based step within that trajectory; the prefix runs up to and including it."""
    cell: tuple[int, ...] | None = field(default=None, compare=False)
    """The archive cell this reference reaches (its key, one int per cell-key field), when
    known: ``sample_start`` names the cell it chose. Not part of equality or hashing."""

    def __post_init__(self) -> None:
        _check_int("TrajectorySliceReference", "trajectory_id", self.trajectory_id, 0)
        _check_int("TrajectorySliceReference", "step", self.step, 0)
        if self.cell is not None:
            cell = _as_tuple("TrajectorySliceReference", "cell", self.cell)
            object.__setattr__(self, "cell", tuple(int(v) for v in cell))

    def to_dict(self) -> dict[str, int]:
        return {"trajectory_id": self.trajectory_id, "step": self.step}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrajectorySliceReference:
        return cls(**_check_keys("TrajectorySliceReference", data, ("trajectory_id", "step")))


@dataclass(frozen=True)
class CheckpointFile:
    """A checkpoint payload: bytes in memory (``data``) and/or on disk (``path``)."""

    name: str = ""
    """File name (no directory), e.g. ``trajectory_store-step000000001000.bin.zst``."""
    size: int = 0
    """Length of the payload in bytes."""
    sha256: str = ""
    """Hex SHA-256 of the payload bytes."""
    data: bytes | None = None
    """The payload, when held in memory."""
    path: str | None = None
    """Where the payload was written, when on disk."""


# The archive table's columns besides the cell-key fields and the utilities, in this order.
ARCHIVE_COLUMNS = (
    "visits",
    "times_chosen",
    "first_seen_step",
    "best_return",
    "best_length",
    "best_trajectory_id",
    "best_step",
    "midpoint_starts",
    "selection_probability",
)


@dataclass(frozen=True, eq=False)
class ArchiveColumns:
    """The trajectory store's cell archive as numpy columns (``recorder.capture.archive()``).

    One row per cell, in the order cells were first seen; every column has shape (cells,).
    """

    key_names: tuple[str, ...]
    """Names of the cell-key fields (:attr:`CellField.key_name`), in key order."""
    cells: dict[str, Any]
    """The cell key per field: ``{key name: int64 column}``."""
    visits: Any
    """int64: steps spent in the cell over every recorded episode."""
    times_chosen: Any
    """int64: times ``sample_start`` chose the cell."""
    first_seen_step: Any
    """int64: the step recorded with the episode that first reached the cell."""
    best_return: Any
    """float64: cumulative reward of the best known way to the cell, up to and including it."""
    best_length: Any
    """int64: steps of that best prefix (``best_step + 1``)."""
    best_trajectory_id: Any
    """int64: the best reference's trajectory id."""
    best_step: Any
    """int64: the best reference's 0-based step in that trajectory."""
    selection_probability: Any
    """float64: the chance that the next ``sample_start`` picks the cell (sums to 1)."""
    utilities: dict[str, Any]
    """Each utility's net value (sum / visits): ``{utility name: float64 column}``."""
    midpoint_starts: Any
    """int64: episodes recorded with a start reference into the cell."""

    def __len__(self) -> int:
        return len(self.visits)

    @property
    def keys(self) -> Any:
        """The cell keys as one (cells, fields) int64 array, columns in key order."""
        import numpy as np

        if not self.key_names:
            return np.zeros((len(self), 0), dtype=np.int64)
        return np.stack([self.cells[n] for n in self.key_names], axis=1)

    @property
    def best_reference(self) -> Any:
        """The best references as one (cells, 2) int64 array of (trajectory id, step)."""
        import numpy as np

        return np.stack([self.best_trajectory_id, self.best_step], axis=1)

    def index(self, cell: TrajectoryKey) -> int | None:
        """The row of a cell key (one int per key field), or None when the archive lacks it."""
        key = tuple(int(v) for v in cell)
        if len(key) != len(self.key_names):
            raise ValueError(
                f"cell: expected {len(self.key_names)} ints ({list(self.key_names)}), got {cell!r}"
            )
        hits = (self.keys == key).all(axis=1).nonzero()[0] if len(self) else ()
        return int(hits[0]) if len(hits) else None

    def reference(self, row: int) -> TrajectorySliceReference:
        """The best reference of the cell in ``row``, naming its cell."""
        return TrajectorySliceReference(
            int(self.best_trajectory_id[row]),
            int(self.best_step[row]),
            tuple(int(self.cells[n][row]) for n in self.key_names),
        )

    def columns(self) -> dict[str, Any]:
        """Every column under the server's names (``cell:<name>``, ``utility:<name>``, ...)."""
        out = {f"cell:{n}": self.cells[n] for n in self.key_names}
        for name in ARCHIVE_COLUMNS:
            out[name] = getattr(self, name)
        out.update({f"utility:{n}": v for n, v in self.utilities.items()})
        return out

    @classmethod
    def from_columns(
        cls, columns: Mapping[str, Any], key_names: Iterable[str], utility_names: Iterable[str]
    ) -> ArchiveColumns:
        """Inverse of :meth:`columns` (ValueError naming a missing column)."""
        key_names, utility_names = tuple(key_names), tuple(utility_names)
        wanted = [f"cell:{n}" for n in key_names] + [f"utility:{n}" for n in utility_names]
        wanted += [f.name for f in fields(cls) if f.name not in ("key_names", "cells", "utilities")]
        missing = [name for name in wanted if name not in columns]
        if missing:
            raise ValueError(f"archive: expected columns {wanted}, missing {missing}")
        plain = {
            f.name: columns[f.name]
            for f in fields(cls)
            if f.name not in ("key_names", "cells", "utilities")
        }
        return cls(
            key_names=key_names,
            cells={n: columns[f"cell:{n}"] for n in key_names},
            utilities={n: columns[f"utility:{n}"] for n in utility_names},
            **plain,
        )
