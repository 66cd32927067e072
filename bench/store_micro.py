"""Micro-benchmark of the trajectory store: store cost per chunk's worth of finished episodes.

Workload (the ingest benchmark's): chunks of T=128 steps x N=256 envs with done probability
1/500, so ~65 episodes of ~500 steps (~32k steps) finish per chunk. Episodes look like the
synthetic env's: int32 actions in [0, 12), float32 rewards non-zero (standard normal) with
probability 2%, ``player_positions`` (L, 1, 2) int32 a reflecting random walk on a 64x64 grid,
``player_inventory`` (L, 1, 16) int32. Cell key: both position coordinates bucketed by 4
(16x16 cells); one utility (win_proximity, gamma 0.99).

Timed per chunk of episodes, on a store first warmed with ``--warm`` chunks; each timed chunk is
run ``--repeats`` times from the same state and the fastest run kept; the median over chunks of
thread CPU time (less disturbed by other processes than wall time, which is printed too):

* ``before``: the store as committed just before the batch path (``--before-ref``; sequential
  ``record_episode`` calls), loaded from ``git show`` into a private package (skipped when git
  or that revision is unavailable);
* ``after, sequential``: this tree's ``record_episode`` called once per episode;
* ``after, record (list)``: this tree's ``record`` with the chunk's episodes as a list (one
  call per chunk);
* ``after, record (EpisodeBatch)``: ``record`` with the chunk's episodes pre-concatenated;
* ``after, record (EpisodeWindow)``: ``record`` with the timed chunks' episodes read in place
  from key and reward rings (one row per episode), stored episodes deferred, as the ingest
  feeder records them (warm-up chunks go in as lists).

It also checks that every variant leaves a bit-identical checkpoint state.

    .venv/bin/python bench/store_micro.py [--chunks 40] [--warm 200]
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server import store as new_store_mod
from recorder_server.store.repository import episode_bound

ROOT = Path(__file__).resolve().parents[1]
GRID = 64
CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("player_positions", (0, 0), bucket=4, name="x"),
        CellField("player_positions", (0, 1), bucket=4, name="y"),
    ),
    utilities=(UtilityConfig("win_proximity", gamma=0.99),),
)
OUTCOMES = [EpisodeOutcome.WIN, EpisodeOutcome.LOSS, EpisodeOutcome.DRAW, EpisodeOutcome.INCOMPLETE]


def make_episode(rng: np.random.Generator, length: int, arrays_cls):
    steps = rng.integers(-1, 2, (length, 2), dtype=np.int32)
    raw = rng.integers(0, GRID, 2, dtype=np.int32) + np.cumsum(steps, axis=0, dtype=np.int32)
    folded = np.mod(raw, 2 * GRID)
    pos = np.where(folded < GRID, folded, 2 * GRID - 1 - folded).astype(np.int32)
    hit = rng.random(length) < 0.02
    rewards = np.zeros(length, np.float32)
    rewards[hit] = rng.standard_normal(int(hit.sum()), dtype=np.float32)
    gains = (rng.random((length, 16)) < 0.01).astype(np.int32)
    return arrays_cls(
        actions=rng.integers(0, 12, length, dtype=np.int32),
        rewards=rewards,
        states={
            "player_positions": pos[:, None, :].copy(),
            "player_inventory": np.cumsum(gains, axis=0, dtype=np.int32)[:, None, :],
        },
    )


def make_chunks(n: int, seed: int, arrays_cls, num_envs=256, length=128, done_prob=1 / 500):
    """``n`` chunks' worth of finished episodes: (episodes, steps, outcomes) each."""
    rng = np.random.default_rng(seed)
    chunks = []
    for c in range(n):
        count = int(rng.binomial(num_envs * length, done_prob))
        lengths = np.minimum(rng.geometric(done_prob, count), 20 * 500)
        episodes = [make_episode(rng, int(L), arrays_cls) for L in lengths]
        outcomes = [OUTCOMES[int(i)] for i in rng.integers(0, len(OUTCOMES), count)]
        chunks.append((episodes, c * num_envs * length, outcomes))
    return chunks


def baseline_ref() -> str:
    """The last commit before the batch path (server/store/batch.py) was added; HEAD when
    the batch path is not committed yet."""
    added = subprocess.run(
        ["git", "log", "-1", "--diff-filter=A", "--format=%H", "--", "server/store/batch.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return f"{added}^" if added else "HEAD"


def load_baseline_store(ref: str | None = None):
    """recorder_server.store as of ``ref`` (default :func:`baseline_ref`) as a private
    package, or None when git or that revision is unavailable, or it no longer imports
    against this tree's client package."""
    files = ["__init__", "archive", "cells", "codec", "curriculum", "repository", "store"]
    files.append("utilities")
    tmp = Path(tempfile.mkdtemp(prefix="store_baseline_"))
    pkg = tmp / "_store_baseline"
    pkg.mkdir()
    try:
        ref = ref or baseline_ref()
        for f in files:
            src = subprocess.run(
                ["git", "show", f"{ref}:server/store/{f}.py"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            ).stdout
            (pkg / f"{f}.py").write_bytes(src)
    except (OSError, subprocess.CalledProcessError):
        return None
    sys.path.insert(0, str(tmp))
    try:
        return importlib.import_module("_store_baseline")
    except ImportError as exc:
        print(f"before: skipped ({exc})")
        return None


def run_sequential(store, chunk):
    episodes, step, outcomes = chunk
    for e, o in zip(episodes, outcomes, strict=True):
        store.record_episode(e, step=step, outcome=o)


def run_record(store, chunk):
    source, step, outcomes = chunk
    store.record(source, steps=step, outcomes=outcomes)


class HeldEpisode:
    """A repository.DeferredEpisode over an episode in memory (the feeder reads its chunks)."""

    def __init__(self, episode, first: int, group: object) -> None:
        self.episode, self.first, self.group, self.length = episode, first, group, episode.length
        self.bound = episode_bound(episode)

    def fetch(self, cache: dict):
        return self.episode


def make_window(store, episodes):
    """The episodes as an EpisodeWindow over int16 key and float32 reward rings."""
    lengths = np.array([e.length for e in episodes], dtype=np.int64)
    capacity = max(int(lengths.max(initial=0)), 1)
    key_ring = np.zeros((len(store.key_names), len(episodes), capacity), dtype=np.int16)
    reward_ring = np.zeros((len(episodes), capacity), dtype=np.float32)
    for i, e in enumerate(episodes):
        key_ring[:, i, : e.length] = store.step_columns(e.states, e.length)
        reward_ring[i, : e.length] = e.rewards
    held = [HeldEpisode(e, i, episodes) for i, e in enumerate(episodes)]
    rows, start = np.arange(len(episodes)), np.zeros(len(episodes), dtype=np.int64)
    return new_store_mod.EpisodeWindow(
        key_ring, reward_ring, rows, start, lengths, held.__getitem__
    )


def measure(make_store, run, warm, timed, repeats):
    """Warm a store, then time each timed chunk ``repeats`` times from the same state (a fresh
    store loaded from a checkpoint taken just before the chunk) and keep the fastest run, which
    filters out most interference from other processes. Returns (store after all chunks,
    warm-up wall seconds per chunk, per-chunk best wall seconds, per-chunk best CPU seconds)."""
    store = make_store()
    t0 = time.perf_counter()
    for chunk in warm:
        run(store, chunk)
    t_warm = time.perf_counter() - t0
    wall, cpu = [], []
    for chunk in timed:
        before = store.checkpoint_state() if repeats > 1 else None
        best_wall = best_cpu = float("inf")
        for r in range(repeats):
            target = store
            if r < repeats - 1:
                target = make_store()
                target.load_checkpoint_state(before)
            c0, w0 = time.thread_time(), time.perf_counter()
            run(target, chunk)
            best_wall = min(best_wall, time.perf_counter() - w0)
            best_cpu = min(best_cpu, time.thread_time() - c0)
        wall.append(best_wall)
        cpu.append(best_cpu)
    return store, t_warm / max(len(warm), 1), np.array(wall), np.array(cpu)


def state_digest(store) -> dict:
    state = store.checkpoint_state()
    return {
        "counters": state["counters"],
        "arrays": {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in state["arrays"].items()},
        "metrics": store.metrics(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=40, help="timed chunks")
    parser.add_argument("--warm", type=int, default=200, help="untimed chunks recorded first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per chunk (the fastest is kept)"
    )
    parser.add_argument("--skip-before", action="store_true", help="do not time the old store")
    parser.add_argument(
        "--before-ref",
        default=None,
        help="git revision of the 'before' store (default: the commit before the batch path)",
    )
    args = parser.parse_args()

    new = new_store_mod
    chunks = make_chunks(args.warm + args.chunks, args.seed, new.EpisodeArrays)
    warm, timed = chunks[: args.warm], chunks[args.warm :]
    n_eps = np.mean([len(c[0]) for c in timed])
    n_steps = np.mean([sum(e.length for e in c[0]) for c in timed])
    print(
        f"workload: {len(timed)} timed chunks after {len(warm)} warm-up chunks; "
        f"{n_eps:.1f} episodes, {n_steps:.0f} steps per chunk"
    )

    variants = []
    head = None if args.skip_before else load_baseline_store(args.before_ref)
    if head is not None:
        old_chunks = [
            ([head.EpisodeArrays(e.actions, e.rewards, e.states) for e in eps], s, o)
            for eps, s, o in chunks
        ]
        variants.append(
            (
                "before (sequential record_episode)",
                lambda: head.TrajectoryStore(CONFIG, seed=0),
                run_sequential,
                old_chunks,
            )
        )
    variants.append(
        (
            "after, sequential record_episode",
            lambda: new.TrajectoryStore(CONFIG, seed=0),
            run_sequential,
            chunks,
        )
    )
    variants.append(
        ("after, record (list)", lambda: new.TrajectoryStore(CONFIG, seed=0), run_record, chunks)
    )
    batches = [(new.EpisodeBatch.from_episodes(e), s, o) for e, s, o in chunks]
    variants.append(
        (
            "after, record (EpisodeBatch)",
            lambda: new.TrajectoryStore(CONFIG, seed=0),
            run_record,
            batches,
        )
    )
    keyer = new.TrajectoryStore(CONFIG)
    windows = chunks[: args.warm] + [(make_window(keyer, e), s, o) for e, s, o in timed]
    variants.append(
        (
            "after, record (EpisodeWindow)",
            lambda: new.TrajectoryStore(CONFIG, seed=0),
            run_record,
            windows,
        )
    )

    digests = []
    results = {}
    for name, make_store, run, data in variants:
        store, warm_per_chunk, wall, cpu = measure(
            make_store, run, data[: args.warm], data[args.warm :], args.repeats
        )
        digests.append((name, state_digest(store)))
        med_cpu, med = np.median(cpu) * 1e3, np.median(wall) * 1e3
        results[name] = med_cpu
        print(
            f"{name:48s} {med_cpu:7.3f} ms/chunk cpu ({med:7.3f} wall; "
            f"{med_cpu / n_eps * 1e3:6.1f} us/episode; warm-up {warm_per_chunk * 1e3:7.3f} "
            f"ms/chunk wall)"
        )
    ref_name, ref = digests[0]
    for name, d in digests[1:]:
        same = d == ref
        print(f"state identical to {ref_name!r}: {name!r}: {same}")
        if not same:
            for part in ("counters", "metrics"):
                if d[part] != ref[part]:
                    print(f"  {part} differ: {d[part]} vs {ref[part]}")
            for k in ref["arrays"]:
                if d["arrays"].get(k) != ref["arrays"][k]:
                    print(f"  array {k} differs")
            raise SystemExit(1)
    names = list(results)
    if len(names) > 1:
        base = results[names[0]]
        for name in names[1:]:
            print(f"speed-up (cpu) of {name!r} over {names[0]!r}: {base / results[name]:.1f}x")


if __name__ == "__main__":
    main()
