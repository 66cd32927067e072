"""The live dashboard (`serve --http-listen`): its JSON API and token gate against a real
server, and the page itself in headless Chromium (Debian's `chromium` + `chromium-driver`,
driven by selenium; skipped with the reason when /usr/bin/chromium is absent).

The browser test feeds a scripted walk whose visited cells are known, and checks that the
heatmap the page drew has exactly those cells, that the live counters move while a worker
records, and that a wrong token is refused. Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

import numpy as np
import pytest
from conftest import http

from recorder_client import CellField, RolloutRecorder, TrajectoryTrainingConfiguration
from recorder_server import ServerOptions, start_server
from recorder_server.dashboard.episodes import EpisodeWindow, histogram
from recorder_server.dashboard.sampler import Sample, history
from recorder_server.dashboard.views import archive_bins
from recorder_server.dataset.sink import DatasetOptions
from recorder_server.durability import DurabilityOptions

TOKEN = "dashboard-test-token-0123456789"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

# Cells (x, y // 2) over a recorded position (x, y).
CONFIG = TrajectoryTrainingConfiguration(
    cell_fields=(
        CellField("pos", (0,), name="x"),
        CellField("pos", (1,), bucket=2, name="y"),
    ),
)

# Two workers' walks: each chunk is one whole episode (done at its last step) along its path.
PATHS = {
    "w0": [(x, 0) for x in range(10)] + [(9, y) for y in range(1, 8)],
    "w1": [(i, i) for i in range(7)] + [(2, 12), (3, 12), (3, 13)],
}
VISITED = {(x, y // 2) for path in PATHS.values() for x, y in path}


def walk_chunk(path: list[tuple[int, int]]) -> tuple[dict, dict]:
    """One (T, 1) chunk that walks `path` and ends its episode at the last step."""
    t = len(path)
    done = np.zeros((t, 1), dtype=bool)
    done[-1] = True
    rollout = {
        "action": np.zeros((t, 1), dtype=np.int32),
        "reward": np.linspace(0.0, 1.0, t, dtype=np.float32).reshape(t, 1),
        "done": done,
    }
    return rollout, {"pos": np.asarray(path, dtype=np.int32).reshape(t, 1, 2)}


# A second session, "wide": N=3 environments, each finishing an episode every T=4 steps; the
# episodes of chunk c return c, so the recent mean differs from the all-time one.
WIDE_T, WIDE_N, WIDE_CHUNKS = 4, 3, 50
WIDE_RETURNS = [float(c) for c in range(WIDE_CHUNKS) for _ in range(WIDE_N)]


def wide_chunk(c: int) -> dict:
    done = np.zeros((WIDE_T, WIDE_N), dtype=bool)
    done[-1] = True
    return {
        "action": np.zeros((WIDE_T, WIDE_N), dtype=np.int32),
        "reward": np.full((WIDE_T, WIDE_N), c / WIDE_T, dtype=np.float32),
        "done": done,
    }


def recorder(target: str, worker: str) -> RolloutRecorder:
    return RolloutRecorder(
        record_states=True,
        state_fields=["pos"],
        target=target,
        session="walk",
        worker_id=worker,
        capture=CONFIG,
        token=TOKEN,
    )


@pytest.fixture
def dashboard_server(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            token_file=str(token_file),
            http_listen="127.0.0.1:0",
            durability=DurabilityOptions(enabled=False),
            dataset=DatasetOptions(uri=str(tmp_path / "dataset"), node_id="n", flush_seconds=0.2),
        )
    )
    try:
        yield running
    finally:
        running.stop(grace=0)


# ---------------------------------------------------------------------------------------------
# The pure part: series over time from samples


def test_history_rates_and_episode_means_between_samples():
    samples = [
        Sample(100.0, 0, 0, 0, 0, 0, {"episode_count": 0.0}),
        Sample(
            101.0,
            50,
            2_000_000,
            1_000_000,
            5,
            2,
            {"episode_count": 2, "return_mean": 3.0},
            env_steps=400,
        ),
        Sample(
            103.0,
            150,
            6_000_000,
            2_000_000,
            9,
            6,
            {"episode_count": 6, "return_mean": 5.0, "length_mean": 10.0, "cells": 7.0},
            env_steps=1200,
        ),
        Sample(104.0, 0, 0, 0, 0, 0, {}),  # a reset: no rate at this point
    ]
    h = history(samples)
    assert h["time"] == [101.0, 103.0, 104.0]
    assert h["env_steps"] == [400, 1200, 0]  # the x axis in env steps
    assert h["steps_s"] == [50.0, 50.0, None]
    assert h["env_steps_s"] == [400.0, 400.0, None]
    assert h["raw_mb_s"] == [2.0, 2.0, None]
    assert h["wire_mb_s"] == [1.0, 0.5, None]
    assert h["episodes_s"] == [2.0, 2.0, None]
    # The 4 episodes between the 2nd and 3rd sample: (6 * 5 - 2 * 3) / 4 = 6.
    assert h["return_mean"] == [3.0, 6.0, None]
    assert h["cells"] == [None, 7.0, None]


def _bucket_counts(values, edges) -> list[int]:
    """Counts per [edges[i], edges[i + 1]), by comparison (the truth for `histogram`)."""
    return [sum(1 for v in values if lo <= v < hi) for lo, hi in zip(edges, edges[1:])]


@pytest.mark.parametrize(
    "values, integer",
    [
        ([23.0, 31.0, 180.5, 499.0, 500.0, 212.0], False),  # CartPole-sized returns
        ([-0.73, -0.2, 0.05, 0.31], False),
        ([7.0, 7.0, 7.0], True),
        ([12.0, 200.0, 48.0, 1.0, 77.0], True),
    ],
)
def test_histogram_buckets_follow_the_observed_range(values, integer):
    hist = histogram(np.array(values), integer=integer)
    edges = hist["edges"]
    lo, hi = min(values), max(values)
    width = edges[1] - edges[0]
    assert edges[0] <= lo < edges[0] + width and edges[-1] - width <= hi < edges[-1]
    assert 1 <= len(hist["counts"]) <= 2 * 20 + 1
    if hi > lo:  # about 20 buckets over the range, not a fixed ladder
        assert width <= 2.5 * (hi - lo) / 20 or (integer and width == 1)
    if integer:
        assert width == int(width)
    assert hist["counts"] == _bucket_counts(values, edges)
    assert hist["count"] == len(values) and hist["sum"] == pytest.approx(sum(values))
    assert histogram(np.array([])) is None
    nan = histogram(np.array([np.nan, 1.0]))
    assert (nan["count"], nan["nonfinite"], nan["counts"]) == (2, 1, [1])


def test_episode_window_keeps_the_last_episodes_of_each_session():
    class Counting:
        def __init__(self):
            self.observed = 0
            self.forgotten = []

        def inc(self, *a, **k): ...
        def inc_many(self, *a, **k): ...
        def set(self, *a, **k): ...

        def observe_episodes(self, returns, lengths, step, **labels):
            self.observed += len(returns)

        def forget(self, **labels):
            self.forgotten.append(labels)
            return 0

        def snapshot(self):
            return {"x": 1.0}

    inner = Counting()
    window = EpisodeWindow(inner, keep=10)
    for i in range(7):
        window.observe_episodes(np.array([i, i + 0.5]), np.array([3, 4]), i, session="a")
    window.observe_episodes(np.array([9.0]), np.array([1]), 0, session="b")
    returns, lengths = window.recent("a")
    expected = [v for i in range(7) for v in (i, i + 0.5)][-10:]
    assert returns.tolist() == expected and lengths.tolist() == [3, 4] * 5
    assert inner.observed == 15 and window.snapshot() == {"x": 1.0}  # passed through
    window.forget(session="a", worker="w")  # a worker leaving keeps the session's episodes
    assert window.recent("a")[0].size == 10
    window.forget(session="a")
    assert window.recent("a")[0].size == 0 and window.recent("b")[0].tolist() == [9.0]
    assert inner.forgotten == [{"session": "a", "worker": "w"}, {"session": "a"}]


def test_archive_bins_merge_cells_that_share_the_two_fields():
    table = {
        "cell:a": np.array([0, 1, 1, 0]),
        "cell:b": np.array([0, 0, 0, 0]),
        "cell:c": np.array([1, 2, 3, 4]),
        "visits": np.array([1, 2, 3, 4]),
        "times_chosen": np.array([0, 0, 1, 0]),
        "first_seen_step": np.array([5, 6, 7, 8]),
        "best_return": np.array([1.0, 5.0, 2.0, 0.0]),
        "best_length": np.array([1, 2, 3, 4]),
        "selection_probability": np.array([0.25] * 4),
        "midpoint_starts": np.array([0, 1, 0, 0]),
        "utility:u": np.array([1.0, 0.0, 1.0, 0.0]),
    }
    bins = archive_bins(table, "a", "b")
    assert (bins["cells"], bins["bins"], bins["utilities"]) == (4, 2, ["u"])
    cols = bins["columns"]
    # Bin (0, 0) holds cells 0 and 3, bin (1, 0) cells 1 and 2.
    assert (cols["x"], cols["y"], cols["cells"]) == ([0, 1], [0, 0], [2, 2])
    assert cols["visits"] == [5, 5] and cols["times_chosen"] == [0, 1]
    assert cols["best_return"] == [1.0, 5.0] and cols["best_length"] == [4, 3]
    assert cols["first_seen_step"] == [5, 6] and cols["midpoint_starts"] == [0, 1]
    assert cols["selection_probability"] == [0.5, 0.5]
    # Net values weighted by visits: (1 * 1 + 0 * 4) / 5 and (0 * 2 + 1 * 3) / 5.
    assert cols["utility:u"] == pytest.approx([0.2, 0.6])
    with pytest.raises(ValueError, match="x: expected a cell field .*got 'z'"):
        archive_bins(table, "z", "b")


@pytest.mark.parametrize("scale", [1, 2**40], ids=["packed keys", "spans past int64"])
def test_archive_bins_are_the_distinct_pairs(scale: int):
    rng = np.random.default_rng(1)
    xs, ys = rng.integers(-5, 5, 500) * scale, rng.integers(-3, 7, 500) * scale
    bins = archive_bins({"cell:a": xs, "cell:b": ys, "visits": np.ones(500, np.int64)}, "a", "b")
    cols = bins["columns"]
    pairs = list(zip(cols["x"], cols["y"]))
    assert pairs == sorted(set(zip(xs.tolist(), ys.tolist())))
    counts = {p: 0 for p in pairs}
    for p in zip(xs.tolist(), ys.tolist()):
        counts[p] += 1
    assert cols["cells"] == cols["visits"] == [counts[p] for p in pairs]


# ---------------------------------------------------------------------------------------------
# The API and its token, against a real server


def test_api_requires_the_token_and_answers_json(dashboard_server):
    base = f"http://{dashboard_server.http_address}"
    with recorder(dashboard_server.address, "w0") as rec:
        for _ in range(3):
            rec.record(*walk_chunk(PATHS["w0"]))
    # The store's levels and the episodes reach the metrics on the feeder's thread, after acks.
    assert dashboard_server.sessions.get("walk").drain(timeout=30)
    for path in ("/api/sessions", "/api/sessions/walk", "/api/sessions/walk/archive", "/metrics"):
        assert http(base + path)[0] == 401, path
        assert http(base + path, token="wrong")[0] == 401, path
    status, headers, body = http(base + "/")
    assert status == 401 and b'name="token"' in body  # the login form

    status, _, body = http(base + "/api/sessions", token=TOKEN)
    assert status == 200
    (row,) = json.loads(body)["sessions"]
    assert row["name"] == "walk" and row["store"] is True
    assert row["steps"] == 3 * len(PATHS["w0"]) and row["episodes"] == 3
    assert row["env_steps"] == 3 * len(PATHS["w0"])  # one environment: T×N = T

    status, _, body = http(base + "/api/sessions/walk", token=TOKEN)
    detail = json.loads(body)
    assert status == 200
    store = detail["store_info"]
    assert (store["cell_fields"], store["utilities"]) == (["x", "y"], [])
    assert store["levels"]["archive_cells"] == len({(x, y // 2) for x, y in PATHS["w0"]})
    assert store["levels"]["repository_capacity_bytes"] == CONFIG.repository_capacity_bytes
    (worker,) = detail["worker_table"]
    assert worker["worker_id"] == "w0" and worker["chunks"] == 3 and not worker["active"]
    assert 0 <= time.time() - worker["joined"] < 60
    assert detail["histograms"]["return"]["count"] == 3 and detail["histograms"]["window"] == 3
    # Each walk's return: its rewards, linspace(0, 1, T) in float32.
    walk_return = float(np.linspace(0.0, 1.0, len(PATHS["w0"]), dtype=np.float32).sum())
    assert detail["recent"]["episodes"] == 3
    assert detail["recent"]["return_mean"] == pytest.approx(walk_return, rel=1e-6)
    assert detail["recent"]["length_mean"] == len(PATHS["w0"])

    status, _, body = http(base + "/api/sessions/walk/archive", token=TOKEN)
    archive = json.loads(body)
    cells = set(zip(archive["columns"]["cell:x"], archive["columns"]["cell:y"]))
    assert cells == {(x, y // 2) for x, y in PATHS["w0"]}
    assert sum(archive["columns"]["visits"]) == 3 * len(PATHS["w0"])
    status, _, body = http(base + "/api/sessions/walk/archive?x=y&y=x", token=TOKEN)
    binned = json.loads(body)
    assert status == 200 and (binned["x"], binned["y"]) == ("y", "x")
    assert set(zip(binned["columns"]["y"], binned["columns"]["x"])) == cells
    assert http(base + "/api/sessions/walk/archive?x=z", token=TOKEN)[0] == 400
    assert http(base + "/api/sessions/nope", token=TOKEN)[0] == 404

    status, _, body = http(base + "/metrics", token=TOKEN)
    assert status == 200 and b'rollout_recorder_chunks_total{session="walk"} 3.0' in body

    # The login form: a wrong token is 401, the right one sets an HttpOnly cookie.
    assert http(base + "/login", data=b"token=wrong")[0] == 401
    status, headers, _ = http(base + "/login", data=f"token={TOKEN}".encode())
    assert status == 303
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    http(base + "/login", data=f"token={TOKEN}".encode(), opener=opener)
    assert http(base + "/api/sessions", opener=opener)[0] == 200


def test_stop_closes_the_dashboard(tmp_path: Path):
    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path),
            http_listen="127.0.0.1:0",
            durability=DurabilityOptions(enabled=False),
        )
    )
    url = f"http://{running.http_address}/api/sessions"
    assert http(url)[0] == 200
    running.stop(grace=0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_serve_http_listen_prints_the_dashboard_address(tmp_path: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "recorder_server", "serve", "--listen", "127.0.0.1:0"]
        + ["--data-dir", str(tmp_path), "--no-wal", "--http-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        dashboard = proc.stdout.readline().strip()
        assert dashboard.startswith("rollout-recorder dashboard at http://127.0.0.1:")
        assert proc.stdout.readline().startswith("rollout-recorder listening on ")
        url = dashboard.rsplit(" ", 1)[1]
        status, headers, body = http(url)
        assert status == 200 and b"static/app.js" in body
        assert http(url + "static/app.js")[0] == 200
        assert json.loads(http(url + "api/sessions")[2])["sessions"] == []
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


# ---------------------------------------------------------------------------------------------
# The page, in headless Chromium


def _browser():
    if not CHROMIUM.exists():
        pytest.skip(
            "/usr/bin/chromium is absent: apt-get install chromium chromium-driver (Debian's "
            "browser; the test downloads none)"
        )
    from selenium import webdriver  # the dev extra: a missing one is a failure, not a skip
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,2200",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


def _wait(driver, predicate, timeout: float = 20.0, what: str = ""):
    from selenium.common.exceptions import (
        JavascriptException,
        NoSuchElementException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    # A page being replaced (a form submitted, rows redrawn) is waited out, not a failure.
    ignored = (NoSuchElementException, StaleElementReferenceException, JavascriptException)
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=ignored).until(
        lambda d: predicate(d), message=what
    )


def _read(driver, css: str, data: str | None = None) -> str | None:
    """An element's text (or data attribute) read in one script: the page replaces its rows
    every poll, so an element found first may be gone by the time it is read."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "return e ? (arguments[1] ? e.dataset[arguments[1]] : e.textContent) : null;",
        css,
        data,
    )


def test_dashboard_in_headless_chromium(dashboard_server):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ARTIFACTS.mkdir(exist_ok=True)
    base = f"http://{dashboard_server.http_address}/"
    target = dashboard_server.address
    # The scripted walk: each worker walks its path twice.
    for worker, path in PATHS.items():
        with recorder(target, worker) as rec:
            for _ in range(2):
                rec.record(*walk_chunk(path))
    total_steps = 2 * sum(len(p) for p in PATHS.values())
    with RolloutRecorder(target=target, session="wide", worker_id="w", token=TOKEN) as rec:
        for c in range(WIDE_CHUNKS):
            rec.record(wide_chunk(c))

    driver = _browser()
    shots = []
    try:
        # A wrong token is refused: the form says so (and the server answered 401).
        driver.get(base)
        driver.find_element(By.ID, "token").send_keys("not-the-token")
        driver.find_element(By.ID, "submit").click()
        _wait(driver, lambda d: "Wrong token." in d.find_element(By.ID, "message").text)
        assert http(base + "api/sessions", token="not-the-token")[0] == 401
        shots.append(ARTIFACTS / "dashboard-wrong-token.png")
        driver.save_screenshot(str(shots[-1]))

        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "submit").click()
        _wait(
            driver,
            lambda d: (
                d.execute_script("return (window.rrDashboard && window.rrDashboard.polls) || 0") > 0
            ),
            what="the page never polled the API",
        )

        # The heatmap's non-empty cells are exactly the visited ones, and their visits add up
        # to the steps walked.
        def drawn():
            return driver.execute_script(
                "const h = window.rrDashboard.heatmap;"
                "return h && h.bins.length ? {x: h.x, y: h.y, colour: h.colour,"
                " bins: h.bins.map(b => [b.x, b.y, b.visits])} : null;"
            )

        _wait(driver, lambda d: drawn() is not None, what="the heatmap was never drawn")
        heat = drawn()
        assert (heat["x"], heat["y"], heat["colour"]) == ("x", "y", "visits")
        assert {(x, y) for x, y, _ in heat["bins"]} == VISITED
        assert sum(v for _, _, v in heat["bins"]) == total_steps

        # Hovering a cell shows its numbers.
        h = driver.execute_script(
            "const h = window.rrDashboard.heatmap; return {x0: h.x0, y1: h.y1, size: h.size,"
            " l: h.pad.l, t: h.pad.t};"
        )
        canvas = driver.find_element(By.ID, "heatmap")
        cx, cy = 9, 7 // 2  # the end of w0's walk
        px = h["l"] + (cx - h["x0"] + 0.5) * h["size"] - canvas.size["width"] / 2
        py = h["t"] + (h["y1"] - cy + 0.5) * h["size"] - canvas.size["height"] / 2
        ActionChains(driver).move_to_element_with_offset(canvas, int(px), int(py)).perform()
        tip = driver.find_element(By.ID, "tooltip")
        _wait(driver, lambda d: tip.is_displayed(), what="no tooltip on hover")
        assert f"x = {cx}, y = {cy}" in tip.text and "visits: 4" in tip.text
        shots.append(ARTIFACTS / "dashboard-heatmap.png")
        driver.find_element(By.ID, "store").screenshot(str(shots[-1]))

        # The live counters move while a worker records.
        def steps_shown() -> int:
            return int(_read(driver, '#counters [data-field="env_steps"]', "value"))

        assert steps_shown() == total_steps
        stop = threading.Event()

        def record_live() -> None:
            with recorder(target, "live") as rec:
                while not stop.is_set():
                    rec.record(*walk_chunk(PATHS["w0"]))
                    time.sleep(0.1)

        live = threading.Thread(target=record_live, daemon=True)
        live.start()
        try:
            seen = [steps_shown()]
            for _ in range(3):
                before = seen[-1]
                _wait(driver, lambda d, b=before: steps_shown() > b, what="steps did not move")
                seen.append(steps_shown())
            _wait(
                driver,
                lambda d: (
                    _read(d, '#sessions td[data-field="env_steps_s"]') not in ("–", "0")
                    and _read(d, '#sessions td[data-field="raw_mb_s"]') not in ("–", "0")
                ),
                what="no ingest rates shown",
            )
            _wait(
                driver,
                lambda d: (
                    d.execute_script("return document.querySelectorAll('#workers tbody tr').length")
                    == 3
                ),
                what="the live worker is not in the table",
            )
            shots.append(ARTIFACTS / "dashboard-live.png")
            driver.save_screenshot(str(shots[-1]))
        finally:
            stop.set()
            live.join(timeout=30)
        assert seen == sorted(seen) and len(set(seen)) == 4
        # Still exactly the visited cells after the live worker's walks (it revisits w0's).
        final = dashboard_server.sessions.get("walk").status().num_recorded_steps
        _wait(
            driver,
            lambda d: sum(v for _, _, v in (drawn() or {"bins": []})["bins"]) == final,
            what="the heatmap did not catch up with the recorded steps",
        )
        assert {(x, y) for x, y, _ in drawn()["bins"]} == VISITED
        check_user_units(driver, base, shots)
    finally:
        driver.quit()
    for shot in shots:
        assert shot.stat().st_size > 0
        print(f"screenshot: {shot}")


def check_user_units(driver, base: str, shots: list[Path]) -> None:
    """The "wide" session (N=3) opened by a link: env steps, the recent and all-time mean
    returns, histogram buckets over the returns' range, and the x axis toggle."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    # A deep link followed while logged out comes back to its session after the login.
    driver.delete_all_cookies()
    driver.get(base + "?session=wide")
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "submit").click()
    _wait(driver, lambda d: _read(d, "#session-name") == "wide", what="the link's session")
    assert driver.current_url.endswith("/?session=wide")
    headers = driver.execute_script(
        "return Array.from(document.querySelectorAll('#sessions th')).map(e => e.textContent)"
    )
    assert "env steps" in headers and "env steps/s" in headers and "steps" not in headers
    env_steps = WIDE_T * WIDE_N * WIDE_CHUNKS
    shown = _read(driver, '#counters [data-field="env_steps"]', "value")
    assert int(shown) == env_steps
    assert _read(driver, '#sessions tr[data-session="wide"] td[data-field="env_steps"]') == (
        f"{env_steps:,}"
    )

    # The recent mean (its window named on the page) beside the all-time one.
    recent = WIDE_RETURNS[-100:]
    assert _read(driver, "#recent-label") == "mean return, last 100 episodes"
    recent_shown = float(_read(driver, '#counters [data-field="recent_return_mean"]', "value"))
    assert recent_shown == pytest.approx(sum(recent) / len(recent))
    all_time = float(_read(driver, '#counters [data-field="return_mean"]', "value"))
    assert all_time == pytest.approx(sum(WIDE_RETURNS) / len(WIDE_RETURNS))

    # The return histogram's buckets span the returns (0 ... 49), not a fixed ladder.
    hist = driver.execute_script("return window.rrDashboard.detail.histograms")
    edges = hist["return"]["edges"]
    assert hist["window"] == len(WIDE_RETURNS)
    assert edges[0] <= min(WIDE_RETURNS) and max(WIDE_RETURNS) < edges[-1]
    assert 8 <= len(edges) - 1 <= 25 and edges[-1] - edges[0] <= 2 * max(WIDE_RETURNS)
    assert hist["return"]["counts"] == _bucket_counts(WIDE_RETURNS, edges)
    assert hist["length"]["edges"] == [WIDE_T, WIDE_T + 1]

    # The charts' x axis: env steps, or wall time when toggled (kept in the URL).
    def chart():
        return driver.execute_script("return window.rrDashboard.charts['chart-steps']")

    _wait(driver, lambda d: (chart() or {}).get("to") is not None, what="no chart drawn")
    assert chart()["axis"] == "env_steps" and 0 <= chart()["from"] <= env_steps
    history_x = driver.execute_script("return window.rrDashboard.detail.history.env_steps")
    assert history_x[-1] == env_steps and history_x == sorted(history_x)
    Select(driver.find_element(By.ID, "x-axis")).select_by_value("time")
    _wait(driver, lambda d: chart()["axis"] == "time", what="the x axis did not toggle")
    assert chart()["to"] > 1e9  # Unix seconds
    assert driver.current_url.endswith("/?session=wide&x=time")
    shots.append(ARTIFACTS / "dashboard-wide.png")
    driver.save_screenshot(str(shots[-1]))

    # The dataset sink's progress and lag: every episode written, none waiting, no lag left.
    def dataset(field: str) -> str:
        return _read(driver, f'#dataset [data-field="{field}"]', "value")

    _wait(
        driver,
        lambda d: (
            dataset("episodes_written") == str(len(WIDE_RETURNS))
            and dataset("episodes_waiting") == "0"
        ),
        what="the dataset did not catch up",
    )
    assert _read(driver, "#dataset-uri").endswith("dataset")
    assert 0 <= float(dataset("lag_seconds")) < 30 and dataset("write_failures") == "0"

    # Clicking another session puts it in the URL.
    driver.find_element(By.CSS_SELECTOR, '#sessions tr[data-session="walk"]').click()
    _wait(driver, lambda d: _read(d, "#session-name") == "walk", what="the click")
    assert driver.current_url.endswith("/?session=walk&x=time")
