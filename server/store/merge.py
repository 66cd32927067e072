"""Merging the trajectory-store checkpoints of several stores (one per sidecar) into one.

The merged checkpoint holds the archive one store fed every episode would hold, as far as the
checkpoints allow (docs/store-merge.md lists what is exact and what is not):

- cells: the union of the keys; visits, times chosen and utility sums add;
- best reference: the higher return wins, then the shorter prefix (the store's own rule: a
  maximum, so commutative and associative); where return and step tie exactly, the smaller
  (source name, trajectory id) wins, where one store keeps the episode it recorded first;
- first seen: the smallest (step, offset);
- cell order: by first-seen step, then key bytes, the order one store gives when every episode
  has its own step;
- midpoint-start counts, episode and step counters, trajectory ids handed out: they add.

Trajectory ids are renumbered into one space so that the merged checkpoint loads into a store:
sources sorted by name, trajectory ``t`` of source ``s`` becomes ``s.first_trajectory_id + t``.
The header's ``merge`` entry lists the sources (:func:`merge_sources`); :func:`trajectory_source`
turns a merged id back into (source, that store's id). Only referenced trajectories are kept,
each as its store encoded it, so every best reference resolves in the merged file.

From references to dataset episode ids: a store's trajectory id counts the episodes that store
recorded, in order, one per episode whether stored or not; the store never sees the session,
worker, env or start. A (source, id) pair therefore names a dataset episode
``{node}/{session}/{generation}/{worker_index}/{env}/{start}`` only through a table kept where
both are known: the ingest path, which gets ``first_trajectory_id`` back from each recorded
batch (:class:`BatchResult`). Name each source after its node to look pairs up in such a table;
without one, the referenced prefix itself is in the merged file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recorder_client.capture_types import TrajectoryTrainingConfiguration

from ..durability.checkpoint import MAGIC as FRAME_MAGIC
from ..durability.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .cells import key_bytes
from .store_checkpoint import CHECKPOINT_FORMAT, decode_checkpoint_state, encode_checkpoint_state

MERGE_FORMAT = "recorder.trajectory_store_merge.v1"

_COLUMNS = (
    "visits",
    "first_seen_step",
    "first_seen_offset",
    "times_chosen",
    "best_trajectory",
    "best_step",
    "best_return",
)
_DTYPES = {"best_return": np.float64}
_REPOSITORY = ("ids", "lengths", "refcounts", "offsets", "blobs", "counters")
_CONFIG_FIELDS = (
    "cell_fields",
    "outcome_rule",
    "utilities",
    "repository_capacity_bytes",
    "selection_power",
)
# Counters that add; "last_new_cells" and "last_improved" describe a store's latest episode,
# which no merge can name, and become 0.
_ADDING_COUNTERS = ("episodes", "steps", "unresolved_midpoint_starts")

Checkpoint = bytes | bytearray | memoryview | str | os.PathLike


@dataclass(frozen=True)
class MergeSource:
    """One store whose archive a merged checkpoint holds."""

    name: str
    """The label given to the store's checkpoint (by default its file name)."""
    first_trajectory_id: int
    """The store's trajectory ``t`` is trajectory ``first_trajectory_id + t`` of the merge."""
    trajectories: int
    """Trajectory ids the store handed out: one per episode it recorded."""


@dataclass(frozen=True, eq=False)
class _Input:
    """One checkpoint, checked: its configuration, counters, arrays and the sources it holds."""

    where: str
    configuration: dict[str, Any]
    counters: dict[str, int]
    arrays: Mapping[str, np.ndarray]
    sources: tuple[MergeSource, ...]

    def merged_ids(self, ids: np.ndarray, first: Mapping[str, int]) -> np.ndarray:
        """This input's trajectory ids as ids of the merge whose sources start at ``first``."""
        starts = np.array([s.first_trajectory_id for s in self.sources], dtype=np.int64)
        shift = np.array([first[s.name] for s in self.sources], dtype=np.int64) - starts
        return ids + shift[np.searchsorted(starts, ids, side="right") - 1]


def merge_archives(
    checkpoints: Sequence[Checkpoint],
    *,
    sources: Sequence[str | None] | None = None,
    compress: bool = True,
) -> bytes:
    """The checkpoint file of the merge of ``checkpoints`` (see :func:`merge_checkpoints`),
    in the format a server's store checkpoint has (:func:`encode_checkpoint_file`)."""
    return encode_checkpoint_file(merge_checkpoints(checkpoints, sources=sources), compress)


def encode_checkpoint_file(state: dict[str, Any], compress: bool) -> bytes:
    """A checkpoint state as the bytes of a server's store checkpoint file (what
    `trajectory_store_checkpoint_file` downloads and `load_trajectory_store_checkpoint_data`
    uploads): the store payload, one zstd frame when ``compress``, inside the checksummed
    checkpoint frame."""
    return encode_checkpoint(encode_checkpoint_state(state, compress), compress=False)


def read_checkpoint_state(data: bytes | bytearray | memoryview, where: str = "checkpoint") -> dict:
    """The state a store checkpoint file holds: framed (a server's or a merge's file) or a bare
    payload (as a store's processor encodes it). ValueError naming ``where`` otherwise."""
    try:
        if bytes(data[: len(FRAME_MAGIC)]) == FRAME_MAGIC:
            data = decode_checkpoint(data, source=where)
        return decode_checkpoint_state(data)
    except (ValueError, CheckpointError) as exc:
        raise ValueError(f"{where}: not a trajectory store checkpoint ({exc})") from None


def merge_checkpoints(
    checkpoints: Sequence[Checkpoint], *, sources: Sequence[str | None] | None = None
) -> dict[str, Any]:
    """Merge store checkpoints (file bytes, compressed or not, or paths) into one checkpoint
    state, as :meth:`TrajectoryStore.checkpoint_state` returns it (see the module docstring).

    ``sources`` labels each input's store (default: the path as given, ``input<i>`` for bytes);
    an input that is itself a merge keeps the labels it carries, and its entry must be None.
    Raises ValueError, naming the input and what differs, for unreadable inputs, other formats,
    configurations that differ, and labels that repeat."""
    if isinstance(checkpoints, (bytes, bytearray, memoryview, str, os.PathLike)):
        raise ValueError("checkpoints: expected a sequence of checkpoints, got a single one")
    if not checkpoints:
        raise ValueError("checkpoints: expected at least one checkpoint, got none")
    if sources is None:
        sources = [None] * len(checkpoints)
    elif isinstance(sources, str) or len(sources) != len(checkpoints):
        raise ValueError(
            f"sources: expected {len(checkpoints)} labels (one per checkpoint), got {sources!r}"
        )
    inputs = []
    for i, (item, label) in enumerate(zip(checkpoints, sources, strict=True)):
        if isinstance(item, (bytes, bytearray, memoryview)):
            data, name = item, f"input{i}"
        else:
            name = os.fspath(item)
            data = Path(name).read_bytes()
        inputs.append(_parse(data, name, label))
    return _merge(inputs)


def merge_sources(state: Mapping[str, Any]) -> tuple[MergeSource, ...]:
    """The sources a merged checkpoint state holds, by first trajectory id; ``()`` for the
    checkpoint of a single store."""
    merge = state.get("merge")
    return () if merge is None else _read_sources(merge, "checkpoint")


def trajectory_source(state: Mapping[str, Any], trajectory_id: int) -> tuple[MergeSource, int]:
    """``(source, id in that source's store)`` of a merged checkpoint's trajectory id."""
    for source in merge_sources(state):
        if 0 <= trajectory_id - source.first_trajectory_id < source.trajectories:
            return source, trajectory_id - source.first_trajectory_id
    raise ValueError(f"trajectory_id: {trajectory_id} is in none of the checkpoint's sources")


def _parse(data: bytes | bytearray | memoryview, where: str, label: str | None) -> _Input:
    """Decode and check one checkpoint (ValueError naming ``where``): a store payload, or one
    in the checksummed frame clients get it in (`trajectory_store_checkpoint_file`)."""
    state = read_checkpoint_state(data, where)
    fmt = state.get("format")
    if fmt != CHECKPOINT_FORMAT:
        raise ValueError(f"{where}: format: expected {CHECKPOINT_FORMAT!r}, got {fmt!r}")
    try:
        config = TrajectoryTrainingConfiguration.from_dict(state["configuration"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: configuration: {exc}") from None
    arrays = state["arrays"]
    width = len(config.cell_fields)
    archive = {k: np.asarray(arrays.get(f"archive/{k}")) for k in ("keys", *_COLUMNS)}
    keys = archive["keys"]
    if keys.ndim != 2 or keys.shape[1] != width or keys.dtype != np.int64:
        raise ValueError(f"{where}: archive/keys: expected (N, {width}) int64, got {keys.shape}")
    n = keys.shape[0]
    for name in _COLUMNS:
        if archive[name].shape != (n,):
            raise ValueError(f"{where}: archive/{name}: expected ({n},), got {archive[name].shape}")
    repo = {k: np.asarray(arrays.get(f"repository/{k}")) for k in _REPOSITORY}
    ids, lengths, offsets = repo["ids"], repo["lengths"], repo["offsets"]
    r = ids.shape[0] if ids.ndim == 1 else -1
    if (
        lengths.shape != (r,)
        or repo["refcounts"].shape != (r,)
        or offsets.shape != (r + 1,)
        or repo["counters"].ndim != 1
        or repo["counters"].shape[0] < 3
        or repo["blobs"].ndim != 1
        or repo["blobs"].dtype != np.uint8
        or (r and (offsets[0] != 0 or offsets[-1] != repo["blobs"].size))
        or np.any(np.diff(offsets) < 0)
        or np.any(np.diff(ids) <= 0)
    ):
        raise ValueError(f"{where}: repository arrays are inconsistent")
    next_id = int(repo["counters"][0])
    best = archive["best_trajectory"]
    at = np.minimum(np.searchsorted(ids, best), max(r - 1, 0))
    if n and (r == 0 or np.any(ids[at] != best) or np.any(archive["best_step"] >= lengths[at])):
        raise ValueError(f"{where}: a best reference points at no stored trajectory step")
    for u in config.utilities:
        sums = arrays.get(f"utility/{u.name}")
        if sums is None or sums.shape != (n,):
            raise ValueError(f"{where}: utility/{u.name}: expected ({n},) sums")
    mid, counts = np.asarray(arrays.get("midpoint/keys")), np.asarray(arrays.get("midpoint/counts"))
    if mid.ndim != 2 or mid.shape[1] != width or counts.shape != mid.shape[:1]:
        raise ValueError(f"{where}: midpoint arrays are inconsistent")
    if "merge" in state:
        if label is not None:
            raise ValueError(
                f"{where}: already merges sources, whose labels are kept; expected no label "
                f"for it, got {label!r}"
            )
        sources = _read_sources(state["merge"], where)
        if sum(s.trajectories for s in sources) != next_id:
            raise ValueError(f"{where}: merge sources do not cover its {next_id} trajectory ids")
    else:
        label = where if label is None else label
        if not isinstance(label, str) or not label:
            raise ValueError(f"{where}: source label: expected a non-empty string, got {label!r}")
        sources = (MergeSource(label, 0, next_id),)
    if r and (ids[0] < 0 or ids[-1] >= next_id):
        raise ValueError(f"{where}: trajectory ids beyond the {next_id} handed out")
    try:
        counters = {k: int(v) for k, v in (state.get("counters") or {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: counters: {exc}") from None
    return _Input(where, config.to_dict(), counters, arrays, sources)


def _read_sources(merge: Any, where: str) -> tuple[MergeSource, ...]:
    """The ``merge`` header entry's sources: named, sorted by name, ids contiguous from 0."""
    fmt = merge.get("format") if isinstance(merge, Mapping) else None
    if fmt != MERGE_FORMAT:
        raise ValueError(f"{where}: merge.format: expected {MERGE_FORMAT!r}, got {fmt!r}")
    try:
        sources = tuple(
            MergeSource(str(s["name"]), int(s["first_trajectory_id"]), int(s["trajectories"]))
            for s in merge["sources"]
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: merge.sources: malformed ({exc!r})") from None
    first = 0
    for s in sources:
        if s.first_trajectory_id != first or s.trajectories < 0:
            raise ValueError(f"{where}: merge.sources: ids not contiguous at {s.name!r}")
        first += s.trajectories
    names = [s.name for s in sources]
    if not sources or names != sorted(set(names)):
        raise ValueError(f"{where}: merge.sources: expected unique sorted names, got {names}")
    return sources


def _check_compatible(first: _Input, other: _Input) -> None:
    for name in _CONFIG_FIELDS:
        a, b = first.configuration[name], other.configuration[name]
        if a != b:
            raise ValueError(
                f"{other.where}: configuration.{name} differs from {first.where}'s: "
                f"expected {a!r}, got {b!r}"
            )


def _merge(inputs: list[_Input]) -> dict[str, Any]:
    for other in inputs[1:]:
        _check_compatible(inputs[0], other)
    leaves = sorted((s for x in inputs for s in x.sources), key=lambda s: s.name)
    for a, b in zip(leaves, leaves[1:]):
        if a.name == b.name:
            raise ValueError(
                f"sources: the label {a.name!r} names two stores; give each its own label"
            )
    first, total = {}, 0
    for s in leaves:
        first[s.name] = total
        total += s.trajectories
    # The order inputs are added in (utility sums are floats): by their first source's name,
    # so that the order they were given in never matters.
    inputs = sorted(inputs, key=lambda x: min(s.name for s in x.sources))
    config = inputs[0].configuration
    width = len(config["cell_fields"])

    def cat(name: str) -> np.ndarray:
        return np.concatenate([x.arrays[name] for x in inputs])

    keys = cat("archive/keys").astype(np.int64).reshape(-1, width)
    col = {name: cat(f"archive/{name}").astype(_DTYPES.get(name, np.int64)) for name in _COLUMNS}
    best_tid = np.concatenate(
        [
            x.merged_ids(np.asarray(x.arrays["archive/best_trajectory"], np.int64), first)
            for x in inputs
        ]
    )
    # Rows grouped by cell; a group's index is the rank of its key's bytes.
    _, group = np.unique(key_bytes(keys), return_inverse=True)
    group = group.reshape(-1)
    size = int(group.max()) + 1 if group.size else 0
    heads = np.cumsum(np.bincount(group, minlength=size)) - np.bincount(group, minlength=size)
    # Per group, the row each rule prefers: the first one, sorted by group and then the rule.
    first_seen = np.lexsort((col["first_seen_offset"], col["first_seen_step"], group))[heads]
    best = np.lexsort((best_tid, col["best_step"], -col["best_return"], group))[heads]
    # Cells in the order one store gives them when every episode has its own step.
    order = np.lexsort((np.arange(size), col["first_seen_step"][first_seen]))
    first_seen, best = first_seen[order], best[order]
    rank = np.empty(size, dtype=np.int64)
    rank[order] = np.arange(size)
    cell = rank[group]  # the merged cell of every input row

    def added(values: np.ndarray, dtype: type) -> np.ndarray:
        # np.add.at adds row after row: each cell's values in input order.
        out = np.zeros(size, dtype=dtype)
        np.add.at(out, cell, values)
        return out

    arrays: dict[str, np.ndarray] = {
        "archive/keys": keys[first_seen],
        "archive/visits": added(col["visits"], np.int64),
        "archive/first_seen_step": col["first_seen_step"][first_seen],
        "archive/first_seen_offset": col["first_seen_offset"][first_seen],
        "archive/times_chosen": added(col["times_chosen"], np.int64),
        "archive/best_trajectory": best_tid[best],
        "archive/best_step": col["best_step"][best],
        "archive/best_return": col["best_return"][best],
    }
    arrays.update(_repository(inputs, first, total, arrays["archive/best_trajectory"]))
    for u in config["utilities"]:
        name = f"utility/{u['name']}"
        arrays[name] = added(cat(name).astype(np.float64), np.float64)
    arrays.update(_midpoints(inputs, width))
    counters = {"episodes": 0, "steps": 0, "last_new_cells": 0, "last_improved": 0}
    counters["unresolved_midpoint_starts"] = 0
    for x in inputs:
        for name in _ADDING_COUNTERS:
            counters[name] += x.counters.get(name, 0)
    sources = [
        {"name": s.name, "first_trajectory_id": first[s.name], "trajectories": s.trajectories}
        for s in leaves
    ]
    return {
        "format": CHECKPOINT_FORMAT,
        "configuration": config,
        "counters": counters,
        "merge": {"format": MERGE_FORMAT, "sources": sources},
        "arrays": arrays,
    }


def _repository(
    inputs: list[_Input], first: Mapping[str, int], total: int, best: np.ndarray
) -> dict[str, np.ndarray]:
    """The merged repository: the referenced trajectories, their blobs as stored."""
    wanted, refcounts = np.unique(best, return_counts=True)
    found: dict[int, tuple[int, bytes]] = {}
    evictions = discarded = 0
    for x in inputs:
        ids = x.merged_ids(np.asarray(x.arrays["repository/ids"], np.int64), first)
        lengths, offsets = x.arrays["repository/lengths"], x.arrays["repository/offsets"]
        blobs = x.arrays["repository/blobs"]
        for i in np.flatnonzero(np.isin(ids, wanted)).tolist():
            blob = blobs[int(offsets[i]) : int(offsets[i + 1])].tobytes()
            found[int(ids[i])] = (int(lengths[i]), blob)
        evictions += int(x.arrays["repository/counters"][1])
        discarded += int(x.arrays["repository/counters"][2])
    entries = [found[t] for t in wanted.tolist()]
    sizes = np.array([len(blob) for _, blob in entries], dtype=np.int64)
    return {
        "repository/ids": wanted.astype(np.int64),
        "repository/lengths": np.array([n for n, _ in entries], dtype=np.int64),
        "repository/refcounts": refcounts.astype(np.int64),
        "repository/offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        "repository/blobs": np.frombuffer(b"".join(b for _, b in entries), dtype=np.uint8),
        "repository/counters": np.array([total, evictions, discarded], dtype=np.int64),
    }


def _midpoints(inputs: list[_Input], width: int) -> dict[str, np.ndarray]:
    """Midpoint-start counts summed per cell key, in key-byte order."""
    keys = np.concatenate(
        [np.asarray(x.arrays["midpoint/keys"], np.int64).reshape(-1, width) for x in inputs]
    )
    counts = np.concatenate([np.asarray(x.arrays["midpoint/counts"], np.int64) for x in inputs])
    _, first, group = np.unique(key_bytes(keys), return_index=True, return_inverse=True)
    total = np.zeros(first.shape[0], dtype=np.int64)
    np.add.at(total, group.reshape(-1), counts)
    return {"midpoint/keys": keys[first].reshape(-1, width), "midpoint/counts": total}
