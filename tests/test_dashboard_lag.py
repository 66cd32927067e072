"""The dataset sink's lag, `Recorder/dataset_lag_seconds`: the age of the oldest finished
episode not yet written, measured by the sink at least once a second (not only when it
writes), and shown in the dashboard's dataset section.

The clock is checked on its own with given times; the gauge against a real server whose sink
writes once at start and then not for an hour (its episodes wait, so their age only grows);
the page in headless Chromium with the helpers of test_dashboard.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import wait_for
from test_dashboard import ARTIFACTS, TOKEN, _browser, _read, _wait
from test_dataset import count_episodes, sink_options

from recorder_client import RolloutRecorder
from recorder_server import start_server
from recorder_server.dataset.lag import LagClock
from recorder_server.durability import DurabilityOptions

LAG = "Recorder/dataset_lag_seconds/session={}"


def test_lag_clock_ages_the_oldest_unwritten_episode():
    clock = LagClock()
    assert clock.observe(0.0, {"a": 0}, {}) == 0.0
    assert clock.observe(1.0, {"a": 2}, {}) == 0.0  # first seen now
    assert clock.observe(3.0, {"a": 5}, {}) == 2.0  # episodes 0-1, seen at 1.0
    assert clock.observe(4.0, {"a": 5}, {"a": 2}) == 1.0  # episode 2 is the oldest: seen at 3.0
    assert clock.observe(4.5, {"a": 5, "b": 1}, {"a": 2}) == 1.5  # b's is younger
    assert clock.observe(6.0, {"a": 5, "b": 1}, {"a": 5}) == 1.5  # only b's is left
    assert clock.observe(7.0, {"a": 5, "b": 1}, {"a": 5, "b": 1}) == 0.0
    assert clock.observe(8.0, {"a": 1}, {}) == 0.0  # a reset (and b gone): counting anew
    assert clock.observe(10.0, {"a": 1}, {}) == 2.0


@pytest.fixture(scope="module")
def sink_server(tmp_path_factory):
    """A server with a token, the dashboard and a dataset sink that writes once at start and
    then not for an hour."""
    tmp = tmp_path_factory.mktemp("lag")
    (tmp / "token").write_text(TOKEN + "\n")
    running = start_server(
        sink_options(
            tmp,
            str(tmp / "dataset"),
            flush=3600,
            token_file=str(tmp / "token"),
            http_listen="127.0.0.1:0",
            durability=DurabilityOptions(enabled=False),
        )
    )
    running.dataset_uri = str(tmp / "dataset")
    try:
        yield running
    finally:
        running.stop(grace=0)


def record_episodes(running, session: str, count: int) -> tuple[float, float]:
    """Join ``session`` and wait until the sink has seen it (its one write is then behind
    it), then record ``count`` one-step episodes. Returns the monotonic times just before the
    episodes were sent and just after they were acknowledged."""
    with RolloutRecorder(
        target=running.address, session=session, worker_id="w", token=TOKEN
    ) as rec:
        zeros = np.zeros((1, 1), np.float32)
        rec.record({"action": zeros.astype(np.int32), "reward": zeros, "done": zeros > 0})
        rec.flush()
        assert wait_for(lambda: LAG.format(session) in running.metrics.snapshot(), 10)
        before = time.monotonic()
        rec.record(
            {
                "action": np.zeros((count, 1), np.int32),
                "reward": np.ones((count, 1), np.float32),
                "done": np.ones((count, 1), bool),
            }
        )
        rec.flush()
        return before, time.monotonic()


def test_the_lag_is_the_age_of_the_oldest_unwritten_episode(sink_server):
    sent, acked = record_episodes(sink_server, "lag", 10)
    time.sleep(3.0)
    before = time.monotonic()
    lag = sink_server.metrics.snapshot()[LAG.format("lag")]
    after = time.monotonic()
    # The sink first sees an episode within a tick (1 s) of its ack, and the gauge is at most
    # a tick old.
    assert before - acked - 2.0 <= lag <= after - sent, lag
    assert count_episodes(sink_server.dataset_uri, "lag") == 0
    # A reset writes every finished episode first; nothing is then waiting.
    with RolloutRecorder(
        target=sink_server.address, session="lag", worker_id="w", token=TOKEN
    ) as rec:
        rec.reset()
    assert count_episodes(sink_server.dataset_uri, "lag") == 10
    assert wait_for(lambda: sink_server.metrics.snapshot()[LAG.format("lag")] == 0.0, 5)


def test_the_page_shows_the_lag_with_a_sink(sink_server):
    sent, _ = record_episodes(sink_server, "waiting", 5)
    base = f"http://{sink_server.http_address}/"
    ARTIFACTS.mkdir(exist_ok=True)
    driver = _browser()
    try:
        driver.get(base + "?session=waiting")
        driver.find_element("id", "token").send_keys(TOKEN)
        driver.find_element("id", "submit").click()
        _wait(
            driver,
            lambda d: _read(d, "#session-name") == "waiting",
            what="the linked session was not shown",
        )
        assert driver.execute_script("return !document.getElementById('dataset').hidden")

        def shown() -> float:
            return float(_read(driver, '#dataset [data-field="lag_seconds"]', "value") or 0)

        _wait(driver, lambda d: shown() > 1.5, what="the dataset lag did not grow")
        assert shown() <= time.monotonic() - sent
        driver.find_element("id", "dataset").screenshot(str(ARTIFACTS / "dashboard-lag.png"))
    finally:
        driver.quit()
