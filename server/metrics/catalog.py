"""Every metric the server emits: its tag, kind, help text and labels, in one table.

The tracker reads the kind (a monotone total is exported to Prometheus as a counter even when
it is logged as a stepped value) and the help text from here; `docs/metrics.md` is generated
from it (`python -m recorder_server.metrics.catalog > docs/metrics.md`) and a test keeps the
two equal. A tag of the form ``Prefix/<name>`` in the table matches any one name there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .names import prometheus_name

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
EPISODES = "episode summary"


@dataclass(frozen=True)
class MetricSpec:
    tag: str
    """The TensorBoard-style tag; ``<name>`` matches one path segment."""
    kind: str
    """counter (a monotone total), gauge (a level), histogram, or episode summary."""
    help: str
    """What it measures, with its unit."""
    labels: tuple[str, ...] = ("session",)


_S = ("session",)
_SW = ("session", "worker")

CATALOG: tuple[MetricSpec, ...] = (
    # -- ingest
    MetricSpec("Recorder/chunks", COUNTER, "Chunks stored."),
    MetricSpec("Recorder/raw_bytes", COUNTER, "Uncompressed bytes of stored chunks."),
    MetricSpec("Recorder/wire_bytes", COUNTER, "Compressed (wire) bytes of stored chunks."),
    MetricSpec("Recorder/steps", COUNTER, "Time steps of stored chunks (T summed over chunks)."),
    MetricSpec("Recorder/env_steps", COUNTER, "Environment steps of stored chunks (T x N)."),
    MetricSpec("Recorder/chunks_dropped_full", COUNTER, "Chunks dropped: max_episodes reached."),
    MetricSpec("Recorder/chunks_rejected", COUNTER, "Chunks refused as invalid."),
    MetricSpec(
        "Recorder/chunks_corrupt",
        COUNTER,
        "Acknowledged chunks with an action or state frame found not to decode after the "
        "ack (it was checked from its headers); the field reads as zeros.",
    ),
    MetricSpec(
        "Recorder/chunks_refused_no_space", COUNTER, "Chunks refused: the data directory is full."
    ),
    MetricSpec("Recorder/sequences_lost", COUNTER, "Acknowledged chunks lost (e.g. power cut)."),
    MetricSpec("Recorder/feed_errors", COUNTER, "Chunks whose episodes could not be processed."),
    MetricSpec(
        "Recorder/episodes_too_long_for_store",
        COUNTER,
        "Episodes longer than the held tail allows, not given to the store.",
    ),
    MetricSpec("Recorder/episodes_finished", COUNTER, "Episodes finished (done flags)."),
    MetricSpec(
        "Recorder/ack_latency_seconds", GAUGE, "Seconds the latest chunk took to be taken.", _SW
    ),
    # The next three are measured at each Prometheus scrape and each `status` call.
    MetricSpec(
        "Recorder/worker_lag_seconds",
        GAUGE,
        "Seconds since the worker last joined or sent (measured when scraped or asked for).",
        _SW,
    ),
    MetricSpec(
        "Recorder/held_wire_bytes",
        GAUGE,
        "Wire bytes of the chunks the session holds (measured when scraped or asked for).",
    ),
    MetricSpec(
        "Recorder/chunks_unverified",
        GAUGE,
        "Acknowledged chunks whose action and state frames are not yet proved to decode "
        "(measured when scraped or asked for).",
    ),
    # -- dataset sink (serve --dataset-uri)
    MetricSpec("Recorder/dataset_files_written", COUNTER, "Episode files written whole."),
    MetricSpec("Recorder/dataset_episodes_written", COUNTER, "Episodes written to the dataset."),
    MetricSpec("Recorder/dataset_steps_written", COUNTER, "Steps (rows) written to the dataset."),
    MetricSpec("Recorder/dataset_bytes_written", COUNTER, "Parquet bytes written to the dataset."),
    MetricSpec(
        "Recorder/dataset_write_failures",
        COUNTER,
        "Dataset writes that failed (each retried with backoff; nothing is lost).",
    ),
    MetricSpec(
        "Recorder/dataset_pending_episodes",
        GAUGE,
        "Finished episodes not yet in the dataset, after the latest flush.",
    ),
    MetricSpec(
        "Recorder/dataset_lag_seconds",
        GAUGE,
        "Age of the oldest finished episode not yet in the dataset (0: all written); "
        "measured by the sink at least once a second.",
    ),
    # -- episodes
    MetricSpec(
        "Episode/return",
        HISTOGRAM,
        "Episode return (sum of rewards); buckets from --metrics-return-buckets.",
    ),
    MetricSpec(
        "Episode/length",
        HISTOGRAM,
        "Episode length in steps; buckets from --metrics-length-buckets.",
    ),
    MetricSpec("Episode/count", EPISODES, "Episodes finished since the previous point."),
    MetricSpec(
        "Episode/return_mean", EPISODES, "Mean return of the episodes since the previous point."
    ),
    MetricSpec(
        "Episode/return_min", EPISODES, "Lowest return of the episodes since the previous point."
    ),
    MetricSpec(
        "Episode/return_max", EPISODES, "Highest return of the episodes since the previous point."
    ),
    MetricSpec(
        "Episode/length_mean", EPISODES, "Mean length of the episodes since the previous point."
    ),
    MetricSpec("Episode/length_min", EPISODES, "Shortest episode since the previous point."),
    MetricSpec("Episode/length_max", EPISODES, "Longest episode since the previous point."),
    # -- capture (with or without a store)
    MetricSpec(
        "Trajectories/episodes_captured", COUNTER, "Episodes given to the capture processor."
    ),
    MetricSpec("Trajectories/steps_captured", COUNTER, "Steps of those episodes."),
    MetricSpec(
        "Trajectories/midpoint_start_episodes", COUNTER, "Captured episodes started from a cell."
    ),
    MetricSpec(
        "Trajectories/outcome_<name>",
        COUNTER,
        "Captured episodes by outcome (unknown, win, loss, draw, incomplete).",
    ),
    MetricSpec("Trajectories/store_enabled", GAUGE, "1 when the session has a trajectory store."),
    # -- store
    MetricSpec("Trajectories/archive_cells", GAUGE, "Cells in the archive."),
    MetricSpec(
        "Trajectories/archive_new_cells_last_episode",
        GAUGE,
        "Cells first seen in the last episode.",
    ),
    MetricSpec(
        "Trajectories/archive_improved_cells_last_episode",
        GAUGE,
        "Cells whose best reference moved to the last episode.",
    ),
    MetricSpec("Trajectories/store_episodes", COUNTER, "Episodes recorded into the store."),
    MetricSpec("Trajectories/store_steps", COUNTER, "Steps recorded into the store."),
    MetricSpec("Trajectories/curriculum_starts", COUNTER, "Starts handed out by sample_start."),
    MetricSpec(
        "Trajectories/curriculum_midpoint_starts", COUNTER, "Episodes recorded from a start."
    ),
    MetricSpec(
        "Trajectories/curriculum_midpoint_start_cells", GAUGE, "Cells that episodes started from."
    ),
    MetricSpec(
        "Trajectories/curriculum_unresolved_midpoint_starts",
        COUNTER,
        "Episodes from a start whose cell could not be found.",
    ),
    MetricSpec(
        "Trajectories/curriculum_start_entropy", GAUGE, "Entropy (nats) of the start distribution."
    ),
    MetricSpec("Trajectories/repository_trajectories", GAUGE, "Trajectories stored."),
    MetricSpec(
        "Trajectories/repository_unreferenced", GAUGE, "Stored trajectories no cell references."
    ),
    MetricSpec("Trajectories/repository_bytes", GAUGE, "Compressed bytes of stored trajectories."),
    MetricSpec(
        "Trajectories/repository_deferred", GAUGE, "Stored trajectories still read from chunks."
    ),
    MetricSpec("Trajectories/repository_capacity_bytes", GAUGE, "The repository's byte cap."),
    MetricSpec("Trajectories/repository_over_capacity", GAUGE, "1 while over the byte cap."),
    MetricSpec("Trajectories/repository_evictions", COUNTER, "Trajectories evicted for space."),
    MetricSpec(
        "Trajectories/repository_discarded", COUNTER, "Episodes not kept (no cell improved)."
    ),
    MetricSpec("Trajectories/utility/<name>/mean", GAUGE, "A utility's mean net value over cells."),
    MetricSpec("Trajectories/utility/<name>/max", GAUGE, "A utility's highest net value."),
)

_EXACT = {spec.tag: spec for spec in CATALOG if "<name>" not in spec.tag}
_PATTERNS = [
    (re.compile("^" + re.escape(spec.tag).replace(re.escape("<name>"), "[^/]+") + "$"), spec)
    for spec in CATALOG
    if "<name>" in spec.tag
]


def spec_of(tag: str) -> MetricSpec | None:
    """The catalog entry of a tag, or None for a tag outside the catalog."""
    spec = _EXACT.get(tag)
    if spec is not None:
        return spec
    for pattern, spec in _PATTERNS:
        if pattern.match(tag):
            return spec
    return None


_SLOT = "placeholderslot"


def markdown(namespace: str = "rollout_recorder") -> str:
    """The metrics table (docs/metrics.md)."""
    lines = [
        "# Metrics",
        "",
        "Generated from `server/metrics/catalog.py` "
        "(`python -m recorder_server.metrics.catalog > docs/metrics.md`).",
        "Every metric carries a `session` label; TensorBoard writes one run directory per",
        "session (`<--tensorboard-dir>/<session>/`), with the same tags in each. Episode",
        "summaries are written to TensorBoard and JSON lines only; Prometheus gets the",
        "histograms.",
        "",
        "| Tag (TensorBoard, JSON lines) | Prometheus | Kind | Labels | Meaning |",
        "|---|---|---|---|---|",
    ]
    for spec in CATALOG:
        if spec.kind == EPISODES:
            prom = "-"
        else:
            # A placeholder stays one in the name: outcome_<name>_total, not outcome_name_total.
            tag = spec.tag.replace("<name>", _SLOT)
            name = prometheus_name(tag, counter=spec.kind == COUNTER, namespace=namespace)
            name = name.replace(_SLOT, "<name>")
            if spec.kind == HISTOGRAM:
                name += "_bucket, _sum, _count"
            prom = f"`{name}`"
        labels = ", ".join(spec.labels)
        lines.append(f"| `{spec.tag}` | {prom} | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
