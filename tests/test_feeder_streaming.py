"""The feeder's streaming store path (cell-key columns and rewards per step, full arrays
fetched only for stored episodes) against recording each episode with record_episode."""

from __future__ import annotations

import mmap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from recorder_client import codec
from recorder_client.capture_types import (
    CellField,
    OutcomeRule,
    TrajectoryTrainingConfiguration,
    UtilityConfig,
)
from recorder_server.capture import TrajectoryCaptureProcessor, build_store
from recorder_server.episodes import EncodedArray, StoredChunk
from recorder_server.feeder import ChunkEpisodes, EpisodeFeeder
from recorder_server.store import EpisodeArrays


class _Metrics:
    def inc(self, *args, **kwargs) -> None:
        pass

    def log_many(self, *args, **kwargs) -> None:
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
        reference.record_episodes(_episodes(whole, env, start, end), None, step, outcomes=0)
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


def _stored(t0: int, arrays: dict[str, np.ndarray]) -> StoredChunk:
    encoded = {}
    for k, a in arrays.items():
        msg = codec.encode_array(a)
        encoded[k] = EncodedArray(a.dtype, a.shape, msg.codec, msg.data)
    return StoredChunk(t0, arrays["reward"].shape[0], encoded, 0)


@pytest.mark.parametrize("encoded", [False, True])
@pytest.mark.parametrize("capacity", [1 << 30, 6000])
@pytest.mark.parametrize(
    "widen_from, key_shift", [(None, 0), (5, 3 << 33), (5, 1 << 20)], ids=["narrow", "64", "32"]
)
def test_streaming_feeder_matches_record_episode(encoded, capacity, widen_from, key_shift):
    length, num_envs = 16, 8
    chunks = _chunks(3, 14, length, num_envs, widen_from, key_shift)
    config = _config(capacity)

    streamed = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    feeder = EpisodeFeeder("s", streamed, _Metrics())
    try:
        for i, (t0, arrays, env, start, end) in enumerate(chunks):
            stored = _stored(t0, arrays) if encoded else None
            steps = i * length * num_envs
            # A dict of its own: the feeder empties the one it is handed.
            feeder.submit(ChunkEpisodes(0, t0, dict(arrays), env, start, end, steps, stored))
        assert feeder.drain(30)
    finally:
        feeder.close()

    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    for i, (_, _, env, start, end) in enumerate(chunks):
        for e, s, t in zip(env.tolist(), start.tolist(), end.tolist(), strict=True):
            episode = EpisodeArrays(
                actions=whole["action"][s:t, e],
                rewards=whole["reward"][s:t, e],
                states={
                    "player_positions": whole["state:player_positions"][s:t, e],
                    "player_inventory": whole["state:player_inventory"][s:t, e],
                },
            )
            reference.record_episode(episode, {}, i * length * num_envs, outcome=0)

    a, b = streamed.store, reference.store
    state_a, state_b = a.checkpoint_state(), b.checkpoint_state()
    assert state_a["counters"] == state_b["counters"]
    assert state_a["arrays"].keys() == state_b["arrays"].keys()
    for name, value in state_a["arrays"].items():
        np.testing.assert_array_equal(value, state_b["arrays"][name], err_msg=name)
    assert a.snapshot_potential("win_proximity", ["x", "y"]) == b.snapshot_potential(
        "win_proximity", ["x", "y"]
    )
    assert a.trajectory_ids() == b.trajectory_ids()
    assert a.trajectory_ids()  # something was stored
    _assert_same_trajectories(a, b)
    assert streamed.runtime_state_dict()["counters"] == reference.runtime_state_dict()["counters"]
    if capacity < 1 << 20:
        assert state_a["counters"]["episodes"] > len(a.trajectory_ids())


def test_streaming_feeder_restore_tails_continues_identically():
    """tails_state / restore_tails mid-stream (as a checkpoint does) changes nothing."""
    length, num_envs = 16, 8
    chunks = _chunks(5, 12, length, num_envs)
    config = _config(1 << 30)

    def feed(processor, feeder, part):
        for i, (t0, arrays, env, start, end) in part:
            feeder.submit(ChunkEpisodes(0, t0, arrays, env, start, end, i * length * num_envs))
        assert feeder.drain(30)

    one = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    f1 = EpisodeFeeder("a", one, _Metrics())
    feed(one, f1, list(enumerate(chunks)))
    f1.close()

    two = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    f2 = EpisodeFeeder("b", two, _Metrics())
    feed(two, f2, list(enumerate(chunks))[:7])
    tails = f2.tails_state()

    timeline = SimpleNamespace(index=0, chunks=[_stored(c[0], c[1]) for c in chunks[:7]])
    f2.restore_tails({k: {n: v.copy() for n, v in d.items()} for k, d in tails.items()}, [timeline])
    feed(two, f2, list(enumerate(chunks))[7:])
    f2.close()
    sa, sb = one.store.checkpoint_state(), two.store.checkpoint_state()
    for name, value in sa["arrays"].items():
        np.testing.assert_array_equal(value, sb["arrays"][name], err_msg=name)


def test_streaming_feeder_refuses_only_batches_with_an_unkeyable_step():
    """A NaN in a float cell field flags its step: the batch of the chunk in which an episode
    through that step finishes is refused (as record_episodes refuses a batch with a bad
    episode), and every other chunk's episodes are recorded as if recorded directly."""
    length, num_envs = 16, 8
    chunks = _chunks(7, 10, length, num_envs)
    for _, arrays, _, _, _ in chunks:
        arrays["state:player_positions"] = arrays["state:player_positions"].astype(np.float64)
    chunks[3][1]["state:player_positions"][5, 2, 0, 1] = np.nan
    config = _config(1 << 30)

    streamed = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    feeder = EpisodeFeeder("s", streamed, _Metrics())
    try:
        for i, (t0, arrays, env, start, end) in enumerate(chunks):
            steps = i * length * num_envs
            feeder.submit(ChunkEpisodes(0, t0, arrays, env, start, end, steps))
        assert feeder.drain(30)
    finally:
        feeder.close()

    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    refused = sum(
        _record_refusing_non_finite(reference, whole, env, start, end, i * length * num_envs)
        for i, (_, _, env, start, end) in enumerate(chunks)
    )
    assert refused == 1
    sa, sb = streamed.store.checkpoint_state(), reference.store.checkpoint_state()
    assert sa["counters"] == sb["counters"]
    for name, value in sa["arrays"].items():
        np.testing.assert_array_equal(value, sb["arrays"][name], err_msg=name)


@pytest.mark.parametrize("batch", [1, 3, 100, None], ids=["1", "3", "all", "thread"])
def test_chunks_of_several_workers_recorded_together_equal_recording_them_in_turn(batch):
    """A backlog of several workers' chunks is recorded in one store call (None: as the
    feeder's thread batches whatever is queued). The store equals recording every chunk's
    episodes in submission order, each at its chunk's step; a worker with more environments
    joins late (the session's ring gains rows) and one chunk with a non-finite reward is
    refused alone, as it would be if recorded on its own. Long first episodes make the ring
    grow while several workers hold steps in it."""
    length, sizes, count = 4, (8, 5, 40), 44
    streams = [_chunks(20 + w, count, length, n, long_until=40) for w, n in enumerate(sizes)]
    streams[1][4][1]["reward"][3, 2] = np.nan
    order = []  # (worker, chunk index): workers 0 and 1 interleaved, worker 2 from chunk 6
    for c in range(count):
        order += [(0, c), (1, c)] + ([(2, c - 6)] if c >= 6 else [])
    order += [(2, c) for c in range(count - 6, count)]
    config = _config(1 << 30)

    streamed = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    feeder = EpisodeFeeder("s", streamed, _Metrics())
    items, steps_before = [], []
    total = 0
    for w, c in order:
        t0, arrays, env, start, end = streams[w][c]
        items.append(ChunkEpisodes(w, t0, arrays, env, start, end, total))
        steps_before.append(total)
        total += length * sizes[w]
    try:
        if batch is None:
            for item in items:
                feeder.submit(item)
            assert feeder.drain(30)
        else:
            for i in range(0, len(items), batch):
                feeder._process_batch(items[i : i + batch])
        compacted = 0
        for tails in feeder._workers.values():  # nothing held that no open episode needs
            assert tails.chunks[0].t0 + length > tails.open_start.min()
            for chunk in tails.chunks:
                # An old chunk keeps only about the environments whose open episode needs it.
                need = np.count_nonzero(tails.open_start < chunk.t0 + length)
                assert chunk.arrays["reward"].shape[1] < 8 * need
                compacted += chunk.columns is not None
        assert compacted
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
    sa, sb = a.checkpoint_state(), b.checkpoint_state()
    assert sa["counters"] == sb["counters"]
    for name, value in sa["arrays"].items():
        np.testing.assert_array_equal(value, sb["arrays"][name], err_msg=name)
    assert a.trajectory_ids() == b.trajectory_ids()
    assert len(a.trajectory_ids()) > 10
    _assert_same_trajectories(a, b)
    assert streamed.runtime_state_dict()["counters"] == reference.runtime_state_dict()["counters"]


_FIELDS = ("player_positions", "player_inventory")


def _session_fed(chunks, config, alloc_spy=None):
    """A real Session with a store, each chunk applied as the service applies it (drained
    after each, so that every chunk finds the buffers the last one gave back)."""
    from recorder_client._proto import recorder_pb2 as pb
    from recorder_server.metrics import NullMetrics
    from recorder_server.session import Session, SessionConfig

    session = Session("s", SessionConfig(None, True, _FIELDS, config), NullMetrics())
    session.join("w", session.config)
    if alloc_spy is not None:
        session.feeder.alloc = alloc_spy(session.feeder.buffers.take)
    for i, (_, arrays, _, _, _) in enumerate(chunks):
        msg = pb.Chunk(sequence=i + 1)
        for name in ("action", "reward", "done"):
            getattr(msg, name).CopyFrom(codec.encode_array(arrays[name]))
        for name in _FIELDS:
            msg.states.append(
                pb.NamedArray(name=name, array=codec.encode_array(arrays[f"state:{name}"]))
            )
        session.apply("w", msg, 1 << 30, log=False)
        assert session.feeder.drain(30)
    return session


def _reference(chunks, config) -> TrajectoryCaptureProcessor:
    """Every chunk's episodes recorded one by one with record_episode."""
    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config))
    whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    steps_before = 0
    for _, arrays, env, start, end in chunks:
        for e, s, t in zip(env.tolist(), start.tolist(), end.tolist(), strict=True):
            episode = EpisodeArrays(
                actions=whole["action"][s:t, e],
                rewards=whole["reward"][s:t, e],
                states={n: whole[f"state:{n}"][s:t, e] for n in _FIELDS},
            )
            reference.record_episode(episode, {}, steps_before, outcome=0)
        steps_before += arrays["reward"].size
    return reference


def _assert_same_checkpoints(a, b, chosen: int = 0) -> None:
    """Equal checkpoints, but for ``chosen`` more start choices counted in ``a``."""
    sa, sb = a.checkpoint_state(), b.checkpoint_state()
    assert sa["counters"] == sb["counters"]
    for name, value in sa["arrays"].items():
        other = sb["arrays"][name]
        if name == "archive/times_chosen":
            assert int(value.sum()) - int(other.sum()) == chosen
        else:
            np.testing.assert_array_equal(value, other, err_msg=name)


@pytest.mark.parametrize("capacity", [1 << 30, 6000])
def test_session_recycles_decode_buffers_without_corrupting_stored_episodes(capacity):
    """Through Session.apply, a chunk's decode buffers go back to the pool once its cell keys
    and rewards are in the ring (the chunk is held as the session keeps it, encoded): one
    buffer per pooled array serves every chunk. The store still equals recording each episode
    directly, also when a small capacity makes it evict."""
    length, num_envs = 16, 8
    chunks = _chunks(11, 40, length, num_envs)
    config = _config(capacity)
    taken = []

    def spy(take):
        def alloc(shape, dtype):
            arr = take(shape, dtype)
            taken.append(arr.__array_interface__["data"][0])
            return arr

        return alloc

    session = _session_fed(chunks, config, spy)
    try:
        # action, reward and the two state fields (done is decoded apart).
        assert len(taken) == 4 * len(chunks) and len(set(taken)) <= 4
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
        repository = store._repository
        ids = store.trajectory_ids()
        assert ids == reference.trajectory_ids() and len(ids) > 3
        assert repository.deferred == len(ids)
        bounded = store.metrics()["repository_bytes"]
        assert bounded >= reference.metrics()["repository_bytes"]

        x, y = store.trajectory(ids[1]), reference.trajectory(ids[1])
        assert repository.deferred == len(ids) - 1
        np.testing.assert_array_equal(x.actions, y.actions)
        np.testing.assert_array_equal(x.rewards, y.rewards)
        for k in y.states:
            np.testing.assert_array_equal(x.states[k], y.states[k])
        assert store.metrics()["repository_bytes"] < bounded

        ref, prefix = store.sample_start()
        whole = reference.trajectory(ref.trajectory_id)
        np.testing.assert_array_equal(prefix.actions, whole.actions[: ref.step + 1])

        _assert_same_checkpoints(store, reference, chosen=1)
        assert repository.deferred == 0
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
        assert store._repository.deferred > 0
        session.reset()
        assert store._repository.deferred == 0
        assert all(not tl.chunks for tl in session.workers.values())
        assert store.trajectory_ids() == reference.trajectory_ids()
        _assert_same_trajectories(store, reference)
    finally:
        session.close()


@pytest.mark.parametrize("encoded", [False, True])
def test_episodes_longer_than_the_held_tail_are_counted_not_stored(encoded):
    """Under a small tail cap the oldest held chunks go even while an open episode needs
    them: that episode is counted as too long for the store and never recorded half, and
    every other episode is recorded as recording it directly would."""
    length, num_envs = 16, 8
    # Every episode 4 steps long, but env 0's first: 8 chunks and 4 steps.
    chunks = _chunks(23, 12, length, num_envs, long_until=8, done_every=4)
    config = _config(1 << 30)
    streamed = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    # A held encoded chunk counts its room in the ring (3,072 bytes here), a decoded one its
    # bytes (512 once only env 0's column is kept): at most a few chunks fit.
    feeder = EpisodeFeeder("s", streamed, _Metrics(), max_tail_bytes=3000)
    try:
        # One chunk per call, as when the feeder keeps up (it trims after each call).
        for i, (t0, arrays, env, start, end) in enumerate(chunks):
            stored = _stored(t0, arrays) if encoded else None
            steps = i * length * num_envs
            item = ChunkEpisodes(0, t0, dict(arrays), env, start, end, steps, stored)
            feeder._process_batch([item])
            assert len(feeder._workers[0].chunks) <= 2
    finally:
        feeder.close()
    assert feeder.truncated_episodes == 1

    reference = TrajectoryCaptureProcessor(config, _Metrics(), build_store(config, seed=1))
    whole = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    for i, (_, _, env, start, end) in enumerate(chunks):
        episodes = [
            EpisodeArrays(
                actions=whole["action"][s:t, e],
                rewards=whole["reward"][s:t, e],
                states={n: whole[f"state:{n}"][s:t, e] for n in _FIELDS},
            )
            for e, s, t in zip(env.tolist(), start.tolist(), end.tolist(), strict=True)
            if t - s == 4  # all but env 0's long first episode
        ]
        assert len(episodes) == env.size - (i == 8)
        reference.record_episodes(episodes, None, i * length * num_envs, outcomes=0)
    _assert_same_checkpoints(streamed.store, reference.store)
    _assert_same_trajectories(streamed.store, reference.store)


@pytest.mark.parametrize("width", [1, 3])
def test_one_or_three_cell_fields_through_a_session(width):
    """The window's grouping for other than two cell fields (its general code loop) equals
    recording every episode directly."""
    import dataclasses

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
    from recorder_server.feeder import _BoundCache
    from recorder_server.store.repository import encode_episode

    rng = np.random.default_rng(length)
    chunk_len, num_envs = max(length, 1), 3
    arrays = {
        "action": rng.integers(-(2**62), 2**62, (chunk_len, num_envs)),
        "reward": rng.random((chunk_len, num_envs)),
        "state:frames": rng.integers(0, 256, (chunk_len, num_envs, 3, 5, 7), dtype=np.uint8),
        "state:player_positions": rng.integers(0, 2**31, (chunk_len, num_envs, 1, 2)),
    }
    bound = _BoundCache(_stored(0, arrays).arrays)(length)
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
    from recorder_server.feeder import BufferPool

    pool = BufferPool(max_bytes=4 * 800, stale_takes=4)
    # Each array's only holder is its dict, as for a held chunk (800 bytes each).
    old = [{"a": pool.take((100,), np.float64)} for _ in range(2)]
    new = [{"a": pool.take((10, 10), np.float64)} for _ in range(3)]
    for batch in old + new + [{"a": np.empty((10, 10))}]:  # a burst: two over the cap
        pool.give_all(batch)
    # 4 of the 6 fit: the last two handed back were let go, the warm ones kept.
    assert pool._bytes == 4 * 800
    assert {(k[1], len(v)) for k, v in pool._free.items()} == {((100,), 2), ((10, 10), 2)}
    # From now on only (10, 10) is taken: the (100,) buffers go once the pool is full.
    warm = {id(a) for a in pool._free[("<f8", (10, 10))]}  # alive: no fresh one has their id
    taken = [{"a": pool.take((10, 10), np.float64)} for _ in range(4)]
    assert len({id(b["a"]) for b in taken} & warm) == 2  # the warm ones, reused
    assert pool._bytes == 2 * 800
    for batch in taken:
        pool.give_all(batch)
    assert {k[1]: len(v) for k, v in pool._free.items()} == {(10, 10): 4}
    assert pool._bytes == 4 * 800


def test_ring_memory_is_zeroed_and_kept_off_huge_pages():
    """Ring arrays (8 MiB: numpy alone would ask for huge pages) are zeroed, writable and,
    where the kernel reports it, mapped with no-huge-pages advice."""
    from recorder_server.feeder import _small_pages, _widened

    ring = _small_pages((2, 1024, 2048), np.int16)
    assert ring.shape == (2, 1024, 2048) and ring.dtype == np.int16
    assert not ring.any() and ring.flags.writeable and ring.flags.c_contiguous
    ring[1, 3, 5] = 7
    wide = _widened(ring, np.int32)
    assert wide.dtype == np.int32 and wide[1, 3, 5] == 7 and int(wide.sum()) == 7
    assert _small_pages((0, 4), np.float32).shape == (0, 4)
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
    from recorder_server.feeder import _small_pages

    monkeypatch.setattr(mmap, "MADV_NOHUGEPAGE", 12345, raising=False)
    ring = _small_pages((3, 64, 128), np.float32)
    assert ring.shape == (3, 64, 128) and not ring.any() and ring.flags.writeable
    ring[2, 63, 127] = 1.5
    assert float(ring.sum()) == 1.5
