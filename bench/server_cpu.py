"""Server CPU per chunk, measured in process (low noise): metrics on or off, all sinks, the
trajectory store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from chunks import make_pool
from harness import (
    Context,
    Row,
)

# -- server CPU per chunk, in process (low noise) -------------------------------


def run_server_cpu(ctx: Context, rep: int = 0) -> dict[str, Any]:
    """Server-side CPU per chunk of the ingest path (decode, validate, split, log, feed),
    with and without metrics / store, in this process: no network and no other process
    in the measurement, so a few percent are visible. Variants alternate in rounds."""
    import tempfile

    from chunks import STATE_FIELDS as FIELDS
    from chunks import store_configuration

    from recorder_client._messages import array_to_proto
    from recorder_client._proto import recorder_pb2 as pb
    from recorder_server.chunks import SessionConfig
    from recorder_server.metrics import MetricsConfig, MetricsTracker, NullMetrics, WriteGate
    from recorder_server.rpc.convert import chunk_from_proto
    from recorder_server.session import Session
    from recorder_server.sessions import ServiceLimits

    p = ctx.params
    pool = make_pool(p.pool, length=p.length, num_envs=p.num_envs, seed=3, done_prob=p.done_prob)
    chunks = []
    for i, c in enumerate(pool):
        # Encoded as the client encodes for this server (integer arrays packed).
        msg = pb.Chunk(sequence=i + 1)
        msg.action.CopyFrom(array_to_proto(c.rollout.action, pack=True))
        msg.reward.CopyFrom(array_to_proto(c.rollout.reward, pack=True))
        msg.done.CopyFrom(array_to_proto(c.rollout.done, pack=True))
        for name in FIELDS:
            msg.states.append(
                pb.NamedArray(name=name, array=array_to_proto(getattr(c.states, name), pack=True))
            )
        chunks.append(msg)
    capture = store_configuration()
    tmp = Path(tempfile.mkdtemp(dir=ctx.tmp))

    def variants() -> dict[str, Any]:
        sinks = MetricsConfig(
            tensorboard_dir=str(tmp / "tb"),
            jsonl_path=str(tmp / "m.jsonl"),
            tensorboard_gate=WriteGate(1.0),
            jsonl_gate=WriteGate(1.0),
        )
        return {
            "no_metrics": (NullMetrics, None),
            "metrics": (MetricsTracker, None),
            "metrics_all_sinks": (lambda: MetricsTracker(sinks), None),
            "store_on": (MetricsTracker, capture),
        }

    limits = ServiceLimits()

    def once(make_metrics, cap) -> float:
        metrics = make_metrics()
        config = SessionConfig(None, True, tuple(FIELDS), cap)
        session = Session("cpu", config, metrics)
        session.join("w", config)
        start = time.process_time()
        for msg in chunks:
            # As the servicer takes a chunk: headers checked at the edge, then the core.
            session.apply("w", chunk_from_proto(msg, limits), log=False)
        session.drain()
        # The proof that every acknowledged frame decodes is the server's work too (a
        # thread at nice 19, or the first reader): counted whole, whoever does it.
        session.verify(c for tl in session.workers.values() for c in tl.chunks)
        used = time.process_time() - start
        session.close()
        metrics.close()
        return used / len(chunks) * 1e3

    rounds = 3 if ctx.quick else 7
    ms: dict[str, list[float]] = {name: [] for name in variants()}
    for _ in range(rounds):
        for name, (make_metrics, cap) in variants().items():
            ms[name].append(once(make_metrics, cap))
    out = {name: float(np.median(v)) for name, v in ms.items()}
    out["rounds"] = {name: v for name, v in ms.items()}
    # Each variant against its base in the same round, then the median over rounds: the
    # variants of a round run a few tenths of a second apart, so a change in the machine's
    # load between rounds falls on both sides of each ratio (two medians taken apart can
    # pick rounds from a quiet and a busy stretch).
    bases = {"metrics": "no_metrics", "metrics_all_sinks": "no_metrics", "store_on": "metrics"}
    out["paired"] = {
        name: float(np.median(np.asarray(ms[name]) / np.asarray(ms[base])))
        for name, base in bases.items()
    }
    out["chunks"] = len(chunks)
    return out


def rows_server_cpu(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("server_cpu")
    if not r:
        return []
    base, off = r["no_metrics"], "same, --no-metrics"

    def ms_row(what: str, value: float, against: float, against_what: str) -> Row:
        label = f"server CPU ms per chunk, {what}"
        return Row("server CPU", label, value, against, against_what, "ms", "lower", digits=2)

    runs = len(r["rounds"]["metrics"])
    paired = r.get("paired", {})

    def per_round(name: str) -> str:
        return f"; {paired[name]:.2f}x round by round" if name in paired else ""

    return [
        ms_row(
            f"metrics on (in process, median of {runs}{per_round('metrics')})",
            r["metrics"],
            base,
            off,
        ),
        ms_row(
            "Prometheus registry + TensorBoard + JSONL sinks "
            f"(in process{per_round('metrics_all_sinks')})",
            r["metrics_all_sinks"],
            base,
            off,
        ),
        ms_row(
            f"trajectory store on (2 cell fields, 1 utility{per_round('store_on')})",
            r["store_on"],
            r["metrics"],
            "same, store off",
        ),
    ]
