"""Feeder cost per chunk with and without a trajectory store (bench workload).

Usage: .venv/bin/python bench/store_ingest_profile.py [--workers 4] [--chunks 80] [--feeder PATH]
                                                       [--decoded] [--profile] [--batch K]
Runs Session.apply over each worker's chunks (T=128, N=256; the workers' chunks interleaved
and seeded as in the ingest row) with the feeder's queue intercepted, then times
EpisodeFeeder._process_batch per chunk (best of 3 passes over fresh sessions); `--batch K` hands
the feeder K chunks at a time, as its thread does when that many are queued.
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


def make_chunks(count: int = 80, workers: int = 4) -> list[tuple[str, pb.Chunk]]:
    """(worker, chunk) in round-robin order; worker i's pool is seeded like bench worker i."""
    # Distinct chunks: a reused done pattern would leave some episodes open forever.
    pools = [make_pool(count, seed=1000 + w) for w in range(workers)]
    chunks = []
    for i in range(count * workers):
        c = pools[i % workers][i // workers]
        ch = pb.Chunk(sequence=i // workers + 1)
        ch.action.CopyFrom(codec.encode_array(c.rollout.action))
        ch.reward.CopyFrom(codec.encode_array(c.rollout.reward))
        ch.done.CopyFrom(codec.encode_array(c.rollout.done))
        for n in STATES:
            ch.states.append(pb.NamedArray(name=n, array=codec.encode_array(getattr(c.states, n))))
        chunks.append((f"w{i % workers}", ch))
    return chunks


def run(chunks, capture, feeder_cls, decoded: bool, profile: bool, batch: int = 1):
    s = Session("b", SessionConfig(None, True, STATES, capture), MetricsTracker())
    for name in dict(chunks):
        s.join(name, s.config)
    s.feeder.close()
    f = feeder_cls("b", s.processor, s.metrics)
    f.close()
    items = []
    queue = {"submit": staticmethod(items.append), "close": lambda self: None, "alloc": f.alloc}
    s.feeder = type("Q", (), queue)()
    for name, ch in chunks:
        s.apply(name, ch, 1 << 31)
    if decoded:  # as a caller without the session's chunks: held decoded, fetched at once
        for item in items:
            item.stored = None
    pr = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if pr:
        pr.enable()
    for i in range(0, len(items), batch):
        f._process_batch(items[i : i + batch])
    if pr:
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)
    return (time.perf_counter() - t) / len(items) * 1e3, s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=80, help="chunks per worker")
    ap.add_argument("--feeder", help="load EpisodeFeeder from this file instead")
    ap.add_argument(
        "--decoded",
        action="store_true",
        help="hand the feeder decoded arrays only (no StoredChunk): the held-arrays path",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--batch", type=int, default=1, help="chunks per feeder call")
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
    chunks = make_chunks(args.chunks, args.workers)
    for capture in (None, CAPTURE):
        best = min(
            run(chunks, capture, feeder_cls, args.decoded, False, args.batch)[0] for _ in range(3)
        )
        print(f"store {'on ' if capture else 'off'}: feeder {best:.2f} ms per chunk")
    if args.profile:
        run(chunks, CAPTURE, feeder_cls, args.decoded, True, args.batch)


if __name__ == "__main__":
    main()
