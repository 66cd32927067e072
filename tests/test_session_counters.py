"""A join and a client's counters refresh read the session's counters alone: their replies
do not list the session's workers, so they cost the same however many joined before (a
fleet whose actors come and go for weeks joins thousands of worker ids); GetStatus without
counters_only still lists every worker."""

from __future__ import annotations

import time

import grpc
import numpy as np

from recorder_client import RolloutRecorder
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc

WORKERS = 150
# A RolloutRecorder's default configuration (a join must ask for the session's).
CONFIG = pb.SessionConfig(state_fields=["player_positions", "player_inventory"])


def test_join_and_counters_replies_do_not_grow_with_the_workers(target):
    chunk = {
        "action": np.zeros((5, 2), np.int32),
        "reward": np.ones((5, 2), np.float32),
        "done": np.zeros((5, 2), bool),
    }
    chunk["done"][4] = True  # two episodes, 10 steps
    with RolloutRecorder(target=target, session="fleet", worker_id="writer") as rec:
        rec.record(chunk)
        rec.flush()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        sizes = []
        for i in range(WORKERS):
            reply = stub.Join(
                pb.JoinRequest(session="fleet", config=CONFIG, worker_id=f"a{i}"),
                timeout=30,
            )
            assert len(reply.status.workers) == 0
            assert (reply.status.num_recorded_steps, reply.status.episodes_finished) == (5, 2)
            sizes.append(reply.status.ByteSize())
        # Counters and a version: the same few bytes for the first join and the last.
        assert max(sizes) - min(sizes) <= 2, sizes

        full = stub.GetStatus(pb.StatusRequest(session="fleet"), timeout=30)
        assert len(full.workers) == WORKERS + 1
        assert sorted(w.worker_id for w in full.workers) == sorted(
            ["writer", *(f"a{i}" for i in range(WORKERS))]
        )
        counters = stub.GetStatus(pb.StatusRequest(session="fleet", counters_only=True), timeout=30)
        assert len(counters.workers) == 0 and counters.session == "fleet"
        assert (counters.is_full, counters.num_recorded_steps, counters.episodes_finished) == (
            full.is_full,
            full.num_recorded_steps,
            full.episodes_finished,
        )
        assert counters.counters_version == full.counters_version > 0  # nothing recorded between


def test_an_idle_recorder_hears_other_workers_counters(target):
    """The counters refresh (GetStatus with counters_only) still brings other workers'
    steps to a recorder with nothing in flight."""
    chunk = {
        "action": np.zeros((4, 3), np.int32),
        "reward": np.zeros((4, 3), np.float32),
        "done": np.zeros((4, 3), bool),
    }
    with (
        RolloutRecorder(target=target, session="heard", worker_id="idle") as idle,
        RolloutRecorder(target=target, session="heard", worker_id="busy") as busy,
    ):
        assert idle.num_recorded_steps == 0
        for _ in range(3):
            busy.record(chunk)
        busy.flush()
        # The idle recorder asks in the background once its counters are stale (20 ms).
        deadline = time.monotonic() + 10
        while idle.num_recorded_steps != 12 and time.monotonic() < deadline:
            time.sleep(0.03)
        assert idle.num_recorded_steps == 12
