"""How far a session's finished episodes have reached its dataset: plain state that the
write-ahead log drives and checkpoints hold.

A write goes: log an intent (file number, and per worker the rows of its episode table the
file holds), write the file whole, log its commit. After a crash, an intent without a commit
is written again with exactly the same rows under the same name, so an episode reaches the
dataset once whether or not the first write landed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Intent:
    seq: int
    generation: int
    ranges: dict[str, tuple[int, int]]
    """Worker id -> (first, end) rows of its episode table."""
    node: str = ""
    """The node id the file is named after (a write redone after a restart under another
    --node-id keeps its first name); "" in records from before it was kept."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "generation": self.generation,
            "ranges": {w: list(r) for w, r in self.ranges.items()},
            "node": self.node,
        }

    @classmethod
    def from_dict(cls, value: Any) -> Intent:
        if not isinstance(value, dict) or not isinstance(value.get("ranges"), dict):
            raise ValueError(f"dataset intent: expected seq, generation and ranges, got {value!r}")
        ranges = {}
        for worker, pair in value["ranges"].items():
            first, end = (_count(v, "dataset intent range") for v in pair)
            if first > end:
                raise ValueError(f"dataset intent: range {pair} of {worker!r} is reversed")
            ranges[str(worker)] = (first, end)
        node = value.get("node", "")
        if not isinstance(node, str) or len(node) > 64:
            raise ValueError(f"dataset intent: node: expected a node id, got {node!r}")
        return cls(
            _count(value["seq"], "dataset intent seq"),
            _count(value["generation"], "dataset intent generation"),
            ranges,
            node,
        )


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"{what}: expected a count, got {value!r}")
    return value


@dataclass
class DatasetCursor:
    generation: int = 0
    """Resets of the session so far: episode ids and file names carry it."""
    seq: int = 0
    """The next file's number."""
    written: dict[str, int] = field(default_factory=dict)
    """Worker id -> rows of its episode table committed to the dataset."""
    pending: Intent | None = None
    """A logged write whose commit is not (yet) logged."""
    probed: bool = False
    """Whether the dataset was searched for files an earlier session of this name left on
    this node (not kept: redone after a restart until a write is logged)."""

    @property
    def fresh(self) -> bool:
        """Nothing of this session was written or logged yet."""
        return not (self.probed or self.seq or self.written or self.pending)

    def intent(self, intent: Intent) -> None:
        self.pending = intent
        # A generation chosen past an earlier session's files is in the log from here on.
        self.generation = max(self.generation, intent.generation)

    def commit(self, seq: int) -> None:
        if self.pending is None or self.pending.seq != seq:
            return  # a commit whose intent a checkpoint already folded in
        for worker, (_first, end) in self.pending.ranges.items():
            self.written[worker] = max(self.written.get(worker, 0), end)
        self.seq = max(self.seq, seq + 1)
        self.pending = None

    def reset(self) -> None:
        self.generation += 1
        self.written = {}
        self.pending = None

    def state(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "seq": self.seq,
            "written": dict(self.written),
            "pending": None if self.pending is None else self.pending.to_dict(),
        }

    @classmethod
    def from_state(cls, value: Any) -> DatasetCursor:
        if not isinstance(value, dict) or not isinstance(value.get("written"), dict):
            raise ValueError(f"expected generation, seq, written and pending, got {value!r}")
        pending = value.get("pending")
        return cls(
            _count(value["generation"], "generation"),
            _count(value["seq"], "seq"),
            {str(w): _count(n, "written") for w, n in value["written"].items()},
            None if pending is None else Intent.from_dict(pending),
        )
