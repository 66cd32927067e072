"""A trainer process of the cluster harness: records chunks to a sidecar at a steady pace and
keeps its own truth, as JSON lines appended (and flushed) to a file as things happen:

- ``{"chunk": i, "kept": bool, "t": unix, "took": s}`` after each ``record()`` (kept False:
  dropped at the in-flight cap; ``took``: how long the call held);
- ``{"acked": n, "t": unix}`` whenever the count of acknowledged chunks grows (a lower bound:
  a resend the server already held is acknowledged by the rejoin, not counted by the stats);
- ``{"stream_ended": reason, "t": unix}`` when the recorder's stream fails (a reconnect
  follows);
- ``{"ready": true, "t": unix}`` once joined; it then waits for the ``--go`` file;
- ``{"end": true, "dropped": n, "t": unix}`` once every kept chunk is acknowledged.

Every chunk is a function of (seed, index) (`chunk`), so the harness recomputes what was sent;
an episode is named by (worker, env, start step, length, reward bytes), as the dataset has it.

Run: python tests/cluster/trainer.py --target HOST:PORT --worker ID --seed N --truth FILE ...
(the token from ROLLOUT_RECORDER_TOKEN_FILE).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path

import numpy as np

T, N = 16, 2
DONE_P = 0.05


def capture_config():
    """The sessions' trajectory store: cells of 4x4 positions, one utility."""
    from recorder_server.workload import position_store

    return position_store(gamma=0.9)


def chunk(seed: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Chunk ``index`` of the trainer seeded ``seed``: the same arrays on every call."""
    rng = np.random.default_rng([seed, index])
    arrays = {
        "action": rng.integers(0, 16, (T, N)),
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "done": rng.random((T, N)) < DONE_P,
    }
    states = {"player_positions": rng.integers(0, 32, (T, N, 1, 2)).astype(np.int32)}
    return arrays, states


class _Truth:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed at exit
        self._lock = threading.Lock()

    def write(self, **entry) -> None:
        entry["t"] = time.time()
        with self._lock:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()


class _StreamEnded(logging.Handler):
    def __init__(self, truth: _Truth) -> None:
        super().__init__(logging.INFO)
        self.truth = truth

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("stream to "):
            self.truth.write(stream_ended=message)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--session", default="run")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument(
        "--go",
        required=True,
        help="a file to wait for once joined; it holds the unix time to record until",
    )
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between chunks")
    parser.add_argument("--on-backpressure", default="block")
    parser.add_argument("--max-bytes-in-flight", type=int, default=256 << 20)
    parser.add_argument("--keepalive", type=float, default=10.0)
    parser.add_argument("--reconnect-timeout", type=float, default=60.0)
    args = parser.parse_args()

    from recorder_client import RolloutRecorder

    truth = _Truth(args.truth)
    logger = logging.getLogger("recorder_client._stream")
    logger.setLevel(logging.INFO)
    logger.addHandler(_StreamEnded(truth))
    rec = RolloutRecorder(
        record_states=True,
        state_fields=("player_positions",),
        capture=capture_config(),
        target=args.target,
        session=args.session,
        worker_id=args.worker,
        on_backpressure=args.on_backpressure,
        max_bytes_in_flight=args.max_bytes_in_flight,
        keepalive_seconds=args.keepalive,
        reconnect_timeout=args.reconnect_timeout,
    )
    stop = threading.Event()

    def watch_acks() -> None:
        seen = 0
        while not stop.wait(0.02):
            acked = rec.stats.chunks_acked
            if acked > seen:
                seen = acked
                truth.write(acked=acked)

    watcher = threading.Thread(target=watch_acks, daemon=True)
    watcher.start()
    truth.write(ready=True)
    go = Path(args.go)
    while not go.exists():
        time.sleep(0.05)
    end = float(go.read_text())
    index = 0
    while time.time() < end:
        arrays, states = chunk(args.seed, index)
        start = time.monotonic()
        kept = rec.record(arrays, states)
        truth.write(chunk=index, kept=bool(kept), took=time.monotonic() - start)
        index += 1
        time.sleep(max(0.0, args.interval - (time.monotonic() - start)))
    rec.flush()  # returns once the server holds every kept chunk: all acknowledged
    stop.set()
    watcher.join()
    truth.write(acked=index - rec.dropped_chunks)
    truth.write(end=True, dropped=rec.dropped_chunks)
    rec.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
