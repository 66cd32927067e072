"""Observations as state fields: a nested dict / tuple of arrays flattened to names joined
by dots (``obs``, ``obs.pos``, ``obs.0``, ``obs.a.0.b``), and rebuilt from them.

record() flattens `obs` and `final_obs` with `flatten`; `unflatten` gives the caller back
the structure from ``Trajectory.states`` or ``Trajectory.final_states``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _wire
from .errors import InvalidChunkError


def flatten(value: Any, prefix: str, label: str) -> list[tuple[str, Any]]:
    """(name, array) of every leaf of ``value``: the value itself when it is an array, else
    one per dict key (``prefix.key``) or tuple / list item (``prefix.i``), recursively.
    ``label`` names the argument in errors (``trajectories.obs``)."""
    if len(prefix) > _wire.MAX_FIELD_NAME:  # bounds the nesting too (a dict holding itself)
        raise InvalidChunkError(
            f"{label.split('[', 1)[0]}: expected field names of at most "
            f"{_wire.MAX_FIELD_NAME} characters (the keys joined by dots), got "
            f"{_wire.shown(prefix)}"
        )
    if isinstance(value, Mapping):
        out: list[tuple[str, Any]] = []
        for key, item in value.items():
            if not isinstance(key, str) or not key or "." in key or not key.isprintable():
                raise InvalidChunkError(
                    f"{label}: expected dict keys that are non-empty printable strings "
                    f"without '.' (they become field names joined by dots), got "
                    f"{_wire.shown(key)}"
                )
            out += flatten(item, f"{prefix}.{key}", f"{label}[{key!r}]")
        if not out:
            raise InvalidChunkError(f"{label}: expected at least one array, got an empty dict")
        return out
    if isinstance(value, (tuple, list)):
        out = []
        for i, item in enumerate(value):
            out += flatten(item, f"{prefix}.{i}", f"{label}[{i}]")
        if not out:
            raise InvalidChunkError(f"{label}: expected at least one array, got an empty sequence")
        return out
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        # Nested lists of numbers are read item by item, as a Tuple observation would be.
        in_sequence = label.endswith("]") and label[-2].isdigit()  # obs[0], not obs['a']
        inside = " inside a list or tuple, whose items are observations" if in_sequence else ""
        raise InvalidChunkError(
            f"{label}: expected an array (T, N, ...) or a dict / tuple of them, "
            f"got {type(value).__name__}{inside}"
        )
    return [(prefix, value)]


def unflatten(fields: Mapping[str, Any], prefix: str = "obs") -> Any:
    """The nested structure whose flattened fields are ``fields`` under ``prefix``.

    ``fields`` is ``Trajectory.states``, ``Trajectory.final_states`` or any mapping of
    flattened names. A field named ``prefix`` itself is returned as it is (a plain Box
    observation). Otherwise each level becomes a tuple when its keys are 0, 1, ..., n-1
    (a Tuple space), else a dict in the recorded order (a Dict space). KeyError when no
    field lies under ``prefix``.
    """
    if prefix in fields:
        return fields[prefix]
    start = prefix + "."
    tree: dict[str, Any] = {}
    for name, value in fields.items():
        if not name.startswith(start):
            continue
        node = tree
        parts = name[len(start) :].split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"fields: {name!r} lies under a field that is an array")
        node[parts[-1]] = value
    if not tree:
        raise KeyError(
            f"fields: expected {prefix!r} or names starting with {start!r}, got {sorted(fields)}"
        )
    return _build(tree)


def _build(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    keys = list(node)
    if all(k.isdigit() for k in keys) and sorted(int(k) for k in keys) == list(range(len(keys))):
        return tuple(_build(node[str(i)]) for i in range(len(keys)))
    return {k: _build(v) for k, v in node.items()}
