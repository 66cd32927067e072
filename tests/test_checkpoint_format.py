"""Checkpoint file format, atomic writes, the checkpoint directory and safe_join."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from recorder_server.durability import checkpoint as ckpt
from recorder_server.durability import files
from recorder_server.durability.checkpoint import (
    CheckpointCorruptError,
    CheckpointDirectory,
    CheckpointError,
    CheckpointFormatError,
    CheckpointTruncatedError,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint,
    safe_join,
    write_checkpoint,
)

PAYLOAD = b"".join(b"episode %06d;" % i for i in range(2000)) + os.urandom(3000)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("payload", [PAYLOAD, b"", b"\x00"])
def test_write_read_round_trip(tmp_path: Path, compress: bool, payload: bytes) -> None:
    path = tmp_path / "state.rrc"
    info = write_checkpoint(path, payload, compress=compress, writer_version="9.8.7")

    assert read_checkpoint(path) == payload
    assert info.path == path
    assert info.compressed is compress
    assert info.payload_bytes == len(payload)
    assert info.writer_version == "9.8.7"
    assert info.format_version == ckpt.FORMAT_VERSION
    data = path.read_bytes()
    assert data.startswith(ckpt.MAGIC)
    assert len(data) > info.stored_bytes
    assert data.endswith(payload if not compress else b"")  # stored raw when uncompressed
    assert _leftovers(tmp_path) == []


def test_compression_really_compresses(tmp_path: Path) -> None:
    payload = b"abc" * 100_000
    small = write_checkpoint(tmp_path / "a", payload, compress=True)
    big = write_checkpoint(tmp_path / "b", payload, compress=False)
    assert small.stored_bytes < len(payload) // 10
    assert big.stored_bytes == len(payload)
    assert read_checkpoint(tmp_path / "a") == read_checkpoint(tmp_path / "b") == payload


@pytest.mark.parametrize("compress", [True, False])
def test_in_memory_encoding_is_the_file_format(tmp_path: Path, compress: bool) -> None:
    data = encode_checkpoint(PAYLOAD, compress)
    assert decode_checkpoint(data) == PAYLOAD
    assert decode_checkpoint(memoryview(data)) == PAYLOAD
    path = tmp_path / "x.rrc"
    path.write_bytes(data)
    assert read_checkpoint(path) == PAYLOAD
    write_checkpoint(tmp_path / "y.rrc", PAYLOAD, compress=compress)
    assert (tmp_path / "y.rrc").read_bytes() == data


def test_rewrite_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "c.rrc"
    write_checkpoint(path, b"old", compress=False)
    write_checkpoint(path, b"new", compress=True)
    assert read_checkpoint(path) == b"new"
    assert _leftovers(tmp_path) == []


def test_writer_version_too_long_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writer_version"):
        write_checkpoint(tmp_path / "c", b"x", compress=False, writer_version="v" * 65)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("compress", [True, False])
def test_truncated_payload_is_refused(tmp_path: Path, compress: bool) -> None:
    path = tmp_path / "c.rrc"
    info = write_checkpoint(path, PAYLOAD, compress=compress)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointTruncatedError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "truncated" in message
    assert f"expected {info.stored_bytes} payload bytes, got {info.stored_bytes - 10}" in message
    assert str(path) in message


def test_every_truncation_is_refused() -> None:
    data = encode_checkpoint(b"0123456789" * 5, compress=True)
    for cut in range(len(data)):
        with pytest.raises(CheckpointTruncatedError, match="truncated"):
            decode_checkpoint(data[:cut])


def test_flipped_payload_byte_names_sha256_and_file(tmp_path: Path) -> None:
    path = tmp_path / "c.rrc"
    write_checkpoint(path, PAYLOAD, compress=False)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as caught:
        read_checkpoint(path)
    assert "sha256 mismatch" in str(caught.value)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("compress", [True, False])
def test_every_single_byte_flip_is_detected(compress: bool) -> None:
    data = encode_checkpoint(b"some state " * 20, compress)
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x40
        with pytest.raises(CheckpointError):
            decode_checkpoint(bytes(damaged))


def test_unknown_format_version_names_itself(tmp_path: Path) -> None:
    data = bytearray(encode_checkpoint(b"payload", True))
    data[8:10] = struct.pack("<H", 7)
    path = tmp_path / "future.rrc"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "version 7" in message
    assert "supports version(s) 1" in message


def test_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a checkpoint at all\n")
    with pytest.raises(CheckpointFormatError, match="magic"):
        read_checkpoint(path)
    with pytest.raises(CheckpointFormatError, match="magic"):
        decode_checkpoint(b"xy")


def test_trailing_bytes_are_refused() -> None:
    data = encode_checkpoint(b"payload", False)
    with pytest.raises(CheckpointCorruptError, match="unexpected bytes"):
        decode_checkpoint(data + b"\x00")


def test_declared_size_limit_is_checked_before_decompression() -> None:
    bomb = encode_checkpoint(bytes(20 * 1024 * 1024), compress=True)
    assert len(bomb) < 100_000
    with pytest.raises(CheckpointFormatError, match="limit of 1048576"):
        decode_checkpoint(bomb, max_payload_bytes=1024 * 1024)
    assert len(decode_checkpoint(bomb, max_payload_bytes=20 * 1024 * 1024)) == 20 * 1024 * 1024


# --------------------------------------------------------------------------- failures


def test_failed_write_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.rrc"
    write_checkpoint(path, b"previous", compress=False)
    real_write_all = files.write_all

    def half_then_enospc(fd: int, parts: list[bytes]) -> None:
        real_write_all(fd, [parts[0][: len(parts[0]) // 2]])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # The one place durability writes go through: a torn write and a full disk injected.
    monkeypatch.setattr(files, "write_all", half_then_enospc)
    with pytest.raises(OSError) as caught:
        write_checkpoint(path, PAYLOAD, compress=False)
    assert caught.value.errno == errno.ENOSPC
    assert read_checkpoint(path) == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.rrc"]


def test_disk_full_on_a_real_small_filesystem(small_fs: Path) -> None:
    directory = CheckpointDirectory(small_fs)
    first = directory.save(b"p" * 200_000, step=1, compress=False)
    with pytest.raises(OSError) as caught:
        directory.save(os.urandom(2 * 1024 * 1024), step=2, compress=False)
    assert caught.value.errno == errno.ENOSPC
    assert sorted(p.name for p in small_fs.iterdir()) == [first.name]
    assert read_checkpoint(first) == b"p" * 200_000
    found = directory.newest_good()
    assert found.path == first and found.skipped == []
    directory.save(b"fits", step=3, compress=True)  # space was given back
    assert directory.newest_good().payload == b"fits"


# --------------------------------------------------------------------------- directory


def test_directory_names_and_listing(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path / "sess")
    paths = [directory.save(b"step %d" % s, s, compress=bool(s % 2)) for s in (3, 1, 20)]
    assert paths[0].name == "ckpt-000000000003.rrc"
    (tmp_path / "sess" / "ckpt-12.rrc").write_bytes(b"not ours")
    (tmp_path / "sess" / "README").write_text("x")
    assert [step for step, _ in directory.checkpoints()] == [1, 3, 20]
    for bad in (-1, True, 1.5, 10**12, "7"):
        with pytest.raises(ValueError, match="step"):
            directory.path_for(bad)  # type: ignore[arg-type]


def test_a_second_copy_of_a_step_is_listed_before_the_first_and_falls_back(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path)
    older = directory.save(b"older", 2)
    first = directory.save(b"state", 5)
    copy = directory.save(b"state", 5, copy=1)
    assert copy.name == "ckpt-000000000005.1.rrc"
    assert [p for _, p in directory.checkpoints()] == [older, copy, first]
    with pytest.raises(ValueError, match="copy"):
        directory.path_for(5, 10)
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))
    path, payload, skipped = directory.newest_good()
    assert (path, payload) == (copy, b"state") and [p for p, _ in skipped] == [first]
    assert directory.keep(2) == [older]


def test_newest_good_skips_corrupt_newest(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path)
    assert directory.newest_good() == (None, None, [])
    for step in (1, 2, 3):
        directory.save(b"state at %d" % step, step, compress=True)
    newest = directory.path_for(3)
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))

    path, payload, skipped = directory.newest_good()
    assert path == directory.path_for(2)
    assert payload == b"state at 2"
    assert len(skipped) == 1
    assert skipped[0][0] == newest
    assert "sha256 mismatch" in skipped[0][1]

    second = directory.path_for(2)
    second.write_bytes(second.read_bytes()[:20])
    path, payload, skipped = directory.newest_good()
    assert (path, payload) == (directory.path_for(1), b"state at 1")
    assert [p for p, _ in skipped] == [newest, second]
    assert "truncated" in skipped[1][1]

    directory.path_for(1).write_bytes(b"")
    path, payload, skipped = directory.newest_good()
    assert path is None and payload is None
    assert len(skipped) == 3


def test_keep_prunes_to_newest(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path)
    for step in range(1, 6):
        directory.save(b"%d" % step, step, compress=False)
    stale = tmp_path / ".ckpt-000000000009.rrc.abcd1234.tmp"
    stale.write_bytes(b"half written")
    other = tmp_path / "keep-me.txt"
    other.write_text("unrelated")

    removed = directory.keep(2)
    assert [p.name for p in removed] == [f"ckpt-{s:012d}.rrc" for s in (1, 2, 3)]
    assert [s for s, _ in directory.checkpoints()] == [4, 5]
    assert not stale.exists()
    assert other.exists()
    assert directory.keep(2) == []
    assert directory.keep(5) == []
    with pytest.raises(ValueError, match="k must be"):
        directory.keep(0)
    assert directory.newest_good().payload == b"5"


# --------------------------------------------------------------------------- safe_join


@pytest.mark.parametrize(
    "name",
    ["../../x", "/abs", "a/b", "", ".", "..", "a\\b", "nul\x00byte", "line\nbreak", "x" * 256],
)
def test_safe_join_refuses(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError) as caught:
        safe_join(tmp_path, name)
    assert repr(name) in str(caught.value)


@pytest.mark.parametrize("name", ["run-1", "my.session", "..hidden-ish", "é-unicode", "a b"])
def test_safe_join_accepts_plain_names(tmp_path: Path, name: str) -> None:
    joined = safe_join(tmp_path, name)
    assert joined == tmp_path / name
    assert joined.parent == tmp_path
    assert joined.resolve().parent == tmp_path.resolve()


def test_safe_join_rejects_non_strings(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        safe_join(tmp_path, b"bytes")  # type: ignore[arg-type]
