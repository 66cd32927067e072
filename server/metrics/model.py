"""The tracker's data model: what a series is, and the table of every series seen so far.

A *family* is one tag with its kind (scalar, counter, gauge or episodes), its label names and
its Prometheus name and help text (from the catalog); a *series* is a family with label
values. `SeriesTable` registers them on first sight and refuses what would make two of them
collide in a sink. `Episodes` holds one episode series' histograms and the episodes queued to
be folded into them. None of this is thread-safe: the tracker's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import catalog
from .names import LABEL_NAME, fold_tag, prometheus_name
from .sinks import PromRow

SCALAR = "scalar"
COUNTER = "counter"
GAUGE = "gauge"
EPISODES = "episodes"
HISTOGRAM = "histogram"

# The rows of an episode summary, in the order they are written.
EPISODE_TAGS = (
    "Episode/count",
    "Episode/return_mean",
    "Episode/return_min",
    "Episode/return_max",
    "Episode/length_mean",
    "Episode/length_min",
    "Episode/length_max",
)
RETURN_TAG = "Episode/return"
LENGTH_TAG = "Episode/length"
HISTOGRAMS = (RETURN_TAG, LENGTH_TAG)


@dataclass(frozen=True)
class Series:
    kind: str
    tag: str
    label_names: tuple[str, ...]
    label_values: tuple[str, ...]
    folded: str

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        return tuple(zip(self.label_names, self.label_values, strict=True))


@dataclass(frozen=True)
class Family:
    kind: str
    label_names: tuple[str, ...]
    prom_name: str
    exported: str
    """The Prometheus type: counter (counters, and scalars the catalog calls counters) or
    gauge."""
    help: str


class SeriesTable:
    """Every series and family registered so far, and which Prometheus and folded names
    they own."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.series: dict[object, Series] = {}
        self.families: dict[str, Family] = {}
        self._prom_owner: dict[str, str] = {}
        self._folded_owner: dict[str, object] = {}

    def register(self, key: object, tag: str, lkey: tuple[tuple[str, str], ...], kind: str) -> None:
        """First sight of a series: check kind, label names and name collisions."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"metric tag must be a non-empty str, got {tag!r}")
        label_names = tuple(k for k, _ in lkey)
        family = self.families.get(tag)
        if family is None:
            family = self._new_family(tag, label_names, kind)
        elif family.kind != kind:
            raise ValueError(f"metric {tag!r} is a {family.kind}, not a {kind}")
        elif family.label_names != label_names:
            raise ValueError(
                f"metric {tag!r} has labels {list(family.label_names)}, got {list(label_names)}"
            )
        folded = fold_tag(tag, dict(lkey))
        other_key = self._folded_owner.get(folded)
        if other_key is not None and other_key != key:
            raise ValueError(f"metric series {key!r} and {other_key!r} both fold to {folded!r}")
        self._folded_owner[folded] = key
        self.series[key] = Series(kind, tag, label_names, tuple(v for _, v in lkey), folded)

    def _new_family(self, tag: str, label_names: tuple[str, ...], kind: str) -> Family:
        for name in label_names:
            if not LABEL_NAME.match(name) or name.startswith("__"):
                raise ValueError(f"metric {tag!r}: invalid label name {name!r}")
        spec = catalog.spec_of(tag)
        monotone = kind == COUNTER or (
            kind == SCALAR and spec is not None and spec.kind == catalog.COUNTER
        )
        ns = self.namespace
        prom = prometheus_name(tag, counter=monotone, namespace=ns)
        names = [prom]
        if monotone:  # the family is exposed under the name without _total too
            names.append(prom[: -len("_total")])
        if kind == EPISODES:
            names = [prometheus_name(t, counter=False, namespace=ns) for t in HISTOGRAMS]
        for name in names:
            other = self._prom_owner.get(name)
            if other is not None:
                raise ValueError(
                    f"metric tags {tag!r} and {other!r} map to the same Prometheus name {name!r}"
                )
        help_text = spec.help if spec is not None else f"{tag} ({kind})."
        exported = HISTOGRAM if kind == EPISODES else COUNTER if monotone else GAUGE
        family = Family(kind, label_names, prom, exported, help_text)
        self.families[tag] = family
        for name in names:
            self._prom_owner[name] = tag
        return family

    def drop(self, key: object) -> Series:
        """Forget one series (its family stays: a tag keeps its kind)."""
        series = self.series.pop(key)
        self._folded_owner.pop(series.folded, None)
        return series


class Episodes:
    """One episode series: histogram counts and totals (Prometheus, `snapshot`), and the
    episodes observed since they were last folded in (`pending`)."""

    __slots__ = (
        "count",
        "folded",
        "len_counts",
        "len_max",
        "len_min",
        "len_sum",
        "pending",
        "pending_n",
        "ret_counts",
        "ret_max",
        "ret_min",
        "ret_sum",
    )

    def __init__(self, returns: int, lengths: int, folded: tuple[str, ...]) -> None:
        self.ret_counts = np.zeros(returns, dtype=np.int64)
        self.len_counts = np.zeros(lengths, dtype=np.int64)
        self.count = 0
        self.ret_sum = self.len_sum = 0.0
        self.ret_min = self.len_min = float("inf")
        self.ret_max = self.len_max = float("-inf")
        self.folded = folded  # fold_tag of each of EPISODE_TAGS
        self.pending: list[tuple[np.ndarray, np.ndarray, int]] = []  # returns, lengths, step
        self.pending_n = 0

    def fold(self, return_bounds: np.ndarray, length_bounds: np.ndarray) -> list[float] | None:
        """Add the pending episodes to the totals and histograms; returns their
        [count, return sum, min, max, length sum, min, max, step], None when none were
        pending."""
        pending, self.pending, self.pending_n = self.pending, [], 0
        if not pending:
            return None
        if len(pending) == 1:
            returns, lengths, step = pending[0]
        else:
            returns = np.concatenate([p[0] for p in pending])
            lengths = np.concatenate([p[1] for p in pending])
            step = pending[-1][2]
        n = returns.size
        with np.errstate(all="ignore"):  # NaN and inf returns are data; they propagate
            r_sum, l_sum = float(returns.sum()), float(lengths.sum())
            r_min, r_max = float(returns.min()), float(returns.max())
            l_min, l_max = float(lengths.min()), float(lengths.max())
        self.ret_counts += np.bincount(
            np.searchsorted(return_bounds, returns), minlength=self.ret_counts.size
        )
        self.len_counts += np.bincount(
            np.searchsorted(length_bounds, lengths), minlength=self.len_counts.size
        )
        self.count += n
        self.ret_sum += r_sum
        self.len_sum += l_sum
        self.ret_min = min(self.ret_min, r_min)
        self.ret_max = max(self.ret_max, r_max)
        self.len_min = min(self.len_min, l_min)
        self.len_max = max(self.len_max, l_max)
        return [n, r_sum, r_min, r_max, l_sum, l_min, l_max, step]

    def totals(self) -> list[float]:
        """[count, return sum, min, max, length sum, min, max] of every folded episode."""
        return [
            self.count,
            self.ret_sum,
            self.ret_min,
            self.ret_max,
            self.len_sum,
            self.len_min,
            self.len_max,
        ]


def summary_values(acc: list[float]) -> tuple[float, ...]:
    """A window [count, return sum, min, max, length sum, min, max, step] as EPISODE_TAGS."""
    n = acc[0]
    return (n, acc[1] / n, acc[2], acc[3], acc[4] / n, acc[5], acc[6])


def histogram_rows(
    series: Series,
    histograms: tuple[tuple[str, np.ndarray, np.ndarray, float], ...],
    namespace: str,
) -> list[PromRow]:
    """The Prometheus rows of one episode series: for each ``(tag, bounds, counts, sum)``,
    cumulative bucket counts with +Inf last."""
    rows: list[PromRow] = []
    for tag, bounds, counts, total in histograms:
        spec = catalog.spec_of(tag)
        cumulative = np.cumsum(counts).tolist()
        buckets = [*zip(bounds.tolist(), cumulative[:-1]), (float("inf"), cumulative[-1])]
        rows.append(
            (
                HISTOGRAM,
                prometheus_name(tag, counter=False, namespace=namespace),
                spec.help if spec else tag,
                series.label_names,
                series.label_values,
                (buckets, total),
            )
        )
    return rows
