"""Bad input under the producer contract: record() refuses it before anything is
queued, naming the field, what was expected and what arrived; the same chunks sent past the
client (raw gRPC) are refused by the server with INVALID_ARGUMENT naming the field, and the
session goes on as if they never came."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from recorder_client import InvalidChunkError, RolloutRecorder, unflatten
from recorder_client._messages import array_to_proto
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc

T, N = 4, 2


def _base(**extra) -> dict:
    chunk = {
        "action": np.zeros((T, N), np.int32),
        "reward": np.ones((T, N), np.float32),
    }
    chunk.update(extra)
    return chunk


def _flags(*rows_envs, truncated=()) -> dict:
    term = np.zeros((T, N), bool)
    trunc = np.zeros((T, N), bool)
    for t, e in rows_envs:
        term[t, e] = True
    for t, e in truncated:
        trunc[t, e] = True
    return {"terminated": term, "truncated": trunc}


def _mask(*false) -> np.ndarray:
    valid = np.ones((T, N), bool)
    for t, e in false:
        valid[t, e] = False
    return valid


@pytest.fixture
def recorder(target):
    rec = RolloutRecorder(target=target, session="bad")
    yield rec
    rec.close()


# (chunk, the message's expected pieces); each is refused by record() on a fresh worker.
BAD = {
    "valid_wrong_shape": (
        _base(done=np.zeros((T, N), bool), valid=np.ones((T, N + 1), bool)),
        ["trajectories.valid", f"(T, N) = {(T, N)}", f"{(T, N + 1)}"],
    ),
    "valid_not_bool": (
        _base(done=np.zeros((T, N), bool), valid=np.ones((T, N), np.int8)),
        ["trajectories.valid", "bool", "int8"],
    ),
    "done_disagrees": (
        _base(done=np.zeros((T, N), bool), **_flags((2, 1))),
        [
            "trajectories.done",
            "terminated | truncated",
            "done=False",
            "terminated=True",
            "row 2, env 1",
        ],
    ),
    "only_terminated": (
        _base(terminated=np.zeros((T, N), bool)),
        ["trajectories.truncated", "alongside trajectories.terminated"],
    ),
    "only_truncated": (
        _base(done=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool)),
        ["trajectories.terminated", "alongside trajectories.truncated"],
    ),
    "no_done_at_all": (_base(), ["trajectories.done", "terminated and truncated"]),
    "valid_false_mid_episode": (
        _base(**_flags(), valid=_mask((2, 0))),
        ["trajectories.valid", "expected True at row 2, env 0", "got False"],
    ),
    "flag_on_a_false_row": (
        _base(**_flags((0, 1)), valid=_mask((0, 1))),
        ["trajectories.valid", "no done, terminated or truncated flag", "row 0, env 1"],
    ),
    "dict_key_with_a_dot": (
        _base(done=np.zeros((T, N), bool), obs={"a.b": np.zeros((T, N))}),
        ["trajectories.obs", "without '.'", "'a.b'"],
    ),
    "final_obs_without_obs": (
        _base(done=np.zeros((T, N), bool), final_obs=np.zeros((T, N))),
        ["trajectories.final_obs", "alongside trajectories.obs"],
    ),
    "final_obs_other_structure": (
        _base(
            done=np.zeros((T, N), bool),
            obs={"a": np.zeros((T, N))},
            final_obs={"b": np.zeros((T, N))},
        ),
        ["trajectories.final_obs", "['obs.a']", "['obs.b']"],
    ),
    "final_obs_other_dtype": (
        _base(
            done=np.zeros((T, N), bool),
            obs=np.zeros((T, N, 3), np.float32),
            final_obs=np.zeros((T, N, 3), np.float64),
        ),
        ["trajectories.final_obs (obs)", "float32", "float64"],
    ),
    "obs_wrong_shape": (
        _base(done=np.zeros((T, N), bool), obs={"pos": np.zeros(())}),
        ["trajectories.obs.pos", f"{(T, N)}", "()"],
    ),
    "no_envs": (  # the worker's N would be fixed at 0
        {
            "action": np.zeros((T, 0), np.int32),
            "reward": np.ones((T, 0), np.float32),
            "done": np.zeros((T, 0), bool),
        },
        ["trajectories.action", "expected N >= 1 environments", f"{(T, 0)}"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_record_refuses_with_the_field_named(recorder, case):
    chunk, pieces = BAD[case]
    with pytest.raises(InvalidChunkError) as info:
        recorder.record(chunk)
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))
    # Nothing was queued: a good chunk goes on at sequence 1, and is stored.
    assert recorder.record(_base(**_flags((3, 0)), valid=_mask((0, 1)), obs=np.ones((T, N))))
    recorder.flush()
    assert recorder.status().chunks_stored == 1


def test_dict_observation_whose_keys_change(recorder):
    obs = {"pos": np.zeros((T, N, 2), np.float32), "hp": np.zeros((T, N), np.int64)}
    recorder.record(_base(done=np.zeros((T, N), bool), obs=obs))
    changed = {"pos": obs["pos"], "mana": obs["hp"]}
    with pytest.raises(InvalidChunkError) as info:
        recorder.record(_base(done=np.zeros((T, N), bool), obs=changed))
    message = str(info.value)
    assert message.startswith("trajectories.obs: expected the keys ['obs.hp', 'obs.pos']")
    assert "got ['obs.mana', 'obs.pos']" in message


def test_valid_false_after_an_unfinished_chunk(recorder):
    """The open episode carries across chunks: a False first row after a chunk whose last
    row had no done is refused; after a done it is taken."""
    recorder.record(_base(**_flags()))
    recorder.record(_base(**_flags((3, 0)), valid=_mask()))
    with pytest.raises(InvalidChunkError, match=r"expected True at row 0, env 1, got False"):
        recorder.record(_base(**_flags(), valid=_mask((0, 1))))
    assert recorder.record(_base(**_flags(), valid=_mask((0, 0), (1, 0))))


def test_obs_given_both_ways(target):
    with RolloutRecorder(
        target=target, session="both", record_states=True, state_fields=["obs"]
    ) as rec:
        with pytest.raises(InvalidChunkError, match=r"env_states.obs: expected observations once"):
            rec.record(
                _base(done=np.zeros((T, N), bool), obs={"a": np.zeros((T, N))}),
                {"obs": np.zeros((T, N))},
            )


def test_unflatten_rebuilds_the_structure():
    a, b, c = np.zeros(1), np.ones(1), np.full(1, 2.0)
    fields = {"obs.pos": a, "obs.inv.0": b, "obs.inv.1": c, "other": a}
    got = unflatten(fields)
    assert set(got) == {"pos", "inv"} and got["pos"] is a
    assert isinstance(got["inv"], tuple) and got["inv"][0] is b and got["inv"][1] is c
    assert unflatten({"obs": a}) is a
    with pytest.raises(KeyError, match="'obs'"):
        unflatten({"other": a})


# -- past the client ---------------------------------------------------------------------------


def _chunk(sequence: int, **arrays) -> pb.Chunk:
    msg = pb.Chunk(sequence=sequence)
    msg.action.CopyFrom(array_to_proto(np.zeros((T, N), np.int32)))
    msg.reward.CopyFrom(array_to_proto(np.ones((T, N), np.float32)))
    either = arrays["terminated"] | arrays["truncated"] if "truncated" in arrays else None
    done = arrays.pop("done", np.zeros((T, N), bool) if either is None else either)
    msg.done.CopyFrom(array_to_proto(done))
    arrays.setdefault("state:obs", np.ones((T, N)))  # the session's layout has it
    for name, value in arrays.items():
        if name == "part_lengths":  # a chunk joined from several record() calls
            msg.part_lengths.extend(value)
        elif name.startswith("state:"):
            msg.states.append(pb.NamedArray(name=name[6:], array=array_to_proto(value)))
        elif name.startswith("final:"):
            msg.finals.append(pb.NamedArray(name=name[6:], array=array_to_proto(value)))
        else:
            getattr(msg, name).CopyFrom(array_to_proto(value))
    return msg


RAW_BAD = {
    "only_terminated": (
        {"terminated": np.zeros((T, N), bool)},
        "chunk.truncated: expected it alongside chunk.terminated",
    ),
    "done_disagrees": (
        {"done": np.zeros((T, N), bool), **_flags(truncated=[(1, 1)])},
        "chunk.done: expected terminated | truncated, got done=False with terminated=False "
        "and truncated=True at row 1 of environment 1",
    ),
    "valid_wrong_shape": (
        {"valid": np.ones((T + 1, N), bool)},
        f"chunk.valid: expected bool of shape {[T, N]}",
    ),
    "valid_false_mid_episode": (
        {"valid": _mask((1, 0))},
        "chunk.valid: expected True at row 1 of environment 0, got False",
    ),
    "flag_on_a_false_row": (
        {"done": _mask() & ~_mask((0, 0)), "valid": _mask((0, 0))},
        "chunk.valid: expected no done, terminated or truncated flag on a row marked False, "
        "got one at row 0 of environment 0",
    ),
    "final_without_its_state": (
        {"final:obs.x": np.zeros((T, N))},
        "chunk.finals['obs.x']: expected the state field 'obs.x' in the same chunk",
    ),
    "final_other_shape": (
        {"state:obs": np.zeros((T, N, 2)), "final:obs": np.zeros((T, N, 3))},
        "chunk.finals['obs']: expected float64 of shape [4, 2, 2]",
    ),
    "too_many_fields": (
        {f"state:obs.{i}": np.zeros((T, N), bool) for i in range(1024)},
        "chunk.states: expected at most 1024 state fields (observation fields included), got 1025",
    ),
    "parts_not_summing_to_t": (
        {"part_lengths": [1, 2]},
        f"chunk.part_lengths: expected lengths >= 1 summing to T = {T}, got [1, 2] (sum 3)",
    ),
    "empty_part": (
        {"part_lengths": [T, 0]},
        f"chunk.part_lengths: expected lengths >= 1 summing to T = {T}, got [{T}, 0]",
    ),
    "more_parts_than_steps": (
        {"part_lengths": [1] * (T + 1)},
        f"chunk.part_lengths: expected at most T = {T} parts, got {T + 1}",
    ),
    "state_not_allowed": (
        {"state:secret": np.zeros((T, N))},
        "chunk.states: expected fields from none (record_states is off) or observation fields",
    ),
}


def test_the_server_refuses_the_same_chunks_and_stays_intact(target):
    """Each bad chunk is refused INVALID_ARGUMENT with the field named; its sequence is
    taken, and the good chunks around it are stored and read back."""
    session = "raw"
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        stub.Join(pb.JoinRequest(session=session, config=pb.SessionConfig(), worker_id="w"))
        requests = [pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id="w"))]
        good = {"valid": _mask((0, 0)), **_flags((3, 0), (2, 1))}
        requests.append(pb.RecordRequest(chunk=_chunk(1, **good)))
        for i, case in enumerate(sorted(RAW_BAD)):
            arrays, _ = RAW_BAD[case]
            requests.append(pb.RecordRequest(chunk=_chunk(2 + i, **arrays)))
        last = 2 + len(RAW_BAD)
        requests.append(pb.RecordRequest(chunk=_chunk(last, **_flags((1, 0), (1, 1)))))
        acks = list(stub.Record(iter(requests), timeout=60))
    assert [a.sequence for a in acks] == list(range(1, last + 1))
    assert acks[0].result == pb.RecordAck.STORED and acks[-1].result == pb.RecordAck.STORED
    for ack, case in zip(acks[1:-1], sorted(RAW_BAD)):
        assert ack.result == pb.RecordAck.REJECTED, case
        assert ack.error_code == "INVALID_ARGUMENT", (case, ack.error_code)
        assert RAW_BAD[case][1] in ack.error_message, (case, ack.error_message)
    with RolloutRecorder(target=target, session=session, state_fields=()) as rec:
        out = rec.finish()
        status = rec.status()
    assert status.chunks_stored == 2
    # Chunk 1 (steps 0-3): env 0 from its valid row 1 to its terminal row 3, env 1 steps
    # 0-2, then step 3 open. The refused chunks cut it (an unfinished tail); the last chunk
    # (steps 4-7) ends pieces whose start the cut hid (left out), then tails 6-7.
    assert out.episode_env.tolist() == [0, 0, 1, 1, 1]
    assert out.episode_start.tolist() == [1, 6, 0, 3, 6]
    assert out.lengths.tolist() == [3, 2, 3, 1, 2]
    assert out.episode_terminated.tolist() == [True, False, True, False, False]
    assert out.states["obs"].sum(axis=1).tolist() == out.lengths.tolist()


def test_the_server_refuses_a_first_chunk_of_no_envs(target):
    """Before any chunk fixes the worker's N: refused, and the next chunk of N envs stored."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        stub.Join(pb.JoinRequest(session="n0", config=pb.SessionConfig(), worker_id="w"))
        empty = pb.Chunk(sequence=1)
        empty.action.CopyFrom(array_to_proto(np.zeros((T, 0), np.int32)))
        empty.reward.CopyFrom(array_to_proto(np.ones((T, 0), np.float32)))
        empty.done.CopyFrom(array_to_proto(np.zeros((T, 0), bool)))
        requests = [
            pb.RecordRequest(open=pb.RecordOpen(session="n0", worker_id="w")),
            pb.RecordRequest(chunk=empty),
            pb.RecordRequest(chunk=_chunk(2, **_flags((1, 0)))),
        ]
        acks = list(stub.Record(iter(requests), timeout=60))
    assert [a.result for a in acks] == [pb.RecordAck.REJECTED, pb.RecordAck.STORED]
    assert acks[0].error_code == "INVALID_ARGUMENT"
    assert "chunk.action: expected N >= 1 environments, got shape [4, 0]" in acks[0].error_message
