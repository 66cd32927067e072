"""The ingest path with a trajectory store (cell keys and rewards read in place from the
session's window, stored episodes read back from its chunks only when first needed),
through a real Session and the feeder's own interface, against recording each episode
directly with record_episode."""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path

import numpy as np
import pytest
from conftest import core_chunk

from recorder_client.capture_types import (
    CellField,
    EpisodeOutcome,
    OutcomeRule,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.chunks import SessionConfig
from recorder_server.durability import snapshot
from recorder_server.episodes import WorkerTimeline
from recorder_server.ingest import ChunkEpisodes, EpisodeFeeder
from recorder_server.ingest.buffers import BufferPool
from recorder_server.ingest.held import EpisodeBound
from recorder_server.ingest.window import small_pages, widened
from recorder_server.metrics import NullMetrics
from recorder_server.session import Session
from recorder_server.store import EpisodeArrays, TrajectoryCaptureProcessor, build_store
from recorder_server.store.repository import encode_episode

_FIELDS = ("player_positions", "player_inventory")


class _Metrics:
    def inc(self, *args, **kwargs) -> None:
        pass

    def log_many(self, *args, **kwargs) -> None:
        pass

    def observe_episodes(self, *args, **kwargs) -> None:
        pass

    def observe_feed(self, *args, **kwargs) -> None:
        pass


def _config(capacity: int) -> TrajectoryTrainingConfiguration:
    return TrajectoryTrainingConfiguration(
        cell_fields=(
            CellField("player_positions", (0, 0), bucket=2, name="x"),
            CellField("player_positions", (0, 1), bucket=2, name="y"),
        ),
        utilities=(UtilityConfig("win_proximity", 0.9), UtilityConfig("slow", 0.5)),
        # Every episode a win or a loss, so both utilities take every episode's steps.
        outcome_rule=OutcomeRule("reward_sign", 0.25),
        repository_capacity_bytes=capacity,
    )


def _chunks(
    seed: int,
    count: int,
    length: int,
    num_envs: int,
    widen_from: int | None = None,
    key_shift: int = 3 << 33,
    long_until: int = 1,
    done_every: int | None = None,
):
    """Time-major chunks of a random walk, plus each chunk's finished (env, start, end);
    env 0's first episode lasts at least ``long_until`` chunks.

    With ``widen_from``, positions are int64 and rewards float64 throughout, and from that
    chunk on positions move by ``key_shift`` (beyond int16 keys; by default beyond int32)
    and rewards take values beyond float32."""
    rng = np.random.default_rng(seed)
    pos = np.zeros((num_envs, 2), dtype=np.int32)
    open_start = np.zeros(num_envs, dtype=np.int64)
    out = []
    for c in range(count):
        t0 = c * length
        steps = rng.integers(-1, 2, size=(length, num_envs, 2), dtype=np.int32)
        positions = np.empty((length, num_envs, 1, 2), dtype=np.int32)
        for t in range(length):
            pos += steps[t]
            positions[t, :, 0] = pos
        done = rng.random((length, num_envs)) < 0.08
        if done_every is not None:  # every episode done_every steps long
            done = (np.arange(t0, t0 + length) % done_every == done_every - 1)[:, None]
            done = np.repeat(done, num_envs, axis=1)
        if c < long_until:
            done[:, 0] = False  # env 0 runs one long episode across chunks
        reward = rng.choice(np.array([0.0, 0.5, 1.0], np.float32), (length, num_envs))
        if widen_from is not None:
            positions = positions.astype(np.int64)
            reward = reward.astype(np.float64)
            if c >= widen_from:
                positions[..., 0] += key_shift
                reward[:, ::2] += 0.1  # not a float32 value
        arrays = {
            "action": rng.integers(0, 5, size=(length, num_envs), dtype=np.int32),
            "reward": reward,
            "done": done,
            "state:player_positions": positions,
            "state:player_inventory": rng.integers(0, 3, (length, num_envs, 1, 4), np.int32),
        }
        env, t = np.nonzero(done.T)
        env = env.astype(np.int64)
        end = t.astype(np.int64) + t0 + 1
        start = np.empty_like(end)
        if end.size:
            start[1:] = end[:-1]
            first = np.ones(end.size, dtype=bool)
            first[1:] = env[1:] != env[:-1]
            start[first] = open_start[env[first]]
            last = np.ones(end.size, dtype=bool)
            last[:-1] = env[1:] != env[:-1]
            open_start[env[last]] = end[last]
        for e in np.flatnonzero(done[-1]):  # reset walks that ended
            pos[e] = 0
        out.append((t0, arrays, env, start, end))
    return out


def _episodes(whole: dict[str, np.ndarray], env, start, end) -> list[EpisodeArrays]:
    """The episodes (env, start, end) cut from a worker's concatenated chunks."""
    return [
        EpisodeArrays(
            actions=whole["action"][s:t, e],
            rewards=whole["reward"][s:t, e],
            states={
                "player_positions": whole["state:player_positions"][s:t, e],
                "player_inventory": whole["state:player_inventory"][s:t, e],
            },
        )
        for e, s, t in zip(env.tolist(), start.tolist(), end.tolist(), strict=True)
    ]


def _record_refusing_non_finite(reference, whole, env, start, end, step) -> int:
    """Record one chunk's episodes directly; 1 if the batch was refused (non-finite), else 0."""
    try:
        reference.record_episodes(_episodes(whole, env, start, end), step, outcomes=0)
    except ValueError as exc:
        assert "non-finite" in str(exc)
        return 1
    return 0


def _assert_same_trajectories(a, b) -> None:
    """Every stored trajectory of store ``a`` equals that of store ``b`` (same ids)."""
    for tid in a.trajectory_ids():
        x, y = a.trajectory(tid), b.trajectory(tid)
        np.testing.assert_array_equal(x.actions, y.actions)
        np.testing.assert_array_equal(x.rewards, y.rewards)
        for k in y.states:
            np.testing.assert_array_equal(x.states[k], y.states[k])


def _assert_same_checkpoints(a, b, chosen: int = 0) -> None:
    """Equal checkpoints, but for ``chosen`` more start choices counted in ``a``."""
    sa, sb = a.checkpoint_state(), b.checkpoint_state()
    assert sa["counters"] == sb["counters"]
    assert sa["arrays"].keys() == sb["arrays"].keys()
    for name, value in sa["arrays"].items():
        other = sb["arrays"][name]
        if name == "archive/times_chosen":
            assert int(value.sum()) - int(other.sum()) == chosen
        else:
            np.testing.assert_array_equal(value, other, err_msg=name)


def _session(config, workers=("w",)) -> Session:
    session = Session("s", SessionConfig(None, True, _FIELDS, config), NullMetrics())
    for worker in workers:
        session.join(worker, session.config)
    return session


def _session_fed(chunks, config, session=None, first=1) -> Session:
    """A real Session with a store, each chunk applied as the service applies it (drained
    after each, so that every chunk finds the buffers the last one gave back)."""
    session = session or _session(config)
    for i, (_, arrays, _, _, _) in enumerate(chunks):
        session.apply("w", core_chunk(first + i, arrays), log=False)
        assert session.drain(30)
    return session


def _reference(chunks, config, steps_per_chunk=None) -> TrajectoryCaptureProcessor:
    """Every chunk's episodes recorded one by one with record_episode."""
    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config))
    whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    steps_before = 0
    for _, arrays, env, start, end in chunks:
        for episode in _episodes(whole, env, start, end):
            reference.record_episode(episode, {}, steps_before, outcome=0)
        steps_before += arrays["reward"].size
    return reference


def _items(streams, order):
    """The feeder's input for chunks of several workers in ``order``: each chunk split on
    its worker's timeline as a session splits it; the step counts the env steps before it."""
    timelines = {}
    items, steps = [], 0
    for w, c in order:
        t0, arrays, _, _, _ = streams[w][c]
        timeline = timelines.setdefault(w, WorkerTimeline(f"w{w}", w))
        stored = core_chunk(c + 1, {k: v for k, v in arrays.items() if k != "done"})
        env, start, end, _ = timeline.add_chunk(arrays["done"], stored.arrays, stored.wire_bytes)
        assert timeline.chunks[-1].t0 == t0
        items.append(
            ChunkEpisodes(
                w, timeline.chunks[-1], dict(arrays), env, start, end, timeline.oldest_open(), steps
            )
        )
        steps += arrays["reward"].size
    return items, timelines


@pytest.mark.parametrize("capacity", [1 << 30, 6000])
@pytest.mark.parametrize(
    "widen_from, key_shift", [(None, 0), (5, 3 << 33), (5, 1 << 20)], ids=["narrow", "64", "32"]
)
def test_session_store_equals_recording_each_episode(capacity, widen_from, key_shift):
    """Chunks applied to a session (keys widening from int16 to int32 or int64, rewards to
    float64 mid-stream) leave the store as recording every finished episode directly."""
    chunks = _chunks(3, 14, 16, 8, widen_from, key_shift)
    config = _config(capacity)
    session = _session_fed(chunks, config)
    try:
        streamed, reference = session.processor, _reference(chunks, config)
        a, b = streamed.store, reference.store
        _assert_same_checkpoints(a, b)
        assert a.snapshot_potential("win_proximity", ["x", "y"]) == b.snapshot_potential(
            "win_proximity", ["x", "y"]
        )
        assert a.trajectory_ids() == b.trajectory_ids()
        assert a.trajectory_ids()  # something was stored
        _assert_same_trajectories(a, b)
        counters = streamed.runtime_state_dict()["counters"]
        assert counters == reference.runtime_state_dict()["counters"]
        if capacity < 1 << 20:
            assert a.checkpoint_state()["counters"]["episodes"] > len(a.trajectory_ids())
    finally:
        session.close()


def test_session_state_restored_mid_stream_continues_identically():
    """A session's state taken mid-stream (as a checkpoint takes it) and restored into a new
    session continues exactly as the session that never stopped."""
    chunks = _chunks(5, 12, 16, 8)
    config = _config(1 << 30)
    whole = _session_fed(chunks, config)
    half = _session_fed(chunks[:7], config)
    try:
        with half.lock:
            meta, blobs = snapshot.session_state(half)
            data = snapshot.pack(meta, blobs)
        meta, blobs = snapshot.unpack(data)
        restored = Session("s", snapshot.session_config(meta), NullMetrics())
        snapshot.restore_session(restored, meta, blobs)
        _session_fed(chunks[7:], config, session=restored, first=8)
        _assert_same_checkpoints(whole.processor.store, restored.processor.store)
        assert whole.status() == restored.status()
        restored.close()
    finally:
        whole.close()
        half.close()


def test_an_unkeyable_step_refuses_only_the_chunk_that_finishes_its_episode():
    """A NaN in a float cell field flags its step: the chunk in which an episode through that
    step finishes is not recorded (as record_episodes refuses a batch with a bad episode),
    and every other chunk's episodes are recorded as if recorded directly."""
    chunks = _chunks(7, 10, 16, 8)
    for _, arrays, _, _, _ in chunks:
        arrays["state:player_positions"] = arrays["state:player_positions"].astype(np.float64)
    chunks[3][1]["state:player_positions"][5, 2, 0, 1] = np.nan
    config = _config(1 << 30)
    session = _session_fed(chunks, config)
    try:
        reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config))
        whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
        refused = sum(
            _record_refusing_non_finite(reference, whole, env, start, end, i * 16 * 8)
            for i, (_, _, env, start, end) in enumerate(chunks)
        )
        assert refused == 1
        _assert_same_checkpoints(session.processor.store, reference.store)
    finally:
        session.close()


@pytest.mark.parametrize("batch", [1, 3, 100, None], ids=["1", "3", "all", "thread"])
def test_chunks_of_several_workers_recorded_together_equal_recording_them_in_turn(batch):
    """A backlog of several workers' chunks is recorded in one store call (None: as the
    feeder's thread batches whatever is queued). The store equals recording every chunk's
    episodes in submission order, each at its chunk's step; a worker with more environments
    joins late (the window gains rows) and one chunk with a non-finite reward is refused
    alone, as it would be if recorded on its own. Long first episodes make the window grow
    while several workers hold steps in it; nothing is held that no open episode needs."""
    length, sizes, count = 4, (8, 5, 40), 44
    streams = [_chunks(20 + w, count, length, n, long_until=40) for w, n in enumerate(sizes)]
    streams[1][4][1]["reward"][3, 2] = np.nan
    order = []  # (worker, chunk index): workers 0 and 1 interleaved, worker 2 from chunk 6
    for c in range(count):
        order += [(0, c), (1, c)] + ([(2, c - 6)] if c >= 6 else [])
    order += [(2, c) for c in range(count - 6, count)]
    config = _config(1 << 30)
    items, timelines = _items(streams, order)
    steps_before = [item.env_steps_before for item in items]

    streamed = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    feeder = EpisodeFeeder("s", streamed, _Metrics())
    try:
        if batch is None:
            for item in items:
                feeder.submit(item)
            assert feeder.drain(30)
        else:
            for i in range(0, len(items), batch):
                feeder.feed(items[i : i + batch])
        for w, timeline in timelines.items():
            held = feeder.held_chunks(w)
            assert held[0][0] + held[0][1] > timeline.oldest_open()
            assert held[-1][0] + held[-1][1] == timeline.t_total
    finally:
        feeder.close()

    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    wholes = [{k: np.concatenate([c[1][k] for c in s]) for k in s[0][1]} for s in streams]
    refused = sum(
        _record_refusing_non_finite(reference, wholes[w], *streams[w][c][2:], step)
        for (w, c), step in zip(order, steps_before, strict=True)
    )
    assert refused == 1

    a, b = streamed.store, reference.store
    _assert_same_checkpoints(a, b)
    assert a.trajectory_ids() == b.trajectory_ids()
    assert len(a.trajectory_ids()) > 10
    _assert_same_trajectories(a, b)
    assert streamed.runtime_state_dict()["counters"] == reference.runtime_state_dict()["counters"]


@pytest.mark.parametrize("capacity", [1 << 30, 6000])
def test_session_recycles_decode_buffers_without_corrupting_stored_episodes(capacity, monkeypatch):
    """Through Session.apply, a chunk's decode buffers go back to the pool once its cell keys
    and rewards are in the window (the chunk is held as the session keeps it, encoded): one
    buffer per array serves every chunk. The arrays nothing reads as they arrive (actions,
    other state fields) are not decoded before the ack at all (`ingest.verify` proves them
    later). The store still equals recording each episode directly, also when a small
    capacity makes it evict."""
    chunks = _chunks(11, 40, 16, 8)
    config = _config(capacity)
    taken: dict[str, set[int]] = {}
    session = _session(config)
    take = session.feeder.alloc

    def alloc(key, shape, dtype):
        arr = take(key, shape, dtype)
        taken.setdefault(key, set()).add(arr.__array_interface__["data"][0])
        return arr

    # A spy on the allocator the session decodes with.
    monkeypatch.setattr(session.feeder, "alloc", alloc)
    _session_fed(chunks, config, session=session)
    try:
        reused = ("reward", "state:player_positions")
        assert {k: len(taken[k]) for k in reused} == dict.fromkeys(reused, 1)
        later = ("action", "state:player_inventory")
        assert not set(later) & set(taken)
        assert [session.feeder.needs(k) for k in reused + later] == [True, True, False, False]
        a, b = session.processor.store, _reference(chunks, config).store
        assert a.trajectory_ids() == b.trajectory_ids()
        assert a.trajectory_ids()
        if capacity < 1 << 20:
            assert a.metrics()["repository_evictions"] > 0
        _assert_same_trajectories(a, b)
        _assert_same_checkpoints(a, b)
    finally:
        session.close()


def test_stored_episodes_are_encoded_only_when_first_needed():
    """Episodes the store keeps are read back from the session's chunks only when something
    needs them: a read encodes that one, a checkpoint all. Until then the repository counts
    a bound of each one's size (never below the size encoded)."""
    chunks = _chunks(13, 30, 16, 8)
    config = _config(1 << 30)
    session = _session_fed(chunks, config)
    try:
        store, reference = session.processor.store, _reference(chunks, config).store
        ids = store.trajectory_ids()
        assert ids == reference.trajectory_ids() and len(ids) > 3
        assert store.metrics()["repository_deferred"] == len(ids)
        bounded = store.metrics()["repository_bytes"]
        assert bounded >= reference.metrics()["repository_bytes"]

        x, y = store.trajectory(ids[1]), reference.trajectory(ids[1])
        assert store.metrics()["repository_deferred"] == len(ids) - 1
        np.testing.assert_array_equal(x.actions, y.actions)
        np.testing.assert_array_equal(x.rewards, y.rewards)
        for k in y.states:
            np.testing.assert_array_equal(x.states[k], y.states[k])
        assert store.metrics()["repository_bytes"] < bounded

        ref, prefix = store.sample_start()
        whole = reference.trajectory(ref.trajectory_id)
        np.testing.assert_array_equal(prefix.actions, whole.actions[: ref.step + 1])

        _assert_same_checkpoints(store, reference, chosen=1)
        assert store.metrics()["repository_deferred"] == 0
        assert store.metrics()["repository_bytes"] == reference.metrics()["repository_bytes"]
    finally:
        session.close()


def test_session_reset_encodes_the_episodes_read_from_its_chunks():
    """A reset drops the session's chunks: stored episodes still to be read from them are
    encoded first, and stay readable and equal to recording them directly."""
    chunks = _chunks(17, 20, 16, 8)
    config = _config(1 << 30)
    session = _session_fed(chunks, config)
    try:
        store, reference = session.processor.store, _reference(chunks, config).store
        assert store.metrics()["repository_deferred"] > 0
        session.reset()
        assert store.metrics()["repository_deferred"] == 0
        assert all(w.chunks_stored == 0 for w in session.status().workers)
        assert store.trajectory_ids() == reference.trajectory_ids()
        _assert_same_trajectories(store, reference)
    finally:
        session.close()


def test_episodes_longer_than_the_held_tail_are_counted_not_stored():
    """Under a small tail cap the oldest held chunks go even while an open episode needs
    them: that episode is counted as too long for the store and never recorded half, and
    every other episode is recorded as recording it directly would."""
    length, num_envs = 16, 8
    # Every episode 4 steps long, but env 0's first: 8 chunks and 4 steps.
    chunks = _chunks(23, 12, length, num_envs, long_until=8, done_every=4)
    config = _config(1 << 30)
    streamed = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    # A held chunk counts its room in the window (3,072 bytes here): at most a few fit.
    feeder = EpisodeFeeder("s", streamed, _Metrics(), max_tail_bytes=3000)
    items, _ = _items([chunks], [(0, c) for c in range(len(chunks))])
    try:
        # One chunk per call, as when the feeder keeps up (it trims after each call).
        for item in items:
            feeder.feed([item])
            assert len(feeder.held_chunks(0)) <= 2
    finally:
        feeder.close()
    assert feeder.truncated_episodes == 1

    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    for i, (_, _, env, start, end) in enumerate(chunks):
        episodes = [
            e for e in _episodes(whole, env, start, end) if e.length == 4
        ]  # all but env 0's long first episode
        assert len(episodes) == env.size - (i == 8)
        reference.record_episodes(episodes, i * length * num_envs, outcomes=0)
    _assert_same_checkpoints(streamed.store, reference.store)
    _assert_same_trajectories(streamed.store, reference.store)


def test_an_outcome_carries_to_the_chunk_that_ends_its_episode():
    """An episode's outcome is its last non-zero code, also when the chunk that ends it
    carries no codes (or only zeros) and the code came in an earlier chunk."""
    session = Session("o", SessionConfig(None, False, ()), NullMetrics())
    session.join("w", session.config)
    done = np.zeros((4, 3), bool)
    codes = np.zeros((4, 3), np.int8)
    codes[2, 0] = int(EpisodeOutcome.WIN)  # env 0: a win, its episode still open
    codes[1, 1] = int(EpisodeOutcome.LOSS)
    done[3, 1] = True  # env 1: ends here, a loss
    first = {"action": np.zeros((4, 3), np.int32), "reward": np.ones((4, 3), np.float32)}
    session.apply("w", core_chunk(1, {**first, "done": done, "outcome": codes}), log=False)
    done2 = np.zeros((4, 3), bool)
    done2[1, 0] = done2[2, 2] = True  # env 0 ends (the win), env 2 ends (no code: unknown)
    session.apply("w", core_chunk(2, {**first, "done": done2}), log=False)
    session.apply(
        "w",
        core_chunk(3, {**first, "done": done2, "outcome": np.zeros((4, 3), np.int8)}),
        log=False,
    )
    assert session.drain(30)
    counters = session.processor.runtime_state_dict()["counters"]
    session.close()
    assert counters["episodes_captured"] == 5
    assert counters["outcome_win"] == 1 and counters["outcome_loss"] == 1
    assert counters["outcome_unknown"] == 3


@pytest.mark.parametrize("width", [1, 3])
def test_one_or_three_cell_fields_through_a_session(width):
    """The window's grouping for other than two cell fields (its general code loop) equals
    recording every episode directly."""
    fields = (
        CellField("player_positions", (0, 0), bucket=2, name="x"),
        CellField("player_positions", (0, 1), bucket=2, name="y"),
        CellField("player_inventory", (0, 2), name="z"),
    )
    config = dataclasses.replace(_config(1 << 30), cell_fields=fields[:width])
    chunks = _chunks(29, 20, 16, 8)
    session = _session_fed(chunks, config)
    try:
        a, b = session.processor.store, _reference(chunks, config).store
        assert a.trajectory_ids() == b.trajectory_ids() and a.trajectory_ids()
        _assert_same_checkpoints(a, b)
    finally:
        session.close()


@pytest.mark.parametrize("share", [1.0, 0.6])
def test_deferred_episodes_evict_exactly_what_encoding_on_arrival_would(share):
    """A capacity of exactly the encoded episodes' total evicts nothing (though the bounds
    they count until encoded add up to more), and 60% of it evicts the same trajectories as
    recording every episode directly."""
    chunks = _chunks(19, 30, 16, 8)
    full = _reference(chunks, _config(1 << 30)).store.metrics()["repository_bytes"]
    config = _config(int(full * share))
    session = _session_fed(chunks, config)
    try:
        a, b = session.processor.store, _reference(chunks, config).store
        evictions = b.metrics()["repository_evictions"]
        assert (evictions > 0) == (share < 1)
        assert a.metrics()["repository_evictions"] == evictions
        assert a.trajectory_ids() == b.trajectory_ids()
        _assert_same_checkpoints(a, b)
    finally:
        session.close()


@pytest.mark.parametrize("length", [0, 1, 9, 700])
def test_deferred_size_bound_holds_for_incompressible_episodes(length):
    """The bound a deferred episode counts is never below its encoded size, even for
    random bytes (which zstd cannot shrink), and is not far above their raw size."""
    rng = np.random.default_rng(length)
    chunk_len, num_envs = max(length, 1), 3
    arrays = {
        "action": rng.integers(-(2**62), 2**62, (chunk_len, num_envs)),
        "reward": rng.random((chunk_len, num_envs)),
        "state:frames": rng.integers(0, 256, (chunk_len, num_envs, 3, 5, 7), dtype=np.uint8),
        "state:player_positions": rng.integers(0, 2**31, (chunk_len, num_envs, 1, 2)),
    }
    bound = EpisodeBound(core_chunk(1, arrays).arrays)(length)
    episode = EpisodeArrays(
        actions=arrays["action"][:length, 1],
        rewards=arrays["reward"][:length, 1],
        states={k[6:]: v[:length, 1] for k, v in arrays.items() if k.startswith("state:")},
    )
    size = len(encode_episode(episode))
    raw = length * (8 + 8 + 105 + 16)
    assert size <= bound <= raw + raw // 100 + 2048, (size, bound, raw)


def test_buffer_pool_when_full_keeps_the_shapes_in_use_and_drops_stale_ones():
    """A full pool lets the extra buffer go but keeps its warm ones of the shapes in use, also
    through a burst of releases; a shape no take asked for lately is dropped once full."""
    pool = BufferPool(max_bytes=4 * 800, stale_takes=4)
    # Each array's only holder is its dict, as for a held chunk (800 bytes each).
    old = [{"a": pool.take((100,), np.float64)} for _ in range(2)]
    new = [{"a": pool.take((10, 10), np.float64)} for _ in range(3)]
    # The first two (10, 10) buffers stay in the pool (alive: no fresh one takes their id).
    warm = {id(new[0]["a"]), id(new[1]["a"])}
    for batch in old + new + [{"a": np.empty((10, 10))}]:  # a burst: two over the cap
        pool.give_all(batch)
    # 4 of the 6 fit: the last two handed back were let go, the warm ones kept.
    assert pool.nbytes == 4 * 800
    assert pool.free_count((100,), np.float64) == 2 and pool.free_count((10, 10), np.float64) == 2
    # From now on only (10, 10) is taken: the (100,) buffers go once the pool is full.
    taken = [{"a": pool.take((10, 10), np.float64)} for _ in range(4)]
    assert len({id(b["a"]) for b in taken} & warm) == 2  # the warm ones, reused
    assert pool.nbytes == 2 * 800
    for batch in taken:
        pool.give_all(batch)
    assert pool.free_count((100,), np.float64) == 0 and pool.free_count((10, 10), np.float64) == 4
    assert pool.nbytes == 4 * 800


def test_ring_memory_is_zeroed_and_kept_off_huge_pages():
    """Ring arrays (8 MiB: numpy alone would ask for huge pages) are zeroed, writable and,
    where the kernel reports it, mapped with no-huge-pages advice."""
    ring = small_pages((2, 1024, 2048), np.int16)
    assert ring.shape == (2, 1024, 2048) and ring.dtype == np.int16
    assert not ring.any() and ring.flags.writeable and ring.flags.c_contiguous
    ring[1, 3, 5] = 7
    wide = widened(ring, np.int32)
    assert wide.dtype == np.int32 and wide[1, 3, 5] == 7 and int(wide.sum()) == 7
    assert small_pages((0, 4), np.float32).shape == (0, 4)
    smaps = Path("/proc/self/smaps")
    if not hasattr(mmap, "MADV_NOHUGEPAGE") or not smaps.exists():
        pytest.skip("no MADV_NOHUGEPAGE or /proc/self/smaps here")
    flags = {}
    start = None
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            start = (lo, hi)
        elif head == "VmFlags:" and start is not None:
            flags[start] = line.split()[1:]
    for arr in (ring, wide):
        address = arr.ctypes.data
        mapping = [f for (lo, hi), f in flags.items() if lo <= address < hi]
        assert mapping and "nh" in mapping[0], mapping


def test_ring_memory_when_the_kernel_refuses_the_advice(monkeypatch):
    """A kernel without transparent huge pages answers MADV_NOHUGEPAGE with EINVAL: the ring
    is still allocated, zeroed and usable (here an advice value every kernel refuses)."""
    monkeypatch.setattr(mmap, "MADV_NOHUGEPAGE", 12345, raising=False)
    ring = small_pages((3, 64, 128), np.float32)
    assert ring.shape == (3, 64, 128) and not ring.any() and ring.flags.writeable
    ring[2, 63, 127] = 1.5
    assert float(ring.sum()) == 1.5


def test_an_episode_keeps_its_outcome_across_chunks_sent_without_codes():
    from recorder_server.ingest.tails import EpisodeSums, cumsum

    sums = EpisodeSums(2)
    codes = np.zeros((3, 2), np.int64)
    codes[1, 0] = 1  # env 0 wins mid-episode; env 1 loses
    codes[2, 1] = 2
    none = np.empty(0, np.int64)
    first = sums.close(cumsum(np.ones((3, 2), np.float32)), codes, 0, none, none, none)
    assert first.outcomes.size == 0
    # The next chunk has no codes; env 0 ends at its step 1, env 1 at its step 0.
    env, start, end = np.array([0, 1]), np.array([0, 0]), np.array([5, 4])
    second = sums.close(cumsum(np.ones((2, 2), np.float32)), None, 3, env, start, end)
    assert second.outcomes.tolist() == [1, 2]
    assert second.returns.tolist() == [5.0, 4.0]
    # A new episode after the done starts without an outcome.
    third = sums.close(cumsum(np.ones((1, 2), np.float32)), None, 5, env[:1], end[:1], end[:1] + 1)
    assert third.outcomes.tolist() == [0]
