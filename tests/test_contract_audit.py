"""Bad input under the producer contract that tests/test_contract_errors.py does not list:
flags whose shapes or dtypes break their OR, observations nested without end or with field
names the server cannot keep, more fields than a chunk may carry, torch tensors numpy cannot
hold. record() refuses each before anything is queued (the field, what was expected, what
arrived), the server refuses the same names sent past the client, and a chunk with more
observation fields than one writev call takes is stored and replayed whole."""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import numpy as np
import pytest

from recorder_client import InvalidChunkError, RolloutRecorder
from recorder_client._messages import array_to_proto
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_server import ServerOptions, start_server
from recorder_server.durability import files, snapshot
from recorder_server.durability.checkpoint import decode_checkpoint, encode_checkpoint

T, N = 4, 2


def _base(**extra) -> dict:
    chunk = {"action": np.zeros((T, N), np.int32), "reward": np.ones((T, N), np.float32)}
    chunk.update(extra)
    return chunk


def _zeros(*shape, dtype=bool) -> np.ndarray:
    return np.zeros(shape, dtype)


def _holding_itself(kind: type) -> object:
    box = kind()
    if kind is dict:
        box["a"] = box
    else:
        box.append(box)
    return box


BAD = {
    "flags_of_two_shapes": (
        lambda: _base(terminated=_zeros(T, N), truncated=_zeros(T + 1, N)),
        f"trajectories.truncated: expected shape (T, N) = {(T, N)}, got {(T + 1, N)}",
    ),
    "flags_broadcasting_to_t_n": (
        lambda: _base(terminated=_zeros(T, N, 1), truncated=_zeros(T, N)),
        f"trajectories.terminated: expected shape (T, N) = {(T, N)}, got {(T, N, 1)}",
    ),
    "flag_a_scalar": (
        lambda: _base(terminated=False, truncated=False),
        f"trajectories.terminated: expected shape (T, N) = {(T, N)}, got ()",
    ),
    "flags_of_objects": (
        lambda: _base(terminated=_zeros(T, N, dtype=object), truncated=_zeros(T, N)),
        "trajectories.terminated: expected dtype bool, got object",
    ),
    "obs_nested_without_end": (
        lambda: _base(
            done=_zeros(T, N),
            obs=functools.reduce(lambda inner, _: {"a": inner}, range(3000), _zeros(T, N)),
        ),
        "trajectories.obs: expected field names of at most 128 characters",
    ),
    "obs_dict_holding_itself": (
        lambda: _base(done=_zeros(T, N), obs=_holding_itself(dict)),
        "trajectories.obs: expected field names of at most 128 characters",
    ),
    "obs_list_holding_itself": (
        lambda: _base(done=_zeros(T, N), obs=_holding_itself(list)),
        "trajectories.obs: expected field names of at most 128 characters",
    ),
    "final_obs_holding_itself": (
        lambda: _base(done=_zeros(T, N), obs={"a": _zeros(T, N)}, final_obs=_holding_itself(dict)),
        "trajectories.final_obs: expected field names of at most 128 characters",
    ),
    "obs_key_too_long": (
        lambda: _base(done=_zeros(T, N), obs={"k" * 125: _zeros(T, N)}),
        "trajectories.obs: expected field names of at most 128 characters (the keys joined "
        "by dots), got 'obs.kkkk",
    ),
    "obs_key_not_printable": (
        lambda: _base(done=_zeros(T, N), obs={"a\nb": _zeros(T, N)}),
        "trajectories.obs: expected dict keys that are non-empty printable strings without "
        "'.' (they become field names joined by dots), got 'a\\nb'",
    ),
    "obs_more_fields_than_a_chunk_carries": (
        lambda: _base(done=_zeros(T, N), obs={f"k{i}": _zeros(T, N) for i in range(1025)}),
        "trajectories.obs: expected at most 1024 state fields (observation fields and "
        "env_states together), got 1025",
    ),
}


@pytest.fixture
def recorder(target):
    rec = RolloutRecorder(target=target, session="audit")
    yield rec
    rec.close()


def _good_chunk_is_stored(recorder: RolloutRecorder) -> None:
    obs = {"a": np.ones((T, N), np.float32)}
    assert recorder.record(_base(terminated=_zeros(T, N), truncated=_zeros(T, N), obs=obs))
    recorder.flush(timeout=30)
    assert recorder.status().chunks_stored == 1


@pytest.mark.parametrize("case", sorted(BAD))
def test_record_refuses_unseen_bad_input(recorder, case):
    make, expected = BAD[case]
    with pytest.raises(InvalidChunkError) as info:
        recorder.record(make())
    assert expected in str(info.value), str(info.value)
    _good_chunk_is_stored(recorder)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (["obs", "obs.a"], "expected no observation field that also holds fields, got 'obs' and"),
        (["obs..a"], "with non-empty printable keys, at most 128 characters, got 'obs..a'"),
    ],
)
def test_env_state_fields_that_cannot_be_observation_fields(target, fields, expected):
    with RolloutRecorder(
        target=target, session="states", record_states=True, state_fields=fields
    ) as rec:
        with pytest.raises(InvalidChunkError) as info:
            rec.record(_base(done=_zeros(T, N)), {name: _zeros(T, N) for name in fields})
        assert str(info.value).startswith("env_states: ") and expected in str(info.value)


def test_torch_flags_and_observations_numpy_cannot_hold(recorder):
    torch = pytest.importorskip("torch")
    flags = torch.zeros((T, N), dtype=torch.bool)
    cases = [
        (
            _base(terminated=flags, truncated=torch.zeros((T + 1, N), dtype=torch.bool)),
            f"trajectories.truncated: expected shape (T, N) = {(T, N)}, got {(T + 1, N)}",
        ),
        (
            _base(terminated=flags.to("meta"), truncated=flags.to("meta")),
            "trajectories.terminated: expected a dense CPU or CUDA tensor",
        ),
        (
            _base(
                done=flags,
                obs=torch.nested.nested_tensor(
                    [torch.zeros(2), torch.zeros(3)], layout=torch.jagged
                ),
            ),
            "trajectories.obs: expected a dense CPU or CUDA tensor with a numpy dtype (bool, "
            "integer or floating), got a nested tensor on cpu",
        ),
    ]
    for chunk, expected in cases:
        with pytest.raises(InvalidChunkError) as info:
            recorder.record(chunk)
        assert expected in str(info.value), str(info.value)
    _good_chunk_is_stored(recorder)


# -- past the client ---------------------------------------------------------------------------


def _chunk(sequence: int, states: dict[str, np.ndarray]) -> pb.Chunk:
    msg = pb.Chunk(sequence=sequence)
    msg.action.CopyFrom(array_to_proto(np.zeros((T, N), np.int32)))
    msg.reward.CopyFrom(array_to_proto(np.ones((T, N), np.float32)))
    done = np.zeros((T, N), bool)
    done[-1] = True
    msg.done.CopyFrom(array_to_proto(done))
    for name, value in states.items():
        msg.states.append(pb.NamedArray(name=name, array=array_to_proto(value)))
    return msg


ONE = np.ones((T, N), np.float32)
RAW_NAMES = {
    "empty_key": {"obs.": ONE},
    "empty_inner_key": {"obs..a": ONE},
    "not_printable": {"obs.a\nb": ONE},
    "too_long": {"obs." + "k" * 200: ONE},
    "plain_and_keyed": {"obs": ONE, "obs.a": ONE},
    "leaf_and_branch": {"obs.a.b": ONE, "obs.a": ONE},
}


def test_the_server_refuses_observation_names_it_cannot_keep(target):
    """Sent past the client as each worker's first chunk (no layout to compare with yet),
    each is refused INVALID_ARGUMENT naming chunk.states and the name; the worker's next
    chunks are stored (the first ends an episode whose start the refusal cut, left out)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        for case, states in sorted(RAW_NAMES.items()):
            session = f"names-{case.replace('_', '-')}"
            stub.Join(pb.JoinRequest(session=session, config=pb.SessionConfig(), worker_id="w"))
            requests = [
                pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id="w")),
                pb.RecordRequest(chunk=_chunk(1, states)),
                pb.RecordRequest(chunk=_chunk(2, {"obs.a": ONE})),
                pb.RecordRequest(chunk=_chunk(3, {"obs.a": ONE})),
            ]
            acks = list(stub.Record(iter(requests), timeout=60))
            assert [a.sequence for a in acks] == [1, 2, 3], case
            assert acks[0].result == pb.RecordAck.REJECTED, case
            assert acks[0].error_code == "INVALID_ARGUMENT", case
            message = acks[0].error_message
            assert message.startswith("chunk.states: expected "), (case, message)
            assert repr(max(states, key=len))[:40] in message, (case, message)
            assert [a.result for a in acks[1:]] == [pb.RecordAck.STORED] * 2, (case, acks)
            with RolloutRecorder(target=target, session=session, state_fields=()) as rec:
                out = rec.finish()
            assert sorted(out.states) == ["obs.a"] and out.lengths.tolist() == [T, T], case


# -- many fields -------------------------------------------------------------------------------


def test_more_observation_fields_than_one_writev_takes(tmp_path: Path):
    """600 observation fields and their final observations: more buffers in one log record
    than writev takes at once (1024 on Linux). Stored, and read back after a restart from
    the write-ahead log."""
    keys = [f"k{i}" for i in range(600)]
    obs = {k: np.full((T, N), i, np.int16) for i, k in enumerate(keys)}
    final = {k: np.full((T, N), -i, np.int16) for i, k in enumerate(keys)}
    done = np.zeros((T, N), bool)
    done[1] = True
    options = ServerOptions(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"))
    server = start_server(options)
    try:
        with RolloutRecorder(target=server.address, session="wide") as rec:
            assert rec.record(_base(done=done, obs=obs, final_obs=final))
            rec.flush(timeout=30)
            assert rec.status().chunks_stored == 1
    finally:
        server.stop(grace=0)
    server = start_server(options)  # the same data directory: the log replayed
    try:
        with RolloutRecorder(target=server.address, session="wide") as rec:
            out = rec.finish()
    finally:
        server.stop(grace=0)
    assert out.lengths.tolist() == [2, 2, 2, 2]
    assert sorted(out.states) == sorted(f"obs.{k}" for k in keys)
    for i, k in enumerate(keys):
        assert (out.states[f"obs.{k}"] == i).all(), k
        # Episodes 0 and 2 (one per env) ended at row 1; the tails no flag ended read zeros.
        assert out.final_states[f"obs.{k}"][out.episode_done].tolist() == [-i, -i], k


def test_write_all_writes_more_buffers_than_one_writev_takes(tmp_path: Path):
    parts = [bytes([i % 256]) * (1 + i % 3) for i in range(5000)]
    path = tmp_path / "parts"
    with open(path, "wb") as handle:
        files.write_all(handle.fileno(), parts)
    assert path.read_bytes() == b"".join(parts)


def test_a_chunk_that_cannot_be_encoded_is_reported_once(recorder, caplog):
    """An exbibyte seen through one element (beyond any address space: no allocation can
    succeed). record() queues it (its header is all it reads), the sender cannot make it
    contiguous and says so; the empty chunk sent in its place keeps the sequence, and the
    server's refusal of that one is not reported as a second error."""
    huge = np.broadcast_to(np.float32(0), (T, N, 1 << 55))
    assert recorder.record(_base(done=_zeros(T, N), obs={"a": huge}))
    with pytest.raises(InvalidChunkError, match=r"^chunk 1 could not be encoded: "):
        recorder.flush(timeout=30)
    _good_chunk_is_stored(recorder)
    assert recorder.stats.chunks_acked == 2
    told = [r.getMessage() for r in caplog.records if r.name.startswith("recorder_client")]
    assert not [m for m in told if "chunk.action" in m], told


def test_final_obs_with_the_keys_in_another_order(recorder):
    """A dict's keys in another order are the same structure: paired by name."""
    obs = {"a": np.full((T, N), 1, np.int8), "b": np.full((T, N, 2), 2.0, np.float32)}
    final = {"b": np.full((T, N, 2), -2.0, np.float32), "a": np.full((T, N), -1, np.int8)}
    done = np.zeros((T, N), bool)
    done[-1] = True
    assert recorder.record(_base(done=done, obs=obs, final_obs=final))
    out = recorder.finish()
    assert out.final_states["obs.a"].tolist() == [-1, -1]
    assert out.final_states["obs.b"].tolist() == [[-2.0, -2.0]] * 2


def test_a_chunk_over_the_servers_message_cap_is_refused_and_the_recorder_goes_on(tmp_path):
    """A server that takes messages of at most 4 MiB: its gRPC layer would end the stream on
    a bigger one (every later call of the recorder then failed). The client learns the cap
    when it joins and refuses the chunk itself, naming its largest array; the next chunk is
    stored."""
    cap = 4 << 20
    options = ServerOptions(
        listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), max_message_bytes=cap
    )
    server = start_server(options)
    try:
        with RolloutRecorder(target=server.address, session="cap") as rec:
            noise = np.random.default_rng(0).random((T, N, (5 << 20) // (T * N * 4)), np.float32)
            assert rec.record(_base(done=_zeros(T, N), obs=noise))  # incompressible 5 MiB
            with pytest.raises(InvalidChunkError) as info:
                rec.flush(timeout=30)
            message = str(info.value)
            assert message.startswith(f"chunk 1: expected at most {cap} bytes compressed"), message
            assert "of them trajectories.obs; record fewer steps a chunk" in message
            _good_chunk_is_stored(rec)
            assert rec.stats.reconnects == 0
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (
            lambda: _base(done=_zeros(T, N), obs=[[0.5] * N] * T),
            "trajectories.obs[0][0]: expected an array (T, N, ...) or a dict / tuple of them, "
            "got float inside a list or tuple, whose items are observations",
        ),
        (
            lambda: _base(done=_zeros(T, N), obs={"a": 1}),
            "trajectories.obs['a']: expected an array (T, N, ...) or a dict / tuple of them, "
            "got int",
        ),
        (
            lambda: _base(done=_zeros(T, N, dtype=object)),
            "trajectories.done: expected a numeric or bool dtype, got '|O' (object)",
        ),
    ],
)
def test_messages_say_where_the_value_stands(recorder, chunk, expected):
    with pytest.raises(InvalidChunkError) as info:
        recorder.record(chunk())
    assert str(info.value) == expected


def test_a_runtime_state_with_observation_names_a_chunk_may_not_carry(target):
    """A runtime state is a client upload too: one whose observation fields are renamed
    to a name a chunk may not carry (an empty key), consistently in its schema and its
    chunks, is refused naming state.schema; the session keeps what it held."""
    done = np.zeros((T, N), bool)
    done[-1] = True
    with RolloutRecorder(target=target, session="kept") as rec:
        rec.record(_base(done=done, obs={"a": np.ones((T, N), np.float32)}))
        state = rec.runtime_state()
        meta, blobs = snapshot.unpack(decode_checkpoint(state))

        def renamed(node):
            if isinstance(node, dict):
                return {
                    ("state:obs..a" if k == "state:obs.a" else k): renamed(v)
                    for k, v in node.items()
                }
            if isinstance(node, list):
                return [renamed(v) for v in node]
            return node

        edited = renamed(meta)
        assert "state:obs..a" in edited["schema"]
        data = encode_checkpoint(snapshot.pack(edited, [bytes(b) for b in blobs]), compress=False)
        with pytest.raises(InvalidChunkError) as info:
            rec.load_runtime_state(data)
        message = str(info.value)
        assert "state.schema: expected observation fields named 'obs' or 'obs.<key>...'" in message
        assert "got 'obs..a'" in message
        out = rec.finish()
    assert sorted(out.states) == ["obs.a"] and out.lengths.tolist() == [T, T]
