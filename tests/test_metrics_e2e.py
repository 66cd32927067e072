"""Metrics that add up: a real `rollout-recorder serve` with its default write gates, real
chunks, and every sink read back and checked against the episodes the chunks hold."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import ServerProcess, free_port
from prometheus_client.parser import text_string_to_metric_families

from recorder_client import RolloutRecorder

T, N, CHUNKS = 16, 4, 30
SESSION = "e2e"
SUMMARY = ("count", "return_mean", "return_min", "return_max")
SUMMARY += ("length_mean", "length_min", "length_max")


def true_episodes(chunks: list[dict]) -> list[tuple[int, float, int]]:
    """(step after the chunk that finished it, return, length) of every finished episode."""
    out = []
    ret = np.zeros(N)
    length = np.zeros(N, dtype=np.int64)
    for k, c in enumerate(chunks):
        for t in range(T):
            ret += c["reward"][t]
            length += 1
            for e in np.flatnonzero(c["done"][t]):
                out.append(((k + 1) * T * N, float(ret[e]), int(length[e])))
                ret[e], length[e] = 0.0, 0
    return out


def summary(episodes: list[tuple[int, float, int]]) -> tuple[float, ...]:
    returns = [r for _, r, _ in episodes]
    lengths = [n for _, _, n in episodes]
    return (
        float(len(episodes)),
        float(np.mean(returns)),
        min(returns),
        max(returns),
        float(np.mean(lengths)),
        float(min(lengths)),
        float(max(lengths)),
    )


def check_points(points: list[tuple[int, tuple[float, ...]]], episodes, rtol: float) -> None:
    """Each point (step, summary) summarises exactly the episodes since the previous point."""
    previous = -1
    for step, values in points:
        window = [e for e in episodes if previous < e[0] <= step]
        assert window, f"a point at step {step} with no episode since step {previous}"
        np.testing.assert_allclose(values, summary(window), rtol=rtol, err_msg=f"step {step}")
        previous = step
    assert previous == episodes[-1][0], "the last episodes never reached the sink"


def jsonl_points(path: Path) -> tuple[list, dict[str, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    columns: dict[str, list] = {name: [] for name in SUMMARY}
    last: dict[str, float] = {}
    for row in rows:
        last[row["tag"]] = row["value"]
        for name in SUMMARY:
            if row["tag"] == f"Episode/{name}/session={SESSION}":
                columns[name].append((row["step"], row["value"]))
    points = [
        (col[0][0], tuple(v for _, v in col))
        for col in zip(*(columns[n] for n in SUMMARY), strict=True)
    ]
    assert all(len({s for s, _ in col}) == 1 for col in zip(*columns.values(), strict=True))
    return points, last


def tensorboard_points(run: Path) -> tuple[list, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert not [t for t in tags if "session=" in t], "a session folded into a tag"
    columns = [acc.Scalars(f"Episode/{name}") for name in SUMMARY]
    points = [(col[0].step, tuple(e.value for e in col)) for col in zip(*columns, strict=True)]
    last = {tag: acc.Scalars(tag)[-1].value for tag in tags}
    return points, last


def scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {}
    for family in families.values():
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return {"families": families, "samples": samples}


@pytest.mark.timeout(120)
def test_every_sink_adds_up_one_second_after_the_last_chunk(tmp_path):
    port = free_port()
    server = ServerProcess(
        tmp_path / "data",
        "--metrics-jsonl",
        str(tmp_path / "m.jsonl"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--metrics-listen",
        f"127.0.0.1:{port}",
        "--metrics-return-buckets",
        "0,2,5,10,20",
    )
    rng = np.random.default_rng(21)
    chunks = []
    try:
        with RolloutRecorder(target=server.address, session=SESSION) as rec:
            for k in range(CHUNKS):
                c = {
                    "action": np.zeros((T, N), np.int32),
                    # Whole numbers: every sum is exact, so the sinks must match exactly.
                    "reward": rng.integers(0, 3, (T, N)).astype(np.float32),
                    "done": rng.random((T, N)) < 0.12,
                }
                chunks.append(c)
                rec.record(c)
                if k % 3 == 0:
                    time.sleep(0.2)  # several chunks per 1 s gate, several gates per run
            rec.flush()
            last_chunk = time.monotonic()
            episodes = true_episodes(chunks)
            total = len(episodes)
            time.sleep(max(0.0, last_chunk + 1.0 - time.monotonic()))

            # JSON lines: the counter's total, and the points' counts, equal the true count.
            points, last = jsonl_points(tmp_path / "m.jsonl")
            assert last[f"Recorder/episodes_finished/session={SESSION}"] == total
            assert sum(v[0] for _, v in points) == total
            check_points(points, episodes, rtol=1e-12)
            print(f"jsonl: {len(points)} points, {total} episodes")

            # TensorBoard: its own run directory for the session, same checks.
            points, last = tensorboard_points(tmp_path / "tb" / SESSION)
            assert last["Recorder/episodes_finished"] == total
            assert sum(v[0] for _, v in points) == total
            check_points(points, episodes, rtol=1e-6)  # TensorBoard keeps float32
            print(f"tensorboard: {len(points)} points, {total} episodes")

            # Prometheus: the counter and both histograms' counts; the return histogram's
            # sum and (configured) buckets.
            got = scrape(f"127.0.0.1:{port}")
            samples, label = got["samples"], (("session", SESSION),)
            assert samples[("rollout_recorder_episodes_finished_total", label)] == total
            assert samples[("rollout_recorder_episode_return_count", label)] == total
            assert samples[("rollout_recorder_episode_length_count", label)] == total
            returns = np.array([r for _, r, _ in episodes])
            lengths = np.array([n for _, _, n in episodes])
            assert samples[("rollout_recorder_episode_return_sum", label)] == returns.sum()
            assert samples[("rollout_recorder_episode_length_sum", label)] == lengths.sum()
            for le in (0, 2, 5, 10, 20):
                key = ("rollout_recorder_episode_return_bucket", (("le", f"{le:.1f}"), *label))
                assert samples[key] == (returns <= le).sum(), le
            families = got["families"]
            assert families["rollout_recorder_episode_return"].type == "histogram"
            assert families["rollout_recorder_chunks"].type == "counter"
            assert families["rollout_recorder_trajectories_episodes_captured"].type == "counter"
            for name, family in families.items():
                assert name.startswith("rollout_recorder_"), name
                assert "Rollout Recorder" not in family.documentation, name
                for s in family.samples:
                    assert s.labels.get("session") == SESSION, (name, s.labels)
            print(f"prometheus: {total} episodes, {len(families)} families")
    finally:
        server.stop()
