"""Many sidecars, one run: three `serve` processes (one per node, each with its own data
directory and node id), two workers each, all writing one S3 dataset. Every episode comes
back exactly once, and Ray Data reads the same number of steps."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
from conftest import ServerProcess
from test_dataset import episodes_of, record, sent_episodes

from recorder_client import RolloutRecorder
from recorder_client.dataset import episode_files, filesystem, read_episodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIDECARS, WORKERS, CHUNKS = 3, 2, 30


def test_three_sidecars_write_one_dataset_that_reads_back_whole(tmp_path: Path, s3):
    uri = f"{s3.make_bucket('cluster-run')}/episodes"
    sidecars = [
        ServerProcess(
            tmp_path / f"node{k}",
            "--dataset-uri",
            uri,
            "--node-id",
            f"node{k}",
            "--dataset-flush-seconds",
            "0.5",
        )
        for k in range(SIDECARS)
    ]
    try:
        recs = []
        for k, sidecar in enumerate(sidecars):
            for j in range(WORKERS):
                w = k * WORKERS + j
                recs.append(
                    (
                        w,
                        RolloutRecorder(
                            record_states=True,
                            target=sidecar.address,
                            session="run",
                            worker_id=f"w{w}",
                        ),
                    )
                )
        threads = [threading.Thread(target=record, args=(rec, w, range(CHUNKS))) for w, rec in recs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _, rec in recs:
            rec.close()
    finally:
        for sidecar in sidecars:
            assert sidecar.stop() == 0  # SIGTERM: each writes what it has left

    sent = sum((sent_episodes(w, CHUNKS) for w in range(SIDECARS * WORKERS)), Counter())
    got = read_episodes(uri, "run")
    assert episodes_of(got) == sent  # every episode, exactly once
    assert list(got.worker_ids) == [f"w{w}" for w in range(SIDECARS * WORKERS)]
    nodes = read_episodes(uri, "run", nodes=["node1"])
    assert set(nodes.worker_ids) == {"w2", "w3"}

    import ray

    fs, root = filesystem(uri)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        steps = ray.data.read_parquet(episode_files(fs, root), filesystem=fs).count()
    finally:
        ray.shutdown()
    assert steps == int(got.lengths.sum()) == sum(key[3] * n for key, n in sent.items())
