"""Metrics from a running server: Prometheus, TensorBoard, the status command."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from recorder_client import RolloutRecorder
from recorder_client._proto import recorder_pb2 as pb
from recorder_server import ServerOptions, start_server
from recorder_server.metrics import MetricsConfig, WriteGate


def chunk(rng, T=10, N=3, p=0.2):
    return {
        "action": rng.integers(0, 12, (T, N)).astype(np.int32),
        "reward": rng.random((T, N)).astype(np.float32),
        "done": rng.random((T, N)) < p,
    }


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture
def metrics_server(tmp_path):
    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            metrics_listen="127.0.0.1:0",
            metrics=MetricsConfig(
                tensorboard_dir=str(tmp_path / "tb"), tensorboard_gate=WriteGate(0, 0)
            ),
        )
    )
    yield running
    running.stop(grace=0)


def test_prometheus_counters_match_what_was_sent_during_streaming(metrics_server):
    rng = np.random.default_rng(0)
    sent_raw = sent_steps = sent_dones = 0
    label = (("session", "prom"),)
    with RolloutRecorder(target=metrics_server.address, session="prom") as rec:
        for i in range(12):
            c = chunk(rng)
            rec.record(c)
            sent_raw += c["action"].nbytes + c["reward"].nbytes + c["done"].nbytes
            sent_steps += 10
            sent_dones += int(c["done"].sum())
            if i % 4 == 3:  # scrape while the stream is open
                rec.flush()
                rec.capture.sample_start()  # waits until the episode feed caught up
                samples = scrape(metrics_server.metrics_address)
                assert samples[("rollout_recorder_chunks_total", label)] == i + 1
                assert samples[("rollout_recorder_raw_bytes_total", label)] == sent_raw
                assert samples[("rollout_recorder_steps_total", label)] == sent_steps
                assert samples[("rollout_recorder_episodes_finished_total", label)] == sent_dones
                wire = samples[("rollout_recorder_wire_bytes_total", label)]
                assert 0 < wire < sent_raw + 200 * (i + 1)
        assert rec.stats.raw_bytes == sent_raw


def test_capture_counters_advance_at_every_boundary_with_the_store_off(target):
    """The seed's log_metrics note: no store must not mean dark Trajectories/* metrics."""
    rng = np.random.default_rng(1)
    import grpc

    from recorder_client._proto import recorder_pb2_grpc as pb_grpc

    stub = pb_grpc.RecorderStub(grpc.insecure_channel(target))
    dones = steps = 0
    with RolloutRecorder(target=target, session="dark") as rec:
        assert rec.capture_config is None
        for _ in range(6):
            c = chunk(rng, p=0.3)
            rec.record(c)
            dones += int(c["done"].sum())
            steps_in = c["done"]
            rec.flush()
            rec.capture.sample_start()  # drains the episode feed
            values = stub.GetMetrics(pb.MetricsRequest()).values
            assert values["Trajectories/episodes_captured/session=dark"] == dones
            assert values["Trajectories/store_enabled/session=dark"] == 0
            steps += int(sum(np.flatnonzero(col).max() + 1 for col in steps_in.T if col.any()))
        assert values["Trajectories/steps_captured/session=dark"] > 0
        assert values["Trajectories/outcome_unknown/session=dark"] == dones


def test_tensorboard_event_files_hold_scalars_at_the_right_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            metrics=MetricsConfig(
                tensorboard_dir=str(tmp_path / "tb"), tensorboard_gate=WriteGate(0, 0)
            ),
        )
    )
    T, N = 8, 2
    expected = {}
    captured = 0
    with RolloutRecorder(target=running.address, session="tb") as rec:
        for i in range(5):
            done = np.zeros((T, N), bool)
            done[i % T, 0] = True  # one episode per chunk
            rec.record({"action": np.zeros((T, N)), "reward": np.ones((T, N)), "done": done})
            captured += 1
            expected[(i + 1) * T * N] = captured  # step = env steps after the chunk
        rec.flush()
        rec.capture.sample_start()
    running.stop(grace=0)  # closes the writer, flushing the event files
    acc = EventAccumulator(str(tmp_path / "tb" / "tb"))  # one run directory per session
    acc.Reload()
    tag = "Trajectories/episodes_captured"
    assert tag in acc.Tags()["scalars"]
    # The feeder takes the chunks that arrive together as one batch and logs once, at the
    # batch's last chunk's step: every value written is the count at its step, and the
    # last one is the whole run's.
    got = {e.step: e.value for e in acc.Scalars(tag)}
    assert got and all(expected[step] == value for step, value in got.items())
    assert max(got) == 5 * T * N and got[max(got)] == 5
    counts = {e.step: e.value for e in acc.Scalars("Episode/count")}
    assert set(counts) <= set(expected) and max(counts) == 5 * T * N
    assert sum(counts.values()) == 5  # each episode in exactly one summary


def test_status_once_and_json_against_a_live_server(server_process):
    rng = np.random.default_rng(2)
    with RolloutRecorder(target=server_process.address, session="live", worker_id="w-a") as rec:
        for _ in range(3):
            rec.record(chunk(rng))
        rec.flush()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "recorder_server",
                "status",
                "--target",
                server_process.address,
                "--once",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        print(out.stdout)
        assert "live" in out.stdout and "w-a" in out.stdout and "chunks" in out.stdout
        row = next(line for line in out.stdout.splitlines() if line.startswith("live"))
        # Workers, chunks, env steps: 3 chunks of T=10 steps from N=3 envs.
        assert row.split()[1:4] == ["1", "3", str(3 * 10 * 3)]
        js = subprocess.run(
            [
                sys.executable,
                "-m",
                "recorder_server",
                "status",
                "--target",
                server_process.address,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        data = json.loads(js.stdout)
        assert data["sessions"][0]["session"] == "live"
        assert data["sessions"][0]["chunks_stored"] == 3  # snake_case, a number
        assert data["sessions"][0]["chunks_dropped"] == 0  # zeros are kept
        assert data["sessions"][0]["env_steps"] == 3 * 10 * 3


def test_status_reports_an_unreachable_server():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recorder_server",
            "status",
            "--target",
            "127.0.0.1:1",
            "--once",
            "--timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "127.0.0.1:1" in out.stderr
