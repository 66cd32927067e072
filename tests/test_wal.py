"""Write-ahead log: append/replay, torn tails, corruption, truncation, fsync, threads, ENOSPC."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest

from recorder_server.durability import files
from recorder_server.durability.wal import (
    WALError,
    WALFormatError,
    WriteAheadLog,
    replay,
)

HEADER = 24  # record header bytes (see the module docstring)


def _record(i: int) -> bytes:
    return b"record-%05d:" % i + bytes([i % 251]) * (i % 37)


def _fill(directory: Path, n: int, **kwargs: object) -> list[bytes]:
    records = [_record(i) for i in range(n)]
    with WriteAheadLog(directory, **kwargs) as log:  # type: ignore[arg-type]
        for i, record in enumerate(records):
            assert log.append(record) == i
    return records


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("wal-*.log"))


# --------------------------------------------------------------------------- basics


def test_append_and_replay_round_trip(tmp_path: Path) -> None:
    records = _fill(tmp_path / "wal", 50)
    result = replay(tmp_path / "wal")
    assert result.clean
    assert list(result) == list(enumerate(records))
    assert len(result) == 50
    assert result.next_index == 50
    assert result.dropped_bytes == 0 and result.dropped_records == 0
    assert [p.name for p in _segments(tmp_path / "wal")] == ["wal-0000000000000000.log"]


def test_empty_records_and_bytes_likes(tmp_path: Path) -> None:
    with WriteAheadLog(tmp_path) as log:
        log.append(b"")
        log.append(bytearray(b"ba"))
        log.append(memoryview(b"xxmvxx")[2:4])
        log.append(memoryview(struct.pack("<4I", 1, 2, 3, 4)).cast("I"))
    assert list(replay(tmp_path)) == [
        (0, b""),
        (1, b"ba"),
        (2, b"mv"),
        (3, struct.pack("<4I", 1, 2, 3, 4)),
    ]


def test_missing_directory_is_an_empty_log(tmp_path: Path) -> None:
    result = replay(tmp_path / "nope", start_index=7)
    assert list(result) == [] and result.clean and result.next_index == 7


def test_segments_roll_and_replay_in_order(tmp_path: Path) -> None:
    records = _fill(tmp_path, 60, segment_bytes=300)
    segments = _segments(tmp_path)
    assert len(segments) > 5
    assert all(path.stat().st_size <= 300 for path in segments)
    result = replay(tmp_path)
    assert result.clean and result.segments == len(segments)
    got = list(result)
    assert got == list(enumerate(records))
    # every segment is named after the index of its first record
    firsts = [int(p.name[4:20]) for p in segments]
    assert firsts[0] == 0 and firsts == sorted(firsts)
    with open(segments[1], "rb") as f:
        f.seek(24)
        assert struct.unpack("<4sIQ", f.read(16))[2] == firsts[1]


def test_oversized_record_gets_its_own_segment(tmp_path: Path) -> None:
    with WriteAheadLog(tmp_path, segment_bytes=200) as log:
        log.append(b"a")
        log.append(b"B" * 1000)
        log.append(b"c")
    assert len(_segments(tmp_path)) == 3
    assert [r for _, r in replay(tmp_path)] == [b"a", b"B" * 1000, b"c"]


def test_reopen_continues_indexes(tmp_path: Path) -> None:
    first = _fill(tmp_path, 5)
    with WriteAheadLog(tmp_path) as log:
        assert log.next_index == 5
        assert log.append(b"six") == 5
    assert [r for _, r in replay(tmp_path)] == [*first, b"six"]


def test_start_index_for_new_and_behind_logs(tmp_path: Path) -> None:
    with WriteAheadLog(tmp_path / "new", start_index=100) as log:
        assert log.append(b"x") == 100
    assert _segments(tmp_path / "new")[0].name == "wal-0000000000000100.log"

    _fill(tmp_path / "old", 5)
    with WriteAheadLog(tmp_path / "old", start_index=10) as log:
        assert log.append(b"after checkpoint") == 10
    result = replay(tmp_path / "old", start_index=10)
    assert result.clean
    assert list(result) == [(10, b"after checkpoint")]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'sometimes'"):
        WriteAheadLog(tmp_path, fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="segment_bytes"):
        WriteAheadLog(tmp_path, segment_bytes=10)
    with WriteAheadLog(tmp_path) as log:
        pass
    with pytest.raises(WALError, match="closed"):
        log.append(b"late")


def test_one_writer_per_directory(tmp_path: Path) -> None:
    with WriteAheadLog(tmp_path) as log:
        log.append(b"a")
        with pytest.raises(WALError, match="in use"):
            WriteAheadLog(tmp_path)
        with pytest.raises(WALError, match="in use"):
            replay(tmp_path)
        assert list(replay(tmp_path, repair=False)) == [(0, b"a")]
    with WriteAheadLog(tmp_path) as log:  # released by close()
        assert log.next_index == 1


def test_unknown_segment_version(tmp_path: Path) -> None:
    _fill(tmp_path, 3)
    path = _segments(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[8:10] = struct.pack("<H", 9)
    data[20:24] = struct.pack("<I", zlib.crc32(bytes(data[:20])))
    path.write_bytes(bytes(data))
    with pytest.raises(WALFormatError, match="version 9"):
        replay(tmp_path)


# --------------------------------------------------------------------------- torn tails


def _last_record_offset(path: Path) -> int:
    data = path.read_bytes()
    offset, last = 24, 24
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset + 4)
        last, offset = offset, offset + HEADER + length
    return last


def _tear(path: Path, how: str) -> int:
    """Damage the tail of ``path`` like an interrupted append; return bytes to be dropped."""
    data = path.read_bytes()
    last = _last_record_offset(path)
    if how == "short-header":
        path.write_bytes(data[: last + 10])
        return 10
    if how == "short-body":
        path.write_bytes(data[:-3])
        return len(data) - 3 - last
    if how == "crc-at-end":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        return len(data) - last
    if how == "zero-fill":
        path.write_bytes(data + bytes(100))
        return 100
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["short-header", "short-body", "crc-at-end", "zero-fill"])
def test_torn_tail_is_dropped_reported_and_truncated(tmp_path: Path, how: str) -> None:
    records = _fill(tmp_path, 30, segment_bytes=400)
    last_segment = _segments(tmp_path)[-1]
    dropped = _tear(last_segment, how)
    kept = records if how == "zero-fill" else records[:-1]

    result = replay(tmp_path)
    assert [r for _, r in result] == kept
    assert result.dropped_bytes == dropped
    assert result.dropped_records == 1
    assert result.dropped_segment == last_segment
    assert result.corruptions == []
    assert not result.clean
    assert result.next_index == len(kept)

    again = replay(tmp_path)  # the tail was truncated from the file
    assert again.clean and [r for _, r in again] == kept

    with WriteAheadLog(tmp_path, segment_bytes=400) as log:
        assert log.append(b"after the tear") == len(kept)
    final = replay(tmp_path)
    assert final.clean
    assert [r for _, r in final] == [*kept, b"after the tear"]


@pytest.mark.parametrize("how", ["short-header", "short-body", "crc-at-end", "zero-fill"])
def test_writer_alone_truncates_torn_tail(tmp_path: Path, how: str) -> None:
    records = _fill(tmp_path, 10)
    _tear(_segments(tmp_path)[0], how)
    kept = records if how == "zero-fill" else records[:-1]
    with WriteAheadLog(tmp_path) as log:
        assert log.append(b"next") == len(kept)
    assert [r for _, r in replay(tmp_path)] == [*kept, b"next"]


def test_torn_segment_header_of_a_fresh_segment(tmp_path: Path) -> None:
    records = _fill(tmp_path, 20, segment_bytes=200)
    last = _segments(tmp_path)[-1]
    first_lost = int(last.name[4:20])
    last.write_bytes(last.read_bytes()[:11])  # even the segment header is torn
    result = replay(tmp_path)
    assert [r for _, r in result] == records[:first_lost]
    assert result.dropped_bytes == 11 and result.dropped_segment == last
    with WriteAheadLog(tmp_path, segment_bytes=200) as log:
        assert log.append(b"z") == first_lost
    assert [r for _, r in replay(tmp_path)] == [*records[:first_lost], b"z"]


# --------------------------------------------------------------------------- corruption


def _flip_in_record(path: Path, record_number: int) -> int:
    """Flip a body byte of the record_number-th record of a segment; return its index."""
    data = bytearray(path.read_bytes())
    offset = 24
    for _ in range(record_number):
        (length,) = struct.unpack_from("<I", data, offset + 4)
        offset += HEADER + length
    index = struct.unpack_from("<Q", data, offset + 8)[0]
    data[offset + HEADER] ^= 0x01
    path.write_bytes(bytes(data))
    return index


def test_corruption_in_a_middle_segment_is_reported_and_later_segments_kept(
    tmp_path: Path,
) -> None:
    records = _fill(tmp_path, 60, segment_bytes=300)
    segments = _segments(tmp_path)
    assert len(segments) >= 4
    bad_index = _flip_in_record(segments[1], 1)
    resume = int(segments[2].name[4:20])
    size_before = segments[1].stat().st_size

    result = replay(tmp_path)
    assert not result.clean and result.torn_tail is None
    [corruption] = result.corruptions
    assert corruption.segment == segments[1]
    assert corruption.first_missing == bad_index
    assert corruption.missing_until == resume
    assert "crc32" in corruption.reason
    expected = [(i, r) for i, r in enumerate(records) if not bad_index <= i < resume]
    assert list(result) == expected
    assert len(result) == len(expected)
    assert segments[1].stat().st_size == size_before  # corrupt bytes are never deleted


def test_corrupt_last_segment_is_kept_and_writer_moves_on(tmp_path: Path) -> None:
    records = _fill(tmp_path, 10)
    [segment] = _segments(tmp_path)
    bad_index = _flip_in_record(segment, 4)
    size_before = segment.stat().st_size

    result = replay(tmp_path)
    [corruption] = result.corruptions
    assert (corruption.first_missing, corruption.missing_until) == (bad_index, None)
    assert [r for _, r in result] == records[:bad_index]
    assert segment.stat().st_size == size_before
    assert result.next_index > len(records) - 1  # past anything the bad bytes could hold

    with WriteAheadLog(tmp_path) as log:
        new_index = log.append(b"new")
    assert new_index == result.next_index
    assert len(_segments(tmp_path)) == 2
    after = replay(tmp_path)
    [corruption] = after.corruptions
    assert corruption.missing_until == new_index
    assert list(after) == [*enumerate(records[:bad_index]), (new_index, b"new")]


def test_missing_middle_segment_is_a_reported_gap(tmp_path: Path) -> None:
    _fill(tmp_path, 60, segment_bytes=300)
    segments = _segments(tmp_path)
    segments[2].unlink()
    result = replay(tmp_path)
    [gap] = result.corruptions
    assert gap.segment == segments[3]
    assert gap.first_missing == int(segments[2].name[4:20])
    assert gap.missing_until == int(segments[3].name[4:20])
    indexes = [i for i, _ in result]
    assert indexes == [i for i in range(60) if not gap.first_missing <= i < gap.missing_until]


# --------------------------------------------------------------------------- truncation


def test_truncate_before_drops_only_fully_covered_segments(tmp_path: Path) -> None:
    records = [_record(i) for i in range(100)]
    with WriteAheadLog(tmp_path, segment_bytes=400) as log:
        for record in records:
            log.append(record)
        firsts = [int(p.name[4:20]) for p in log.segment_paths()]
        removed = log.truncate_before(50)
        remaining = [int(p.name[4:20]) for p in log.segment_paths()]
        assert removed == len(firsts) - len(remaining) > 0
        assert remaining[0] <= 50 and (len(remaining) == 1 or remaining[1] > 50)
        assert remaining == [f for f in firsts if f >= remaining[0]]
        assert [int(p.name[4:20]) for p in _segments(tmp_path)] == remaining

        result = replay(tmp_path, start_index=50, repair=False)
        assert result.clean
        assert list(result) == [(i, records[i]) for i in range(50, 100)]
        full = replay(tmp_path, repair=False)
        assert [i for i, _ in full] == list(range(remaining[0], 100))

        log.truncate_before(10**9)  # never removes the current segment
        assert len(log.segment_paths()) == 1
        assert log.append(b"still works") == 100
    assert list(replay(tmp_path, start_index=100)) == [(100, b"still works")]


# --------------------------------------------------------------------------- fsync


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
def test_fsync_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    calls: list[int] = []
    real = files.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(files, "fdatasync", counting)
    log = WriteAheadLog(tmp_path, fsync=policy, batch_window_s=0.02)  # type: ignore[arg-type]
    try:
        opened = len(calls)
        for i in range(5):
            log.append(b"r%d" % i)
            assert list(replay(tmp_path, repair=False))[-1] == (i, b"r%d" % i)
        if policy == "always":
            assert len(calls) - opened == 5
        elif policy == "never":
            assert len(calls) == opened == 0
        else:
            deadline = time.monotonic() + 2
            while len(calls) == opened and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(calls) > opened  # the background flusher synced without being asked
        before = len(calls)
        log.append(b"last")
        log.sync()
        assert len(calls) > before or policy == "batch"
    finally:
        log.close()
    assert [r for _, r in replay(tmp_path)][-1] == b"last"


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("policy", ["always", "batch"])
def test_concurrent_appends_replay_exactly_once(tmp_path: Path, policy: str) -> None:
    threads, per_thread = 8, 150
    given: dict[int, bytes] = {}
    given_lock = threading.Lock()
    log = WriteAheadLog(tmp_path, fsync=policy, segment_bytes=4096)  # type: ignore[arg-type]
    start = threading.Barrier(threads)

    def worker(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            record = b"thread %d item %d " % (t, i) + bytes(i % 50)
            index = log.append(record)
            with given_lock:
                assert index not in given
                given[index] = record

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    log.close()

    total = threads * per_thread
    assert sorted(given) == list(range(total))
    result = replay(tmp_path)
    assert result.clean
    assert len(_segments(tmp_path)) > 1
    assert list(result) == sorted(given.items())


# --------------------------------------------------------------------------- disk full


def test_failed_append_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write_all = files.write_all

    def half_then_enospc(fd: int, parts: list[memoryview]) -> None:
        real_write_all(fd, [parts[0], parts[1][: parts[1].nbytes // 2]])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with WriteAheadLog(tmp_path) as log:
        log.append(b"one")
        with monkeypatch.context() as patched:
            patched.setattr(files, "write_all", half_then_enospc)
            with pytest.raises(OSError) as caught:
                log.append(b"x" * 1000)
        assert caught.value.errno == errno.ENOSPC
        assert log.append(b"two") == 1
    result = replay(tmp_path)
    assert result.clean
    assert list(result) == [(0, b"one"), (1, b"two")]


def test_unrecoverable_append_failure_disables_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write_all = files.write_all

    def half_then_eio(fd: int, parts: list[memoryview]) -> None:
        real_write_all(fd, [parts[0], parts[1][:10]])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "truncate failed too")

    log = WriteAheadLog(tmp_path)
    log.append(b"kept")
    with monkeypatch.context() as patched:
        patched.setattr(files, "write_all", half_then_eio)
        patched.setattr(os, "ftruncate", no_truncate)
        with pytest.raises(OSError):
            log.append(b"y" * 100)
    with pytest.raises(WALError, match="unusable"):
        log.append(b"refused")
    log.close()

    result = replay(tmp_path)  # the partial record is a torn tail
    assert list(result) == [(0, b"kept")]
    assert result.dropped_bytes == HEADER + 10
    with WriteAheadLog(tmp_path) as log:
        assert log.append(b"recovered") == 1


def test_disk_full_on_a_real_small_filesystem(small_fs: Path) -> None:
    accepted: list[bytes] = []
    with WriteAheadLog(small_fs / "wal") as log:
        with pytest.raises(OSError) as caught:
            for i in range(100):
                record = bytes([i]) * 100_000
                log.append(record)
                accepted.append(record)
        assert caught.value.errno == errno.ENOSPC
        assert 3 < len(accepted) < 100
        assert log.append(b"small one fits") == len(accepted)
    result = replay(small_fs / "wal")
    assert result.clean
    assert [r for _, r in result] == [*accepted, b"small one fits"]
