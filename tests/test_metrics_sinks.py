"""MetricsTracker against its real sinks: a scraped HTTP endpoint, event files, JSON lines."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from recorder_server.metrics import (
    MetricsConfig,
    MetricsTracker,
    WriteGate,
    fold_tag,
    prometheus_name,
)

EVERY_CALL = WriteGate(min_interval_s=0.0, every_n_steps=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scrape(host: str, port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name + sorted labels -> value, from a real HTTP scrape."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def family_types(host: str, port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(event.step, event.value) for event in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


@pytest.fixture
def tracker():
    t = MetricsTracker(MetricsConfig())
    yield t
    t.close()


# --------------------------------------------------------------------------------- Prometheus


def test_scrape_counters_gauges_and_scalars(tracker: MetricsTracker) -> None:
    host, port = tracker.start_http("127.0.0.1", 0)
    assert host == "127.0.0.1" and port > 0

    tracker.inc("Recorder/raw_bytes", 100)
    tracker.inc("Recorder/raw_bytes", 23.5)
    for _ in range(3):
        tracker.inc("Recorder/chunks", session="default")
    tracker.inc("Recorder/chunks", 2, session="other")
    tracker.set("Recorder/sessions_open", 2)
    tracker.set("Recorder/sessions_open", 1)
    tracker.log("Episode/return_mean", 1.25, step=10)
    tracker.log_many({"Episode/return_mean": 2.5, "Episode/length_mean": 40}, step=11)
    tracker.log("Worker/steps", 7, step=11, worker=3)

    samples = scrape(host, port)
    assert samples[("rollout_recorder_raw_bytes_total", ())] == 123.5
    assert samples[("rollout_recorder_chunks_total", (("session", "default"),))] == 3
    assert samples[("rollout_recorder_chunks_total", (("session", "other"),))] == 2
    assert samples[("rollout_recorder_sessions_open", ())] == 1
    assert samples[("rollout_recorder_episode_return_mean", ())] == 2.5
    assert samples[("rollout_recorder_episode_length_mean", ())] == 40
    assert samples[("rollout_recorder_worker_steps", (("worker", "3"),))] == 7

    types = family_types(host, port)
    assert types["rollout_recorder_raw_bytes"] == "counter"
    assert types["rollout_recorder_chunks"] == "counter"
    assert types["rollout_recorder_sessions_open"] == "gauge"
    assert types["rollout_recorder_episode_return_mean"] == "gauge"


def test_own_registry_not_global() -> None:
    a = MetricsTracker(MetricsConfig())
    b = MetricsTracker(MetricsConfig())
    try:
        a.inc("Recorder/chunks", 5)
        b.inc("Recorder/chunks", 1)
        assert b"rollout_recorder_chunks_total 5.0" in generate_latest(a.registry)
        assert b"rollout_recorder_chunks_total 1.0" in generate_latest(b.registry)
        assert b"rollout_recorder_chunks" not in generate_latest(REGISTRY)
    finally:
        a.close()
        b.close()


def test_concurrent_increments_are_not_lost(tracker: MetricsTracker) -> None:
    host, port = tracker.start_http("127.0.0.1", 0)
    n_threads, n_incs = 8, 2000

    def work(i: int) -> None:
        for k in range(n_incs):
            tracker.inc("Recorder/chunks", session=f"s{i % 2}")
            tracker.inc("Recorder/raw_bytes", 2)
            tracker.log("Episode/return_mean", float(k), step=k)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    samples = scrape(host, port)
    half = n_threads // 2 * n_incs
    assert samples[("rollout_recorder_chunks_total", (("session", "s0"),))] == half
    assert samples[("rollout_recorder_chunks_total", (("session", "s1"),))] == half
    assert samples[("rollout_recorder_raw_bytes_total", ())] == 2 * n_threads * n_incs
    snap = tracker.snapshot()
    assert snap["Recorder/chunks/session=s0"] == half
    assert snap["Recorder/raw_bytes"] == 2 * n_threads * n_incs


def test_close_stops_http_server() -> None:
    t = MetricsTracker(MetricsConfig())
    host, port = t.start_http("127.0.0.1", 0)
    t.inc("Recorder/chunks")
    assert scrape(host, port)[("rollout_recorder_chunks_total", ())] == 1
    t.close()
    with pytest.raises(urllib.error.URLError) as err:
        urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2)
    assert isinstance(err.value.reason, ConnectionRefusedError)
    t.close()  # idempotent
    with pytest.raises(RuntimeError):
        t.start_http("127.0.0.1", 0)


def test_second_endpoint_and_disabled_prometheus_raise(tracker: MetricsTracker) -> None:
    tracker.start_http("127.0.0.1", 0)
    with pytest.raises(RuntimeError, match="already serving"):
        tracker.start_http("127.0.0.1", 0)
    bare = MetricsTracker(MetricsConfig(prometheus=False))
    assert bare.registry is None
    with pytest.raises(RuntimeError, match="disabled"):
        bare.start_http("127.0.0.1", 0)
    bare.close()


# ------------------------------------------------------------------------- pushed sinks


def test_tensorboard_and_jsonl_every_call(tmp_path: Path) -> None:
    config = MetricsConfig(
        tensorboard_dir=tmp_path / "tb",
        tensorboard_gate=EVERY_CALL,
        jsonl_path=tmp_path / "metrics.jsonl",
        jsonl_gate=EVERY_CALL,
    )
    with MetricsTracker(config) as t:
        t.log_many({"Episode/return_mean": 1.0, "Episode/length_mean": 10.0}, step=1)
        t.inc("Recorder/chunks", 4, session="default")
        t.log_many({"Episode/return_mean": 2.0}, step=2)
        t.log("Episode/return_mean", -3.5, step=5)
        t.log("Episode/nan_metric", float("nan"), step=5)

    scalars = read_tensorboard(tmp_path / "tb")
    assert scalars["Episode/return_mean"] == [(1, 1.0), (2, 2.0), (5, -3.5)]
    assert scalars["Episode/length_mean"] == [(1, 10.0)]  # unchanged later: not rewritten
    assert "Recorder/chunks" not in scalars  # a session's series go to its own run
    by_session = read_tensorboard(tmp_path / "tb" / "default")
    assert by_session == {"Recorder/chunks": [(2, 4.0)]}  # rides along at step 2, same tag

    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(set(line) == {"step", "time", "tag", "value"} for line in lines)
    got = [(line["step"], line["tag"], line["value"]) for line in lines]
    assert got == [
        (1, "Episode/return_mean", 1.0),
        (1, "Episode/length_mean", 10.0),
        (2, "Episode/return_mean", 2.0),
        (2, "Recorder/chunks/session=default", 4.0),
        (5, "Episode/return_mean", -3.5),
        (5, "Episode/nan_metric", None),
    ]
    assert all(isinstance(line["time"], float) and line["time"] > 1.6e9 for line in lines)


def test_time_gate_suppresses_writes_but_prometheus_sees_latest(tmp_path: Path) -> None:
    clock = FakeClock()
    jsonl = tmp_path / "m.jsonl"
    config = MetricsConfig(jsonl_path=jsonl, jsonl_gate=WriteGate(min_interval_s=10.0))
    t = MetricsTracker(config, clock=clock)
    try:
        host, port = t.start_http("127.0.0.1", 0)
        t.log("Episode/return_mean", 1.0, step=1)  # first call writes
        clock.now += 1
        t.log("Episode/return_mean", 2.0, step=2)  # within 10 s: gated
        clock.now += 1
        t.log("Episode/return_mean", 3.0, step=3)  # gated
        t.inc("Recorder/chunks", 7)  # inc never writes by itself

        assert [(x["step"], x["value"]) for x in read_jsonl(jsonl)] == [(1, 1.0)]
        samples = scrape(host, port)
        assert samples[("rollout_recorder_episode_return_mean", ())] == 3.0
        assert samples[("rollout_recorder_chunks_total", ())] == 7
        assert t.snapshot() == {"Episode/return_mean": 3.0, "Recorder/chunks": 7.0}

        clock.now += 8.5  # 10.5 s after the first write
        t.log("Episode/length_mean", 9.0, step=4)
        got = [(x["step"], x["tag"], x["value"]) for x in read_jsonl(jsonl)]
        assert got == [
            (1, "Episode/return_mean", 1.0),
            (3, "Episode/return_mean", 3.0),  # coalesced: latest value at its own step
            (4, "Episode/length_mean", 9.0),
            (4, "Recorder/chunks", 7.0),  # counters at the current step
        ]
    finally:
        t.close()


def test_step_gate_and_flush(tmp_path: Path) -> None:
    jsonl = tmp_path / "m.jsonl"
    config = MetricsConfig(
        jsonl_path=jsonl, jsonl_gate=WriteGate(min_interval_s=0, every_n_steps=5)
    )
    t = MetricsTracker(config, clock=FakeClock())
    for step in range(12):
        t.log("A/x", float(step), step=step)
    assert [x["step"] for x in read_jsonl(jsonl)] == [0, 5, 10]
    t.log("A/x", 100.0, step=11)
    t.set("A/level", 4.0)
    t.flush()  # ignores the gate
    rows = [(x["step"], x["tag"], x["value"]) for x in read_jsonl(jsonl)]
    assert rows[3:] == [(11, "A/x", 100.0), (11, "A/level", 4.0)]
    t.flush()  # nothing new: nothing written
    assert len(read_jsonl(jsonl)) == 5
    t.log("A/x", 1.0, step=0)  # step went backwards (reset): counts as advanced
    last = read_jsonl(jsonl)[-1]
    assert (last["step"], last["tag"], last["value"]) == (0, "A/x", 1.0)
    t.close()


def test_tensorboard_gate(tmp_path: Path) -> None:
    clock = FakeClock()
    config = MetricsConfig(tensorboard_dir=tmp_path, tensorboard_gate=WriteGate(min_interval_s=5.0))
    t = MetricsTracker(config, clock=clock)
    for step in range(20):
        clock.now += 1.0
        t.log_many({"Episode/return_mean": float(step), "Episode/length_mean": 2.0 * step}, step)
    t.close()  # flushes pending step 19
    scalars = read_tensorboard(tmp_path)
    assert [s for s, _ in scalars["Episode/return_mean"]] == [0, 5, 10, 15, 19]
    assert scalars["Episode/length_mean"][-1] == (19, 38.0)


# -------------------------------------------------------------------------- API rules


def test_snapshot_plain_types(tracker: MetricsTracker) -> None:
    import numpy as np

    tracker.inc("Recorder/chunks", np.int64(3), session="a", worker=1)
    tracker.set("Recorder/open", np.float32(1.5))
    tracker.log_many({"Episode/return_mean": np.float64(0.25)}, np.int64(4))
    snap = tracker.snapshot()
    assert snap == {
        "Recorder/chunks/session=a/worker=1": 3.0,
        "Recorder/open": 1.5,
        "Episode/return_mean": 0.25,
    }
    assert all(type(k) is str and type(v) is float for k, v in snap.items())
    assert tracker.current_step == 4


def test_invalid_uses_raise(tracker: MetricsTracker) -> None:
    with pytest.raises(ValueError, match="-1"):
        tracker.inc("Recorder/chunks", -1)
    with pytest.raises(ValueError):
        tracker.inc("Recorder/chunks", float("nan"))
    tracker.inc("Recorder/chunks", 1, session="a")
    with pytest.raises(ValueError, match="is a counter"):
        tracker.set("Recorder/chunks", 1, session="a")
    with pytest.raises(ValueError, match="labels"):
        tracker.inc("Recorder/chunks", 1, worker="a")
    with pytest.raises(ValueError, match="same Prometheus name"):
        tracker.set("Recorder/chunks_total", 1)
    with pytest.raises(ValueError, match="label name"):
        tracker.inc("Recorder/other", 1, __bad="x")
    with pytest.raises(TypeError):
        tracker.log("Episode/x", 1.0, step=1.5)  # steps are integers
    with pytest.raises(ValueError):
        WriteGate(min_interval_s=-1)
    # the failed calls left the good series intact
    assert tracker.snapshot() == {"Recorder/chunks/session=a": 1.0}


def test_naming() -> None:
    assert prometheus_name("Recorder/raw_bytes", counter=True) == "rollout_recorder_raw_bytes_total"
    assert prometheus_name("Recorder/rawBytes", counter=True) == "rollout_recorder_raw_bytes_total"
    assert (
        prometheus_name("Episode/return_mean", counter=False)
        == "rollout_recorder_episode_return_mean"
    )
    assert prometheus_name("A/done_total", counter=True) == "rollout_recorder_a_done_total"
    assert prometheus_name("Trajectories/episodes captured", counter=True, namespace="") == (
        "trajectories_episodes_captured_total"
    )
    assert fold_tag("Recorder/chunks", {"worker": 2, "session": "x"}) == (
        "Recorder/chunks/session=x/worker=2"
    )


def test_bad_value_does_not_poison_the_series(tracker: MetricsTracker) -> None:
    with pytest.raises((TypeError, ValueError)):
        tracker.log("Episode/return_mean", "not a number", step=1)  # type: ignore[arg-type]
    tracker.log("Episode/return_mean", 2.0, step=2)
    assert tracker.snapshot() == {"Episode/return_mean": 2.0}


# ------------------------------------------------------------------ episodes and catalogue


def test_each_write_summarises_every_episode_since_the_previous_one(tmp_path: Path) -> None:
    clock = FakeClock()
    jsonl = tmp_path / "m.jsonl"
    config = MetricsConfig(jsonl_path=jsonl, jsonl_gate=WriteGate(min_interval_s=10.0))
    t = MetricsTracker(config, clock=clock)
    try:
        t.observe_episodes([1.0, 3.0], [10, 20], step=8, session="s")  # first call writes
        clock.now += 1
        t.observe_episodes([7.0], [5], step=16, session="s")  # gated
        clock.now += 1
        t.observe_episodes([-2.0, 0.0], [30, 1], step=24, session="s")  # gated
        t.flush_idle()  # 2 s since the last write and since the last value: not yet
        assert len([x for x in read_jsonl(jsonl) if x["tag"].startswith("Episode/count")]) == 1
        clock.now += 2.5  # quiet for a quarter interval: the idle flush writes
        t.flush_idle()
        rows = [(x["step"], x["tag"].split("/session=")[0], x["value"]) for x in read_jsonl(jsonl)]
        summaries = [r for r in rows if r[1].startswith("Episode/")]
        assert summaries == [
            (8, "Episode/count", 2),
            (8, "Episode/return_mean", 2.0),
            (8, "Episode/return_min", 1.0),
            (8, "Episode/return_max", 3.0),
            (8, "Episode/length_mean", 15.0),
            (8, "Episode/length_min", 10.0),
            (8, "Episode/length_max", 20.0),
            # the two gated calls together, at the later one's step
            (24, "Episode/count", 3),
            (24, "Episode/return_mean", 5.0 / 3),
            (24, "Episode/return_min", -2.0),
            (24, "Episode/return_max", 7.0),
            (24, "Episode/length_mean", 12.0),
            (24, "Episode/length_min", 1.0),
            (24, "Episode/length_max", 30.0),
        ]
        t.flush_idle()  # nothing new: nothing written
        assert len(read_jsonl(jsonl)) == len(rows)
        host, port = t.start_http("127.0.0.1", 0)
        samples = scrape(host, port)
        label = (("session", "s"),)
        assert samples[("rollout_recorder_episode_return_count", label)] == 5
        assert samples[("rollout_recorder_episode_return_sum", label)] == 9.0
        assert samples[("rollout_recorder_episode_return_bucket", (("le", "0.0"), *label))] == 2
        assert samples[("rollout_recorder_episode_length_bucket", (("le", "10.0"), *label))] == 3
        assert family_types(host, port)["rollout_recorder_episode_length"] == "histogram"
        assert t.snapshot()["Episode/count/session=s"] == 5
        assert t.forget(session="s") == 1
        assert "rollout_recorder_episode_return_count" not in {n for n, _ in scrape(host, port)}
    finally:
        t.close()


def test_batched_episodes_match_a_hand_count(tmp_path: Path, monkeypatch) -> None:
    """Episodes are folded in batches: each written summary still covers exactly the
    episodes since the sink's previous write, and every read sees every episode."""
    import numpy as np

    from recorder_server.metrics import tracker as tracker_module

    monkeypatch.setattr(tracker_module, "_FOLD_AT", 7)  # fold on size as well as on reads
    clock = FakeClock()
    jsonl = tmp_path / "m.jsonl"
    config = MetricsConfig(jsonl_path=jsonl, jsonl_gate=WriteGate(min_interval_s=3.0))
    t = MetricsTracker(config, clock=clock)
    rng = np.random.default_rng(5)
    seen_r: list[float] = []
    seen_l: list[float] = []
    window: list[tuple[float, float]] = []
    expected = []
    try:
        for call in range(60):
            n = int(rng.integers(1, 5))
            returns = rng.normal(size=n).round(3)
            lengths = rng.integers(1, 300, size=n)
            before = len(read_jsonl(jsonl)) if jsonl.exists() else 0
            t.observe_episodes(returns, lengths, step=call + 1, session="s")
            window += zip(returns.tolist(), lengths.tolist())
            seen_r += returns.tolist()
            seen_l += lengths.tolist()
            returns[:] = 99.0  # the caller reuses its buffer
            if len(read_jsonl(jsonl)) > before:  # this call opened the gate
                r, ln = zip(*window)
                expected.append((call + 1, len(r), min(r), max(r), max(ln), sum(ln) / len(ln)))
                window = []
            if call % 9 == 4:
                assert t.snapshot()["Episode/count/session=s"] == len(seen_r)
            clock.now += 1
        rows = [x for x in read_jsonl(jsonl) if x["tag"].startswith("Episode/")]
        by_step: dict[int, dict[str, float]] = {}
        for x in rows:
            by_step.setdefault(x["step"], {})[x["tag"].split("/session=")[0]] = x["value"]
        got = [
            (
                step,
                v["Episode/count"],
                v["Episode/return_min"],
                v["Episode/return_max"],
                v["Episode/length_max"],
                v["Episode/length_mean"],
            )
            for step, v in sorted(by_step.items())
        ]
        assert len(expected) >= 15
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert g == pytest.approx(e)
        host, port = t.start_http("127.0.0.1", 0)
        samples = scrape(host, port)
        label = (("session", "s"),)
        assert samples[("rollout_recorder_episode_return_count", label)] == len(seen_r)
        assert samples[("rollout_recorder_episode_length_sum", label)] == sum(seen_l)
        le0 = samples[("rollout_recorder_episode_return_bucket", (("le", "0.0"), *label))]
        assert le0 == sum(1 for r in seen_r if r <= 0.0)
    finally:
        t.close()


def test_catalogue_counters_are_counters_with_help_text(tracker: MetricsTracker) -> None:
    host, port = tracker.start_http("127.0.0.1", 0)
    tracker.log_many(
        {"Trajectories/episodes_captured": 3, "Trajectories/archive_cells": 7}, 1, session="a"
    )
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    assert families["rollout_recorder_trajectories_episodes_captured"].type == "counter"
    assert families["rollout_recorder_trajectories_archive_cells"].type == "gauge"
    assert families["rollout_recorder_trajectories_archive_cells"].documentation == (
        "Cells in the archive."
    )


def test_docs_table_is_the_catalogue() -> None:
    from recorder_server.metrics.catalog import markdown

    docs = Path(__file__).parent.parent / "docs" / "metrics.md"
    assert docs.read_text() == markdown(), (
        "regenerate: python -m recorder_server.metrics.catalog > docs/metrics.md"
    )


def test_observe_feed_leaves_what_the_three_calls_it_replaces_leave(tmp_path: Path) -> None:
    """The feeder's one call per batch: the same values, histograms and sink rows as inc,
    observe_episodes per chunk and log_many at the batch's last step."""
    chunks = [([1.0, -3.0], [10, 20], 8), ([7.5], [5], 16)]
    scalars = {"Trajectories/episodes_captured": 3.0, "Trajectories/store_enabled": 0.0}
    trackers = []
    for name in ("calls", "feed"):
        jsonl = tmp_path / f"{name}.jsonl"
        config = MetricsConfig(jsonl_path=jsonl, jsonl_gate=WriteGate(min_interval_s=10.0))
        t = MetricsTracker(config, clock=FakeClock())
        if name == "calls":
            t.inc("Recorder/episodes_finished", 3.0, session="s")
            for returns, lengths, step in chunks:
                t.observe_episodes(returns, lengths, step, session="s")
            t.log_many(scalars, 16, session="s")
        else:
            t.observe_feed({"Recorder/episodes_finished": 3.0}, chunks, scalars, 16, session="s")
        t.flush()
        trackers.append((t, jsonl))
    (calls, calls_jsonl), (feed, feed_jsonl) = trackers
    try:
        assert feed.snapshot() == calls.snapshot()
        assert feed.snapshot()["Episode/count/session=s"] == 3
        assert feed.snapshot()["Episode/return_min/session=s"] == -3.0
        assert generate_latest(feed.registry) == generate_latest(calls.registry)

        def last_rows(path: Path) -> dict[str, float]:
            rows = read_jsonl(path)
            # The sink's writes differ: the gate opened at step 8 for the first of the three
            # calls (its summary and the counter written then), once at 16 for the batch.
            count = sum(x["value"] for x in rows if x["tag"] == "Episode/count/session=s")
            last = {x["tag"]: x["value"] for x in rows if not x["tag"].startswith("Episode/")}
            return last | {"episodes summarised": count}

        assert last_rows(feed_jsonl) == last_rows(calls_jsonl)
        assert last_rows(feed_jsonl)["episodes summarised"] == 3
        steps = {x["tag"]: x["step"] for x in read_jsonl(feed_jsonl)}
        assert steps["Trajectories/episodes_captured/session=s"] == 16
        with pytest.raises(ValueError, match="lengths: expected 2 values"):
            feed.observe_feed({}, [([1.0, 2.0], [3], 24)], {}, 24, session="s")
        with pytest.raises(ValueError, match="amount must be >= 0"):
            feed.observe_feed({"Recorder/episodes_finished": -1.0}, [], {}, 24, session="s")
    finally:
        calls.close()
        feed.close()
