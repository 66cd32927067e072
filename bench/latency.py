"""The record() latency scenario: the caller's time per call against a remote server (back
to back, paced, at the in-flight cap) and against the in-process reference recorder."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from chunks import STATE_FIELDS, make_pool, timed_records
from harness import (
    MB,
    Context,
    Params,
    Row,
    latency_summary,
)

# -- (a) record() latency -----------------------------------------------------


def backpressure_kwargs(block: bool) -> dict[str, Any]:
    """Block or drop at the cap, in whichever spelling this client version takes."""
    import inspect

    from recorder_client import RolloutRecorder

    params = inspect.signature(RolloutRecorder).parameters
    if "on_backpressure" in params:
        return {"on_backpressure": "block" if block else "drop"}
    return {"block_when_full": block}


def run_latency(ctx: Context, rep: int = 0) -> dict[str, Any]:
    from reference import load_reference_recorder

    from recorder_client import RolloutRecorder

    p = ctx.params
    pool = make_pool(p.pool, length=p.length, num_envs=p.num_envs, seed=1, done_prob=p.done_prob)
    chunk_bytes = pool[0].raw_bytes
    out: dict[str, Any] = {"chunk_raw_bytes": chunk_bytes}
    server = ctx.server("latency")
    try:
        uncapped = max(1 << 30, int(chunk_bytes * (p.latency_calls + 8) * 1.1))

        def remote(session: str, **kwargs: Any) -> RolloutRecorder:
            return RolloutRecorder(
                record_states=True,
                state_fields=list(STATE_FIELDS),
                target=server.address,
                session=session,
                **{"worker_id": session, **kwargs},
            )

        # Back-to-back, the cap far away: what the caller's thread pays per call.
        rec = remote("latency", max_bytes_in_flight=uncapped)
        for c in pool[:3]:  # warm-up: connection, first-chunk schema
            rec.record(c.rollout, c.states)
        rec.flush()
        t_start = time.perf_counter_ns()
        lat = timed_records(rec, pool, p.latency_calls)
        t_submitted = time.perf_counter_ns()
        rec.flush()
        t_done = time.perf_counter_ns()
        out["remote_back_to_back"] = {
            **latency_summary(lat),
            "max_bytes_in_flight": uncapped,
            "submit_s": (t_submitted - t_start) / 1e9,
            "drain_s": (t_done - t_submitted) / 1e9,
            "one_worker_raw_mb_s": chunk_bytes * p.latency_calls / MB / ((t_done - t_start) / 1e9),
        }
        # Paced: a training step (sleep, GIL released) before every call, ours and the
        # in-process recorder's in turns, call by call: both see the same load (one after
        # the other, one side could run in a quiet stretch and the other in a busy one).
        ref_cls, _ = load_reference_recorder()
        ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS))
        for c in pool[:3]:
            ref.record(c.rollout, c.states)
        ours, theirs = paced_in_turns(rec, ref, pool, p.latency_calls, p.record_step_s)
        rec.flush()
        out["remote_paced"] = {**latency_summary(ours), "sleep_s": p.record_step_s}
        out["inprocess_paced"] = {**latency_summary(theirs), "sleep_s": p.record_step_s}
        rec.close()

        # is_full and num_recorded_steps asked after each record(), as a training loop
        # does, with max_episodes set (never reached) and 3 other workers recording.
        out["counters"] = counters_latency(
            lambda name, **kw: remote("counters", **{**kw, "worker_id": name}), pool, p
        )

        # At the cap: max_bytes_in_flight of a few chunks, block (default) or drop.
        cap = chunk_bytes * p.cap_chunks
        for block in (True, False):
            name = "remote_cap_block" if block else "remote_cap_drop"
            rec = remote(
                name.replace("_", "-"), max_bytes_in_flight=cap, **backpressure_kwargs(block)
            )
            for c in pool[:2]:
                rec.record(c.rollout, c.states)
            rec.flush()
            t_start = time.perf_counter_ns()
            lat = timed_records(rec, pool, p.cap_calls)
            rec.flush()
            wall = (time.perf_counter_ns() - t_start) / 1e9
            stats = rec.stats
            out[name] = {
                **latency_summary(lat),
                "max_bytes_in_flight": cap,
                "calls": p.cap_calls,
                "dropped": stats.chunks_dropped_in_flight,
                "wall_s": wall,
            }
            rec.close()
        out["server_vm"] = server.status()
    finally:
        server.stop()

    ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS))
    for c in pool[:3]:
        ref.record(c.rollout, c.states)
    lat = timed_records(ref, pool, p.latency_calls)
    out["inprocess_back_to_back"] = latency_summary(lat)
    ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS), max_episodes=10**9)
    out["inprocess_counters"] = time_counters(ref, pool, p.paced_calls)
    return out


def paced_in_turns(
    ours: Any, theirs: Any, pool: list[Any], calls: int, step_s: float
) -> tuple[list[int], list[int]]:
    """``calls`` record() calls on each recorder, in turns, each after ``step_s`` of sleep;
    each side's nanoseconds."""
    lat: tuple[list[int], list[int]] = ([], [])
    for i in range(calls):
        c = pool[i % len(pool)]
        for rec, out in ((ours, lat[0]), (theirs, lat[1])):
            time.sleep(step_s)
            t0 = time.perf_counter_ns()
            rec.record(c.rollout, c.states)
            out.append(time.perf_counter_ns() - t0)
    return lat


def time_counters(rec: Any, pool: list[Any], calls: int, sleep_s: float = 0.0) -> dict[str, Any]:
    """is_full and num_recorded_steps, each timed right after a record()."""
    full, steps = [], []
    for i in range(calls):
        if sleep_s:
            time.sleep(sleep_s)
        c = pool[i % len(pool)]
        rec.record(c.rollout, c.states)
        t0 = time.perf_counter_ns()
        rec.is_full  # noqa: B018
        t1 = time.perf_counter_ns()
        rec.num_recorded_steps  # noqa: B018
        steps.append(time.perf_counter_ns() - t1)
        full.append(t1 - t0)
    return {"is_full": latency_summary(full), "steps": latency_summary(steps)}


def counters_latency(make: Callable[..., Any], pool: list[Any], p: Params) -> dict[str, Any]:
    """is_full / num_recorded_steps after each record(): paced (a 10 ms step) and
    back-to-back, while 3 other workers of the session record."""
    big = 10**9
    rec = make("counters-0", max_episodes=big, max_bytes_in_flight=1 << 30)
    others = [make(f"counters-{i}", max_episodes=big) for i in (1, 2, 3)]
    stop = threading.Event()

    def other(r: Any) -> None:
        i = 0
        while not stop.is_set():
            c = pool[i % len(pool)]
            r.record(c.rollout, c.states)
            i += 1
            time.sleep(p.paced_sleep_s)

    threads = [threading.Thread(target=other, args=(r,), daemon=True) for r in others]
    out: dict[str, Any] = {}
    try:
        for t in threads:
            t.start()
        out["paced"] = time_counters(rec, pool, p.paced_calls, p.paced_sleep_s)
        rec.flush()
        out["back_to_back"] = time_counters(rec, pool, p.latency_calls)
        rec.flush()
        stop.set()
        for t in threads:
            t.join()
        for r in others:
            r.flush()
        # Exact once the others' last chunks have reached this worker (an update).
        truth = rec.status().num_recorded_steps
        waited = time.perf_counter()
        while rec.num_recorded_steps != truth and time.perf_counter() - waited < 5:
            time.sleep(0.001)
        out["caught_up_s"] = time.perf_counter() - waited
        out["exact"] = rec.num_recorded_steps == truth
    finally:
        stop.set()
        for r in [rec, *others]:
            r.close()
    return out


def rows_latency(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("latency")
    if not r:
        return []
    mb = r["chunk_raw_bytes"] / MB
    ref = "factoriax in-process record()"
    rows = []
    step_ms = r["remote_paced"].get("sleep_s", 0.010) * 1e3
    for key, label in (
        ("back_to_back", "back-to-back"),
        ("paced", f"{step_ms:g} ms step between calls"),
    ):
        ours, theirs = r[f"remote_{key}"], r[f"inprocess_{key}"]
        for stat in ("p50", "p99", "max"):
            rows.append(
                Row(
                    "record() latency",
                    f"record() {stat}, {label}, {mb:.2f} MB chunk (n={ours['n']}"
                    + (
                        f"; {ours['over_200us']} calls > 200 us, {ours['over_1ms']} > 1 ms)"
                        if stat == "p99"
                        else ")"
                    ),
                    ours[f"{stat}_us"],
                    theirs[f"{stat}_us"],
                    ref,
                    "us",
                    "lower",
                )
            )
    counters, ref_counters = r.get("counters"), r.get("inprocess_counters")
    if counters and ref_counters:
        for key, label in (
            ("paced", "after each record(), 10 ms step between calls"),
            ("back_to_back", "after each back-to-back record()"),
        ):
            for field, name in (("is_full", "is_full"), ("steps", "num_recorded_steps")):
                ours = counters[key][field]
                rows.append(
                    Row(
                        "counters",
                        f"{name} p99 {label}, max_episodes set, 3 other workers recording "
                        f"(n={ours['n']}; answered in the client; exact "
                        f"{counters['caught_up_s'] * 1e3:.1f} ms after the last chunk: "
                        f"{'yes' if counters['exact'] else 'NO'})",
                        ours["p99_us"],
                        ref_counters[field]["p99_us"],
                        f"factoriax in-process {name}",
                        "us",
                        "lower",
                    )
                )
    block, drop = r["remote_cap_block"], r["remote_cap_drop"]
    cap_mb = block["max_bytes_in_flight"] / MB
    for stat in ("p50", "p99"):
        rows.append(
            Row(
                "record() latency",
                f"record() {stat} at the cap ({cap_mb:.1f} MB in flight, blocking)",
                block[f"{stat}_us"],
                r["inprocess_back_to_back"][f"{stat}_us"],
                ref,
                "us",
                "lower",
                note="the caller waits for acks; shows the drain rate, not the call cost",
            )
        )
    rows.append(
        Row(
            "record() latency",
            f"record() p99 at the cap, dropping instead of blocking "
            f"({drop['dropped']}/{drop['calls']} chunks dropped)",
            drop["p99_us"],
            r["inprocess_back_to_back"]["p99_us"],
            ref,
            "us",
            "lower",
        )
    )
    return rows
