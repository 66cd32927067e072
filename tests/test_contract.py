"""The producer contract end to end: terminated / truncated, the valid mask,
nested observations and final observations, through a real server, finish() (both of its
stream forms), a kill -9 with WAL replay and a checkpoint restart.

The truth is computed here by a plain loop per worker and env over the arrays sent, by the
documented rules: an episode is the valid rows from its first valid one up to and including
its done row; invalid rows belong to no episode; its flags and final observation are those
of its last step (done only: terminated = done, truncated False); an unfinished tail has
both flags False and a final observation of zeros.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from conftest import RestartableServer
from factoriax_reference import load_factoriax_recorder

from recorder_client import RolloutRecorder, unflatten
from recorder_client._finish import assemble
from recorder_client._proto import recorder_pb2 as pb

N = 3
# The observation: {"pos": Box float32 (2,), "inv": Tuple(Box uint8 (3,), Discrete int64)},
# flattened by record() to these fields (name, trailing shape, dtype).
LEAVES = [
    ("obs.pos", (2,), np.dtype(np.float32)),
    ("obs.inv.0", (3,), np.dtype(np.uint8)),
    ("obs.inv.1", (), np.dtype(np.int64)),
]


def _nest(values: dict[str, np.ndarray]):
    return {"pos": values["obs.pos"], "inv": (values["obs.inv.0"], values["obs.inv.1"])}


class Producer:
    """Random chunks of one worker that keep the contract's rules across chunks: invalid
    rows only where the env's open episode has no step yet (its start, right after a done,
    at chunk boundaries), both flags true at once sometimes."""

    def __init__(self, seed: int, *, flags: bool | str = True, valid: bool = True) -> None:
        """``flags``: chunks with terminated and truncated (True), done only (False), or
        one then the other ("mixed")."""
        self.rng = np.random.default_rng(seed)
        self.flags, self.valid = flags, valid
        self.open_empty = np.ones(N, dtype=bool)
        self.chunks: list[dict] = []

    def chunk(self, length: int) -> dict:
        rng = self.rng
        valid = np.ones((length, N), dtype=bool)
        term = np.zeros((length, N), dtype=bool)
        trunc = np.zeros((length, N), dtype=bool)
        for e in range(N):
            empty = self.open_empty[e]
            for t in range(length):
                if self.valid and empty and rng.random() < 0.4:
                    valid[t, e] = False
                    continue
                empty = False
                if rng.random() < 0.25:
                    kind = rng.integers(3)
                    term[t, e] = kind in (0, 2)
                    trunc[t, e] = kind in (1, 2)
                    empty = True
            self.open_empty[e] = empty
        obs = {
            name: rng.integers(0, 200, size=(length, N, *shape)).astype(dtype)
            for name, shape, dtype in LEAVES
        }
        final = {
            name: rng.integers(0, 200, size=(length, N, *shape)).astype(dtype)
            for name, shape, dtype in LEAVES
        }
        arrays = {
            "action": rng.integers(0, 9, size=(length, N, 2)).astype(np.int32),
            "reward": rng.normal(size=(length, N)).astype(np.float32),
            "obs": obs,
            "final": final,
            "valid": valid,
        }
        if self.flags is True or (self.flags == "mixed" and len(self.chunks) % 2 == 0):
            arrays["terminated"], arrays["truncated"] = term, trunc
        else:
            arrays["done"] = term | trunc
        self.chunks.append(arrays)
        return arrays

    def send(self, recorder: RolloutRecorder, arrays: dict) -> None:
        chunk = {
            k: v for k, v in arrays.items() if k in ("action", "reward", "terminated", "truncated")
        }
        if "done" in arrays:
            chunk["done"] = arrays["done"]
        if self.valid:
            chunk["valid"] = arrays["valid"]
        chunk["obs"] = _nest(arrays["obs"])
        chunk["final_obs"] = _nest(arrays["final"])
        assert recorder.record(chunk)


def truth(producers: list[Producer], pad_incomplete: bool = True) -> list[dict]:
    """Every episode of the producers, worker by worker (join order), env by env, in time
    order, by a plain loop."""
    episodes = []
    for w, prod in enumerate(producers):
        cat = {
            "action": np.concatenate([c["action"] for c in prod.chunks]),
            "reward": np.concatenate([c["reward"] for c in prod.chunks]),
            "valid": np.concatenate([c["valid"] for c in prod.chunks]),
        }
        # A chunk recorded with done only reads terminated = done, truncated False.
        cat["terminated"] = np.concatenate(
            [c.get("terminated", c.get("done")) for c in prod.chunks]
        )
        cat["truncated"] = np.concatenate(
            [c.get("truncated", np.zeros_like(c.get("done"))) for c in prod.chunks]
        )
        cat["done"] = cat["terminated"] | cat["truncated"]
        obs = {n: np.concatenate([c["obs"][n] for c in prod.chunks]) for n, _, _ in LEAVES}
        fin = {n: np.concatenate([c["final"][n] for c in prod.chunks]) for n, _, _ in LEAVES}
        total = cat["action"].shape[0]
        for e in range(N):
            steps: list[int] = []
            for t in range(total):
                if not cat["valid"][t, e]:
                    assert not steps, "the producer broke the rule"
                    continue
                steps.append(t)
                if cat["done"][t, e]:
                    term, trunc = bool(cat["terminated"][t, e]), bool(cat["truncated"][t, e])
                    final = {n: fin[n][t, e] for n in fin}
                    episodes.append(_episode(w, e, steps, cat, obs, term, trunc, final, True))
                    steps = []
            if steps and pad_incomplete:
                zeros = {n: np.zeros_like(fin[n][0, e]) for n in fin}
                episodes.append(_episode(w, e, steps, cat, obs, False, False, zeros, False))
    return episodes


def _episode(w, e, steps, cat, obs, term, trunc, final, done) -> dict:
    idx = np.asarray(steps)
    return {
        "worker": w,
        "env": e,
        "start": steps[0],
        "done": done,
        "action": cat["action"][idx, e],
        "reward": cat["reward"][idx, e],
        "obs": {n: obs[n][idx, e] for n in obs},
        "terminated": term,
        "truncated": trunc,
        "final": final,
    }


def check(out, expected: list[dict]) -> None:
    assert out.num_episodes == len(expected)
    assert out.lengths.tolist() == [len(ep["action"]) for ep in expected]
    assert out.episode_worker.tolist() == [ep["worker"] for ep in expected]
    assert out.episode_env.tolist() == [ep["env"] for ep in expected]
    assert out.episode_start.tolist() == [ep["start"] for ep in expected]
    assert out.episode_done.tolist() == [ep["done"] for ep in expected]
    assert out.episode_terminated.tolist() == [ep["terminated"] for ep in expected]
    assert out.episode_truncated.tolist() == [ep["truncated"] for ep in expected]
    assert set(out.final_states) == {n for n, _, _ in LEAVES}
    for name, _, dtype in LEAVES:
        assert out.states[name].dtype == dtype and out.final_states[name].dtype == dtype
    for b, ep in enumerate(expected):
        n = len(ep["action"])
        np.testing.assert_array_equal(out.actions[b, :n], ep["action"])
        np.testing.assert_array_equal(out.rewards[b, :n], ep["reward"])
        assert not out.actions[b, n:].any() and not out.rewards[b, n:].any()
        for name in ep["obs"]:
            np.testing.assert_array_equal(out.states[name][b, :n], ep["obs"][name])
            assert not out.states[name][b, n:].any()
            np.testing.assert_array_equal(out.final_states[name][b], ep["final"][name])


def _record(target: str, session: str, producers: list[Producer], lengths: list[int]):
    recorders = [RolloutRecorder(target=target, session=session) for _ in producers]
    try:
        for length in lengths:
            for prod, rec in zip(producers, recorders):
                prod.send(rec, prod.chunk(length))
        for rec in recorders:
            rec.flush()
    finally:
        for rec in recorders[1:]:
            rec.close()
    return recorders[0]


def _parts_finish(rec: RolloutRecorder, pad_incomplete: bool = True, part_bytes: int = 0):
    """finish() through gathered ArrayParts (the form of a client that does not gather)."""
    request = pb.FinishRequest(
        session=rec.session, pad_incomplete=pad_incomplete, max_part_bytes=part_bytes
    )
    return assemble(rec._connection.download("Finish", request))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_finish_matches_the_truth(target, seed):
    producers = [
        Producer(seed * 10),
        Producer(seed * 10 + 1, flags=False),  # done only: terminated = done
        Producer(seed * 10 + 2, valid=False),  # no mask
        Producer(seed * 10 + 3, flags="mixed"),
    ]
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 9, size=5)]
    rec = _record(target, f"s{seed}", producers, lengths)
    try:
        expected = truth(producers)
        assert any(ep["terminated"] and ep["truncated"] for ep in expected)
        assert any(not p["valid"].all() for prod in producers for p in prod.chunks)
        check(rec.finish(), expected)  # the client gathers from the chunks' frames
        check(_parts_finish(rec), expected)  # the server gathers
        check(_parts_finish(rec, part_bytes=7), expected)  # final states in many parts
        short = truth(producers, pad_incomplete=False)
        check(rec.finish(pad_incomplete=False), short)
        check(_parts_finish(rec, pad_incomplete=False), short)
    finally:
        rec.close()


def test_invalid_rows_at_chunk_boundaries(target):
    """Invalid rows that end one chunk and start the next, after a done in the chunk before,
    and an env whose first rows are invalid: none of them is in any episode."""
    rec = RolloutRecorder(target=target, session="edges")
    valid1 = np.array([[False, True], [True, True], [False, False]])
    done1 = np.array([[False, False], [True, True], [False, False]])
    valid2 = np.array([[False, False], [True, True]])
    done2 = np.array([[False, False], [False, True]])
    obs1 = np.arange(6, dtype=np.int64).reshape(3, 2)
    obs2 = 10 + np.arange(4, dtype=np.int64).reshape(2, 2)
    for valid, done, obs in ((valid1, done1, obs1), (valid2, done2, obs2)):
        t = valid.shape[0]
        rec.record(
            {
                "action": obs.astype(np.int32),
                "reward": np.ones((t, 2), np.float32),
                "terminated": done,
                "truncated": np.zeros_like(done),
                "valid": valid,
                "obs": obs,
            }
        )
    out = rec.finish()
    rec.close()
    # env 0: step 1 (done), then a tail at step 4; env 1: steps 0-1 (done), then step 4.
    assert out.episode_env.tolist() == [0, 0, 1, 1]
    assert out.episode_start.tolist() == [1, 4, 0, 4]
    assert out.lengths.tolist() == [1, 1, 2, 1]
    assert out.states["obs"].tolist() == [[2, 0], [12, 0], [1, 3], [13, 0]]
    assert out.episode_terminated.tolist() == [True, False, True, True]
    assert out.episode_done.tolist() == [True, False, True, True]
    assert unflatten(out.states) is out.states["obs"]
    assert out.final_states == {}


def test_kill_9_and_restart_keep_the_contract(tmp_path: Path):
    """The flags, the mask and the final states survive WAL replay after a kill -9, and a
    checkpoint at a clean stop; the open episodes' state does too (a chunk after the restart
    may begin with invalid rows only where an episode had just ended)."""
    server = RestartableServer(tmp_path / "data").start()
    producers = [Producer(7), Producer(8, flags=False)]
    try:
        recorders = [RolloutRecorder(target=server.address, session="k") for _ in producers]
        for length in (4, 6, 3):
            for prod, rec in zip(producers, recorders):
                prod.send(rec, prod.chunk(length))
        for rec in recorders:
            rec.flush()
        server.kill()  # SIGKILL: everything acknowledged is in the log only
        server.start()
        for length in (5, 2):  # the recorders reconnect and go on
            for prod, rec in zip(producers, recorders):
                prod.send(rec, prod.chunk(length))
        for rec in recorders:
            rec.flush()
        check(recorders[0].finish(), truth(producers))
        assert server.stop() == 0  # a clean stop checkpoints
        server.start()
        for prod, rec in zip(producers, recorders):
            prod.send(rec, prod.chunk(4))
            rec.flush()
        expected = truth(producers)
        check(recorders[0].finish(), expected)
        check(_parts_finish(recorders[1]), expected)
        for rec in recorders:
            rec.close()
    finally:
        server.kill()


def test_runtime_state_round_trip(target):
    """runtime_state() holds the contract's arrays: a reset and a load give back the same."""
    producers = [Producer(21), Producer(22, flags="mixed")]
    rec = _record(target, "state", producers, [5, 3, 6])
    try:
        state = rec.runtime_state()
        rec.reset()
        rec.load_runtime_state(state)
        expected = truth(producers)
        check(rec.finish(), expected)
        check(_parts_finish(rec), expected)
    finally:
        rec.close()


def test_final_obs_in_some_chunks_only(target):
    """An episode whose last chunk had no final_obs reads zeros there; the others read
    theirs, and tails zeros."""
    done = np.array([[True], [False]])
    with RolloutRecorder(target=target, session="somefinals") as rec:
        for i, final in enumerate((np.full((2, 1, 2), 7.0), None, np.full((2, 1, 2), 9.0))):
            chunk = {
                "action": np.zeros((2, 1), np.int32),
                "reward": np.zeros((2, 1), np.float32),
                "done": done,
                "obs": np.full((2, 1, 2), float(i)),
            }
            if final is not None:
                chunk["final_obs"] = final
            rec.record(chunk)
        out = rec.finish()
    assert out.lengths.tolist() == [1, 2, 2, 1]
    assert out.final_states["obs"][:, 0].tolist() == [7.0, 0.0, 9.0, 0.0]
    assert out.episode_done.tolist() == [True, True, True, False]


def test_flags_with_env_states_given(target):
    """terminated and truncated are read from `trajectories` when env_states is given as
    well (as a mapping or an object), and a `done` that disagrees with them is refused."""
    T, N = 4, 2
    term, trunc = np.zeros((T, N), bool), np.zeros((T, N), bool)
    term[1, 0] = trunc[3, 1] = True
    positions = np.arange(T * N, dtype=np.float32).reshape(T, N)
    with RolloutRecorder(
        target=target, session="flagsstates", record_states=True, state_fields=["x"]
    ) as rec:
        chunk = {
            "action": np.zeros((T, N), np.int32),
            "reward": np.ones((T, N), np.float32),
            "terminated": term,
            "truncated": trunc,
        }
        rec.record(chunk, {"x": positions})

        class States:
            x = positions

        rec.record(chunk, States())
        with pytest.raises(Exception, match="trajectories.done: expected terminated"):
            rec.record({**chunk, "done": ~(term | trunc)}, {"x": positions})
        out = rec.finish()
    # Over the two chunks' 8 rows env 0 ends at rows 1 and 5 (lengths 2, 4, and a tail of
    # 2), env 1 at rows 3 and 7 (4, 4).
    assert out.episode_terminated.sum() == 2 and out.episode_truncated.sum() == 2
    assert sorted(out.lengths.tolist()) == [2, 2, 4, 4, 4]


class _Transition(NamedTuple):
    """A purejaxrl-style collection struct: factoriax's three fields and observations."""

    action: np.ndarray
    reward: np.ndarray
    done: np.ndarray
    obs: np.ndarray


def test_record_obs_false_records_what_factoriax_records(target):
    fx = load_factoriax_recorder()
    if fx is None:
        pytest.skip("factoriax==0.1.0 not installed")
    rng = np.random.default_rng(7)
    chunks = [
        _Transition(
            rng.integers(0, 5, (6, 3)).astype(np.int32),
            rng.normal(size=(6, 3)).astype(np.float32),
            rng.random((6, 3)) < 0.3,
            rng.normal(size=(6, 3, 4)).astype(np.float32),
        )
        for _ in range(4)
    ]
    reference = fx[0]()
    with (
        RolloutRecorder(target=target, session="fx-obs-off", record_obs=False) as off,
        RolloutRecorder(target=target, session="fx-obs-on") as on,
    ):
        for chunk in chunks:
            reference.record(chunk, None)
            off.record(chunk)
            on.record(chunk)
        want, got, with_obs = reference.finish(), off.finish(), on.finish()
    assert got.states == {}
    np.testing.assert_array_equal(got.actions, np.asarray(want.actions))
    np.testing.assert_array_equal(got.rewards, np.asarray(want.rewards))
    # The default reads the struct's obs: the same episodes, observations beside them.
    assert set(with_obs.states) == {"obs"}
    np.testing.assert_array_equal(with_obs.actions, got.actions)
    env0 = np.concatenate([c.obs[:, 0] for c in chunks])  # episode 0: env 0 from step 0
    length = int(with_obs.lengths[0])
    np.testing.assert_array_equal(with_obs.states["obs"][0, :length], env0[:length])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float32])
def test_a_numeric_done_ends_episodes_where_it_is_nonzero_as_factoriax_reads_it(target, dtype):
    """`done` of another dtype than bool: nonzero ends the episode (2 as well as 1), the
    same episodes as the bool flags and as factoriax's recorder gives for those values."""
    fx = load_factoriax_recorder()
    if fx is None:
        pytest.skip("factoriax==0.1.0 not installed")
    rng = np.random.default_rng(11)
    chunks = []
    for _ in range(3):
        ends = rng.random((8, 3)) < 0.3
        chunks.append(
            _Transition(
                rng.integers(0, 5, (8, 3)).astype(np.int32),
                rng.normal(size=(8, 3)).astype(np.float32),
                (ends * rng.integers(1, 3, (8, 3))).astype(dtype),  # 0, 1 or 2
                rng.normal(size=(8, 3, 2)).astype(np.float32),
            )
        )
    reference = fx[0]()
    session = f"numeric-done-{np.dtype(dtype).name}"
    with (
        RolloutRecorder(target=target, session=session, record_obs=False) as numeric,
        RolloutRecorder(target=target, session=session + "-bool", record_obs=False) as flags,
    ):
        for chunk in chunks:
            reference.record(chunk, None)
            numeric.record(chunk)
            flags.record(chunk._replace(done=chunk.done != 0))
        want, got, as_bool = reference.finish(), numeric.finish(), flags.finish()
    # The truth: each env's episodes end at its nonzero rows, counted here.
    done = np.concatenate([c.done for c in chunks]) != 0
    ends = int(done.sum())
    tails = int((~done[-1]).sum())  # an env whose last row is no done has a tail
    assert got.num_episodes == ends + tails
    assert int(got.episode_done.sum()) == ends
    np.testing.assert_array_equal(got.lengths, as_bool.lengths)
    for other in (as_bool, want):
        np.testing.assert_array_equal(got.actions, np.asarray(other.actions))
        np.testing.assert_array_equal(got.rewards, np.asarray(other.rewards))
