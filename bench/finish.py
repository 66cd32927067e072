"""The finish() scenario: collect >= 20k episodes from a server and check them against the
in-process reference recorder."""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import numpy as np
from chunks import STATE_FIELDS, make_pool
from harness import (
    MB,
    Context,
    Row,
    session_status,
)
from procs import (
    machine_snapshot,
    machine_window,
)

# -- (d) finish() ---------------------------------------------------------------


def run_finish(ctx: Context, rep: int = 0) -> dict[str, Any]:
    from reference import load_reference_recorder

    from recorder_client import RolloutRecorder

    p = ctx.params
    per_chunk = p.length * p.num_envs * p.finish_done_prob
    n_chunks = math.ceil(p.finish_episodes / per_chunk * 1.03)
    pool = make_pool(
        n_chunks, length=p.length, num_envs=p.num_envs, seed=7, done_prob=p.finish_done_prob
    )
    raw = sum(c.raw_bytes for c in pool)
    dones = int(sum(int(c.rollout.done.sum()) for c in pool))
    out: dict[str, Any] = {"chunks": n_chunks, "raw_bytes": raw, "done_flags": dones}
    calls = ctx.params.finish_calls
    ref_cls, _ = load_reference_recorder()
    ref = ref_cls(record_states=True, state_fields=list(STATE_FIELDS))
    for c in pool:
        ref.record(c.rollout, c.states)
    server = ctx.server("finish")
    try:
        rec = RolloutRecorder(
            record_states=True,
            state_fields=list(STATE_FIELDS),
            target=server.address,
            session="finish",
            worker_id="finish",
            max_bytes_in_flight=max(1 << 30, int(raw * 1.1)),
        )
        for c in pool:
            rec.record(c.rollout, c.states)
        rec.flush()
        out["server_vm_before"] = server.status()
        # Equality first, once, untimed; then only the timed calls, each result freed
        # before the next call so neither side pays for the other's 1 GB of arrays.
        ours, theirs = rec.finish(), ref.finish()
        check = compare_results(ours, theirs)
        del ours, theirs
        gc.collect()
        # Remote and in-process calls alternate, so both see the same background load.
        remote_s: list[float] = []
        inprocess_s: list[float] = []
        busy: list[dict[str, float]] = []
        for _ in range(calls):
            for side, times in (("remote", remote_s), ("inprocess", inprocess_s)):
                cpu0 = machine_snapshot()
                t0 = time.perf_counter_ns()
                got = rec.finish() if side == "remote" else ref.finish()
                times.append((time.perf_counter_ns() - t0) / 1e9)
                busy.append({"side": side, **machine_window(cpu0, machine_snapshot(), times[-1])})
                del got
                gc.collect()
        out["server_vm_after"] = server.status()
        out["status"] = session_status(server.address, "finish")
        rec.close()
    finally:
        server.stop()
    out["remote_runs_s"] = remote_s
    out["inprocess_runs_s"] = inprocess_s
    out["machine"] = busy
    out["remote_s"] = float(np.median(remote_s))
    out["inprocess_s"] = float(np.median(inprocess_s))
    out.update(check)
    del ref
    gc.collect()
    return out


def compare_results(ours: Any, theirs: Any) -> dict[str, Any]:
    """Equality of the remote and in-process results, field by field."""
    from reference import reference_arrays

    ref_fields = reference_arrays(theirs)
    our_fields = ours.fields
    mismatches = []
    if set(ref_fields) != set(our_fields):
        mismatches.append(f"fields {sorted(our_fields)} vs {sorted(ref_fields)}")
    for key in sorted(set(ref_fields) & set(our_fields)):
        a, b = our_fields[key], ref_fields[key]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            mismatches.append(f"{key}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
    return {
        "matched": not mismatches,
        "mismatches": mismatches,
        "episodes": int(ours.num_episodes),
        "max_length": int(ours.max_length),
        "result_bytes": int(sum(a.nbytes for a in our_fields.values())),
    }


def rows_finish(results: dict[str, dict[str, Any]]) -> list[Row]:
    r = results.get("finish")
    if not r:
        return []
    return [
        Row(
            "finish()",
            f"finish() s (median of {len(r['remote_runs_s'])}), {r['episodes']:,} episodes "
            f"x T_max {r['max_length']} "
            f"({r['result_bytes'] / MB:.0f} MB result; equal: {'yes' if r['matched'] else 'NO'})",
            r["remote_s"],
            r["inprocess_s"],
            "factoriax in-process finish()",
            "s",
            "lower",
            digits=2,
        )
    ]
