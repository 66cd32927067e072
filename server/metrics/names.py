"""How a metric tag is named in each sink: its Prometheus name, and the tag with its labels
folded in (TensorBoard, JSON lines, `snapshot`).

The lowest layer of the metrics package: the catalog (to print the docs table) and the
tracker both name metrics through it, and it imports neither.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
"""A valid Prometheus label name (and namespace)."""

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]+")
_UNDERSCORES = re.compile(r"__+")


def prometheus_name(tag: str, *, counter: bool, namespace: str = "rollout_recorder") -> str:
    """The Prometheus name of a tag: ``Recorder/rawBytes`` → ``rollout_recorder_raw_bytes_total``
    (a leading ``Recorder/`` is dropped: the namespace says it)."""
    if tag.startswith("Recorder/"):
        tag = tag[len("Recorder/") :]
    base = _CAMEL.sub("_", tag)
    base = _UNDERSCORES.sub("_", _NOT_NAME.sub("_", base)).strip("_").lower()
    if not base:
        raise ValueError(f"tag {tag!r} has no character usable in a Prometheus name")
    name = f"{namespace}_{base}" if namespace else base
    if name[0].isdigit():
        name = "_" + name
    if counter and not name.endswith("_total"):
        name += "_total"
    return name


def fold_tag(tag: str, labels: Mapping[str, object] | None = None) -> str:
    """The tag with its labels folded in, as used by TensorBoard, JSON lines and `snapshot`."""
    if not labels:
        return tag
    return "/".join([tag, *(f"{k}={v}" for k, v in sorted(labels.items()))])


def label_key(labels: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """Keyword labels as sorted ``(name, str(value))`` pairs: the key of one series."""
    if len(labels) == 1:
        ((k, v),) = labels.items()
        return ((k, v if type(v) is str else str(v)),)
    return tuple(sorted((k, v if type(v) is str else str(v)) for k, v in labels.items()))
