"""What one thread waiting for the GIL costs a Gymnasium loop (docs/performance.md, "Client
cost per small chunk").

    python bench/gil_convoy.py [--period-ms 6.7] [--rounds 6] [--switch-ms 5]

Steps a CartPole-v1 SyncVectorEnv (8 envs, no recorder) and, for contrast, a pure Python loop,
in turns: alone; beside a thread of this process that wakes every period and takes the GIL
for a moment (as the recorder's sender threads do about once a chunk); beside a process that
wakes the same way (no GIL shared). Prints each arm's work per second of the loop thread's
CPU against alone, and how often the waiting thread was woken per wake-up it asked for: a
loop that releases the GIL often (CartPole's step and reset do, numpy's Generator among
them) wakes a waiting thread at each release, loses the race to it again, and pays a futex
wake each time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import numpy as np


def voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period-ms", type=float, default=6.7)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval")
    args = parser.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    import gymnasium as gym

    period = args.period_ms / 1e3
    actions = np.random.default_rng(0).integers(0, 2, (1200, 8))

    def cartpole() -> None:
        envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 8)
        envs.reset(seed=0)
        for action in actions:
            envs.step(action)

    def python_loop() -> None:
        x = 0
        for i in range(3_000_000):
            x += i

    waking = threading.Event()
    wakes = [0]

    def waker() -> None:
        while True:
            waking.wait()
            time.sleep(period)
            wakes[0] += 1  # needs the GIL

    thread = threading.Thread(target=waker, daemon=True)
    thread.start()
    code = f"import time\nwhile True: time.sleep({period})"
    for name, work in (("CartPole SyncVectorEnv x8", cartpole), ("pure Python loop", python_loop)):
        ratios: dict[str, list[float]] = {"thread": [], "process": []}
        switches_per_wake = []
        for _ in range(args.rounds):
            t0 = time.thread_time()
            work()
            alone = time.thread_time() - t0
            wakes[0], s0 = 0, voluntary_switches(thread.native_id)
            waking.set()
            t0 = time.thread_time()
            work()
            ratios["thread"].append(alone / (time.thread_time() - t0))
            waking.clear()
            switches_per_wake.append((voluntary_switches(thread.native_id) - s0) / max(wakes[0], 1))
            other = subprocess.Popen([sys.executable, "-c", code])
            time.sleep(0.05)
            t0 = time.thread_time()
            work()
            ratios["process"].append(alone / (time.thread_time() - t0))
            other.kill()
            other.wait()
        print(
            f"{name}: loop CPU alone / beside a waking thread {statistics.median(ratios['thread']):.3f}"
            f" (its wake-ups per period {statistics.median(switches_per_wake):.1f}); "
            f"/ beside a waking process {statistics.median(ratios['process']):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
