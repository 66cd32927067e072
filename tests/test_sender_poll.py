"""The sender that polls instead of sleeping until record() wakes it (client/_poll.py): one
a process, only while chunks come often, and every chunk still reaches the server."""

from __future__ import annotations

import time

import numpy as np
from conftest import wait_for

from recorder_client import RolloutRecorder


def chunk(rng, T=8, N=4):
    return {
        "action": rng.integers(0, 12, (T, N)).astype(np.int32),
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "done": rng.random((T, N)) < 0.1,
    }


def test_one_sender_a_process_polls_while_chunks_come_often_and_every_chunk_arrives(target):
    rng = np.random.default_rng(0)
    recs = [RolloutRecorder(target=target, session="poll", worker_id=f"w{i}") for i in (0, 1)]
    try:
        senders = [r._sender for r in recs]
        polled = [False, False]
        sent = []
        for i in range(60):
            time.sleep(0.002)  # a short training step: chunks come far under 20 ms apart
            for rec in recs:
                c = chunk(rng)
                rec.record(c)
                sent.append(c)
            polling = [s._polling for s in senders]
            assert sum(polling) <= 1, f"call {i}: both senders poll"
            polled = [a or b for a, b in zip(polled, polling, strict=True)]
        assert any(polled), "no sender polled while chunks came 2 ms apart"
        for rec in recs:
            rec.flush(timeout=30)
        assert sum(r.stats.chunks_acked for r in recs) == len(sent) == 120
        assert recs[0].status().num_recorded_steps == 8 * len(sent)  # T=8 steps a chunk
        # Quiet: the poller gives the slot back and sleeps until woken again.
        assert wait_for(lambda: not any(s._polling for s in senders), timeout=5)
        assert all(s._sleeping for s in senders)
        # Woken by record() once more (not polling), the next chunk still goes out at once.
        began = time.monotonic()
        recs[1].record(chunk(rng))
        recs[1].flush(timeout=30)
        assert time.monotonic() - began < 5
        assert recs[1].stats.chunks_acked == 61
    finally:
        for rec in recs:
            rec.close()
