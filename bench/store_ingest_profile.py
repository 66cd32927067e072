"""Feeder cost per chunk with and without a trajectory store (bench workload).

Usage: .venv/bin/python bench/store_ingest_profile.py [--feeder PATH] [--encoded] [--profile]
Runs Session.apply over 80 chunks (T=128, N=256) with the feeder's queue intercepted, then
times EpisodeFeeder._process per chunk (best of 3 passes over fresh sessions).
"""

import argparse
import cProfile
import importlib.util
import pstats
import sys
import time

sys.path.insert(0, "bench")
from workload import make_pool, store_configuration  # noqa: E402

from recorder_client import codec  # noqa: E402
from recorder_client._proto import recorder_pb2 as pb  # noqa: E402
from recorder_server.metrics import MetricsTracker  # noqa: E402
from recorder_server.session import Session, SessionConfig  # noqa: E402

CAPTURE = store_configuration()
STATES = ("player_positions", "player_inventory")


def make_chunks(count: int = 80) -> list:
    # Distinct chunks: a reused done pattern would leave some episodes open forever.
    pool = make_pool(count, seed=1)
    chunks = []
    for i in range(count):
        c = pool[i]
        ch = pb.Chunk(sequence=i + 1)
        ch.action.CopyFrom(codec.encode_array(c.rollout.action))
        ch.reward.CopyFrom(codec.encode_array(c.rollout.reward))
        ch.done.CopyFrom(codec.encode_array(c.rollout.done))
        for n in STATES:
            ch.states.append(pb.NamedArray(name=n, array=codec.encode_array(getattr(c.states, n))))
        chunks.append(ch)
    return chunks


def run(chunks, capture, feeder_cls, encoded: bool, profile: bool):
    s = Session("b", SessionConfig(None, True, STATES, capture), MetricsTracker())
    s.join("w", s.config)
    s.feeder.close()
    f = feeder_cls("b", s.processor, s.metrics)
    f.close()
    items = []
    s.feeder = type("Q", (), {"submit": staticmethod(items.append), "close": lambda self: None})()
    for ch in chunks:
        s.apply("w", ch, 1 << 31)
    if encoded:
        timeline = next(iter(s.workers.values()))
        for item, stored in zip(items, timeline.chunks, strict=True):
            item.stored = stored
    pr = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if pr:
        pr.enable()
    for it in items:
        f._process(it)
    if pr:
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)
    return (time.perf_counter() - t) / len(items) * 1e3, s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--feeder", help="load EpisodeFeeder from this file instead")
    ap.add_argument("--encoded", action="store_true", help="hand the feeder StoredChunks")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.feeder:
        spec = importlib.util.spec_from_file_location("recorder_server._feeder_alt", args.feeder)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "recorder_server"
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        feeder_cls = mod.EpisodeFeeder
    else:
        from recorder_server.feeder import EpisodeFeeder as feeder_cls
    chunks = make_chunks()
    for capture in (None, CAPTURE):
        best = min(run(chunks, capture, feeder_cls, args.encoded, False)[0] for _ in range(3))
        print(f"store {'on ' if capture else 'off'}: feeder {best:.2f} ms per chunk")
    if args.profile:
        run(chunks, CAPTURE, feeder_cls, args.encoded, True)


if __name__ == "__main__":
    main()
