"""Action and state frames are acknowledged on their headers and proved to decode later:
a frame that does not decode is found without any read, reads as zeros in finish() (both
ways of sending it) and after a kill -9 or a checkpoint and a restart, is counted and
logged, and finish() tells its caller (DataLossError, or a WARNING)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zstandard
from conftest import RestartableServer, export, wait_for

from recorder_client import (
    DataLossError,
    InvalidChunkError,
    RolloutRecorder,
    Trajectory,
    _wire,
)
from recorder_client._credentials import make_channel
from recorder_client._finish import assemble
from recorder_client._messages import array_to_proto
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_client.sessions import fetch_episodes

T, N = 16, 3


def chunk_arrays(seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq)
    done = np.zeros((T, N), bool)
    done[5, 0] = done[11, 1] = done[T - 1, :] = True
    return {
        "action": rng.integers(0, 9, (T, N)).astype(np.int32),
        "reward": rng.normal(size=(T, N)).astype(np.float32),
        "done": done,
        "state:pos": rng.integers(0, 50, (T, N, 2)).astype(np.int32),
    }


def broken_frame(arr: np.ndarray) -> pb.ArrayData:
    """A frame whose headers are right (one whole zstd frame declaring the array's size, one
    compressed block) and whose block content does not decode (packed, as the client sends
    integer arrays)."""
    msg = array_to_proto(arr, pack=True)
    assert arr.dtype.kind not in "iu" or msg.codec in _wire.PACKED
    data = bytearray(msg.data)
    content = _wire.frame_bytes(msg.codec, arr.dtype, arr.nbytes, "test")
    assert zstandard.get_frame_parameters(bytes(data)).content_size == content
    at = zstandard.frame_header_size(bytes(data))
    block = int.from_bytes(data[at : at + 3], "little")
    assert block & 1 and (block >> 1) & 3 == 2, "one compressed block"  # last, compressed
    size = block >> 3
    data[at + 3 : at + 3 + size] = b"\xff" * size
    msg.data = bytes(data)
    with pytest.raises(zstandard.ZstdError):
        zstandard.ZstdDecompressor().decompress(msg.data, max_output_size=content)
    return msg


def record(stub, session: str, worker: str, chunks: list[pb.Chunk]) -> list[pb.RecordAck]:
    config = pb.SessionConfig(record_states=True, state_fields=["pos"])
    stub.Join(pb.JoinRequest(session=session, config=config, worker_id=worker), timeout=10)
    opening = pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id=worker))
    requests = [opening, *(pb.RecordRequest(chunk=c) for c in chunks)]
    return list(stub.Record(iter(requests), timeout=30))


def make_chunks(broken: bool) -> list[pb.Chunk]:
    out = []
    for seq in (1, 2, 3):
        arrays = chunk_arrays(seq)
        msg = pb.Chunk(sequence=seq)
        for name in ("action", "reward", "done"):
            getattr(msg, name).CopyFrom(array_to_proto(arrays[name], pack=True))
        pos = arrays["state:pos"]
        if seq == 2:
            data = broken_frame(pos) if broken else array_to_proto(np.zeros_like(pos), pack=True)
        else:
            data = array_to_proto(pos, pack=True)
        msg.states.append(pb.NamedArray(name="pos", array=data))
        out.append(msg)
    return out


def finish_both_ways(target: str, session: str):
    with RolloutRecorder(
        target=target,
        session=session,
        record_states=True,
        state_fields=["pos"],
        on_data_loss="continue",
    ) as rec:
        new = rec.finish()
        request = pb.FinishRequest(session=session, pad_incomplete=True)  # gathered parts
        old = assemble(rec._connection.download("Finish", request))
    return new, old


def finish_raises(target: str, session: str, told: str):
    """finish() and fetch_episodes() raise DataLossError naming the chunk whose frame
    reads as zeros, with the result all the same; both ways of sending it say so."""
    with RolloutRecorder(
        target=target, session=session, record_states=True, state_fields=["pos"]
    ) as rec:
        with pytest.raises(DataLossError, match=told) as raised:
            rec.finish()
    with pytest.raises(DataLossError, match=told) as fetched:
        fetch_episodes(target, session)
    new, old = finish_both_ways(target, session)
    for result in (raised.value.trajectory, fetched.value.trajectory, new, old):
        assert result.num_corrupt_chunks == 1
        assert len(result.corrupt_chunks) == 1 and told in result.corrupt_chunks[0]
        same(result, new)
    return new, old


def saved_and_loaded(result: Trajectory, path: Path) -> Trajectory:
    result.save(path)
    loaded = Trajectory.load(path)
    same(loaded, result)
    assert loaded.corrupt_chunks == result.corrupt_chunks
    assert loaded.num_corrupt_chunks == result.num_corrupt_chunks
    return loaded


def same(a, b) -> None:
    assert a.num_episodes == b.num_episodes
    for name in ("actions", "rewards", "lengths"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(a.states["pos"], b.states["pos"])


def corrupt_count(stub, session: str) -> float:
    values = stub.GetMetrics(pb.MetricsRequest(), timeout=10).values
    return values.get(f"Recorder/chunks_corrupt/session={session}", 0.0)


def test_a_frame_that_does_not_decode_reads_as_zeros(tmp_path: Path) -> None:
    server = RestartableServer(tmp_path / "data").start()
    try:
        with make_channel(server.address) as channel:
            stub = pb_grpc.RecorderStub(channel)
            acks = record(stub, "v", "bad", make_chunks(broken=True))
            # Acknowledged: the headers are right, and nothing has decoded the block yet.
            assert [a.sequence for a in acks] == [1, 2, 3]
            assert all(a.result == pb.RecordAck.STORED for a in acks), acks
            # The proof may have come before chunk 3's ack, which then tells the worker.
            told = [m for a in acks for m in a.late_refusals]
            record(stub, "ref", "bad", make_chunks(broken=False))
            # The background verifier finds it with nothing reading the session.
            assert wait_for(lambda: corrupt_count(stub, "v") == 1, timeout=20)
            assert corrupt_count(stub, "ref") == 0
        log = server.log_path.read_text()
        assert "chunk 2 of worker 'bad' was acknowledged, but its state:pos frame" in log
        assert "Traceback" not in log
        # The worker that sent it hears of it on its next ack, once.
        assert len(told) <= 1 and all("chunk 2 of worker 'bad' was ackno" in m for m in told)
        for session in ("v", "ref"):
            with RolloutRecorder(
                target=server.address,
                session=session,
                worker_id="bad",
                record_states=True,
                state_fields=["pos"],
            ) as rec:
                arrays = chunk_arrays(4)
                rollout = {k: arrays[k] for k in ("action", "reward", "done")}
                rec.record(rollout, {"pos": arrays["state:pos"]})
                if session == "v" and not told:
                    with pytest.raises(
                        InvalidChunkError, match="chunk 2 of worker 'bad' was ackno"
                    ):
                        rec.flush()
                rec.record(rollout, {"pos": arrays["state:pos"]})
                rec.flush()
        told = "chunk 2 of worker 'bad' was acknowledged, but its state:pos frame"
        new, old = finish_raises(server.address, "v", told)
        ref, ref_old = finish_both_ways(server.address, "ref")
        assert ref.num_corrupt_chunks == ref_old.num_corrupt_chunks == 0
        assert ref.corrupt_chunks == ()
        assert saved_and_loaded(new, tmp_path / "v.npz").num_corrupt_chunks == 1
        assert saved_and_loaded(ref, tmp_path / "ref.npz").corrupt_chunks == ()
        same(new, ref)
        same(old, ref)
        sent = chunk_arrays(1)["state:pos"]
        assert np.isin(sent, new.states["pos"]).all() and new.states["pos"].any()

        # After a crash the write-ahead log brings the frame back; it is found again, by the
        # reader this time if it comes first.
        server.kill()
        server.start()
        new, old = finish_raises(server.address, "v", told)
        same(new, ref)
        same(old, ref)
        with make_channel(server.address) as channel:
            stub = pb_grpc.RecorderStub(channel)
            assert wait_for(lambda: corrupt_count(stub, "v") == 1, timeout=20)
        # A checkpoint holds the zeros, and still says why.
        assert server.stop() == 0
        server.start()
        new, _ = finish_raises(server.address, "v", told)
        same(new, ref)
        assert finish_both_ways(server.address, "ref")[0].num_corrupt_chunks == 0
        # So does the exporter: it stops with one line, or exports with a warning.
        stopped = export(server.address, "v", tmp_path / "stopped")
        assert stopped.returncode == 2 and told in stopped.stderr, stopped.stderr
        assert "Traceback" not in stopped.stderr
        assert not (tmp_path / "stopped").exists()
        went_on = export(server.address, "v", tmp_path / "went-on", "--on-data-loss", "continue")
        assert went_on.returncode == 0 and told in went_on.stderr, went_on.stderr
        assert f"exported {ref.num_episodes} episodes" in went_on.stdout
    finally:
        server.stop()


def test_headers_are_still_checked_before_the_ack(target: str) -> None:
    """A frame that trails junk, or declares another size, is refused as before."""
    with make_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        chunks = make_chunks(broken=False)
        pos = chunk_arrays(2)["state:pos"]
        junk = array_to_proto(pos)
        junk.data = junk.data + b"\x00junk"
        chunks[1].states[0].array.CopyFrom(junk)
        other = array_to_proto(pos)
        other.data = _wire.encode(pos[:8])[1]
        chunks[2].states[0].array.CopyFrom(other)
        acks = record(stub, "hdr", "w", chunks)
        assert [a.result for a in acks] == [
            pb.RecordAck.STORED,
            pb.RecordAck.REJECTED,
            pb.RecordAck.REJECTED,
        ], acks
        assert "bytes after its" in acks[1].error_message, acks[1]
        assert "it declares" in acks[2].error_message, acks[2]
        assert corrupt_count(stub, "hdr") == 0


class _NoBackground:
    def submit(self, session) -> None:
        pass


@pytest.mark.parametrize("reader", ["sample_start", "finish"])
def test_a_reader_proves_what_it_reads_first(target: str, reader: str, monkeypatch) -> None:
    """With the background thread kept away (this in-process server's), the reader proves
    the frames it reads: the store's feeder (before it stores an episode) or finish().
    With a store, the cell-key field is decoded before the ack; the other state field is
    not. The store keeps no episode over a chunk that does not decode (never zeros)."""
    import json

    from test_capture_remote import CONFIG, FIELDS, worker_chunks

    from recorder_server import session as session_module

    monkeypatch.setattr(session_module, "VERIFIER", _NoBackground())
    config = pb.SessionConfig(
        record_states=True,
        state_fields=FIELDS,
        capture_config_json=json.dumps(CONFIG.to_dict(), sort_keys=True),
    )
    chunks = []
    for seq, (rollout, states, codes) in enumerate(worker_chunks(0), start=1):
        msg = pb.Chunk(sequence=seq)
        msg.action.CopyFrom(array_to_proto(rollout.action))
        msg.reward.CopyFrom(array_to_proto(rollout.reward))
        msg.done.CopyFrom(array_to_proto(rollout.done))
        msg.outcome.CopyFrom(array_to_proto(codes))
        pos, inv = states.player_positions, states.player_inventory
        msg.states.append(pb.NamedArray(name="player_positions", array=array_to_proto(pos)))
        msg.states.append(pb.NamedArray(name="player_inventory", array=broken_frame(inv)))
        chunks.append(msg)
    session = f"st-{reader}"
    with make_channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        stub.Join(pb.JoinRequest(session=session, config=config, worker_id="bad"), timeout=10)
        opening = pb.RecordRequest(open=pb.RecordOpen(session=session, worker_id="bad"))
        requests = [opening, *(pb.RecordRequest(chunk=c) for c in chunks)]
        acks = list(stub.Record(iter(requests), timeout=30))
        assert all(a.result == pb.RecordAck.STORED for a in acks), acks
        with RolloutRecorder(
            target=target, session=session, record_states=True, state_fields=FIELDS, capture=CONFIG
        ) as viewer:
            if reader == "sample_start":
                # Every chunk's inventory frame is broken: the feeder proved each one before
                # the store could read it, and stored none of their episodes.
                assert viewer.capture.sample_start() is None
                assert corrupt_count(stub, session) == len(chunks)
                return
            else:
                with pytest.raises(DataLossError, match="player_inventory frame does not") as e:
                    viewer.finish()
                out = e.value.trajectory
                assert out.num_corrupt_chunks == len(chunks) == len(out.corrupt_chunks)
                inventory = out.states[_wire.trajectory_name("player_inventory")]
                positions = out.states[_wire.trajectory_name("player_positions")]
        assert positions.any() and not inventory.any()
        assert corrupt_count(stub, session) >= 1
