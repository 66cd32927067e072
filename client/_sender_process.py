"""A worker's Record stream in a process of its own: `RolloutRecorder(sender="process")`.

In the training process, the stream's threads (the sender, gRPC's request and completion
threads) each take the GIL several times a chunk. A loop busy in Python between calls (a
Gymnasium vector env) gives the GIL up to each of them after a switch interval, and pays
for every switch: recording CartPole's 8 sync envs cost its loop about a fifth of its speed
that way (bench `gym_record_rollouts`). Here the training process only checks a chunk and
writes it to a pipe; a child process (`python -m recorder_client._sender_process`) runs the
same `ChunkSender` on a connection of its own and reports back through a small shared file
(acks, counters, stats, under a sequence lock) and a pipe (errors, replies).

The child runs below the training process (SCHED_BATCH, nice +5, `SENDER_NICE`): its
wakeups do not preempt the loop, and a core both want goes mostly to the loop.

The child outlives a training process that dies: it sends what it was given (retrying for
`reconnect_timeout`) and exits. If the child dies, the recorder's next call raises.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from ._pending import PendingChunk, SenderStats, StreamStats, _to_host
from .errors import RecorderError

# The shared file: int64 slots, written by the child only. Slot 0 is a sequence lock: odd
# while the child writes the others.
_SLOTS = (
    "lock chunks_sent chunks_acked chunks_dropped_full raw_bytes wire_bytes reconnects "
    "sequences_lost chunks_joined frames is_full steps received_steps received_bytes "
    "in_flight stored refused received_chunks unanswered"
).split()
_AT = {name: i for i, name in enumerate(_SLOTS)}
_SIZE = 8 * len(_SLOTS)
# A frame: its pickle's length and its out-of-band buffers' count, their lengths, the
# pickle, the buffers (arrays go to the pipe from their own memory, not copied into a pickle).
_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
_PIPE_BYTES = 1 << 20
# How much lower than the training process this process runs: a contended core's time goes
# about 3:1 to the loop; the in-flight cap bounds how far this process can fall behind.
SENDER_NICE = 5
_F_SETPIPE_SZ = 1031  # Linux


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:  # over /proc/sys/fs/pipe-max-size, or not Linux: the default size
        pass


def _frame(obj: Any) -> list[Any]:
    """The frame of `obj` as the parts to write, in order."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    head = _HEADER.pack(len(data), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
    return [head, data, *raws]


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, _PIPE_BYTES))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> Any:
    """The next frame from a blocking fd; EOFError when the writer is gone."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        raise EOFError
    size, count = _HEADER.unpack(head)
    lengths = _read_exactly(fd, _LENGTH.size * count) if count else b""
    data = _read_exactly(fd, size)
    if lengths is None or data is None:
        raise EOFError
    buffers = []
    for (length,) in _LENGTH.iter_unpack(lengths):
        buffer = _read_exactly(fd, length) if length else b""
        if buffer is None:
            raise EOFError
        buffers.append(buffer)
    return pickle.loads(data, buffers=buffers)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it crosses a pipe intact, else a RecorderError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RecorderError(str(exc))


class ProcessSender:
    """ChunkSender's interface to RolloutRecorder, over a child process that runs one."""

    def __init__(self, spec: dict[str, Any], *, on_stored: Any, on_refused: Any) -> None:
        self._on_stored, self._on_refused = on_stored, on_refused
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="rollout-recorder-", suffix=".stream", dir=shm)
        try:
            os.ftruncate(fd, _SIZE)
            self._shared = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._shared, dtype=np.int64)
        level = logging.getLogger("recorder_client").getEffectiveLevel()
        spec = {**spec, "shared": path, "log_level": level}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "recorder_client._sender_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        except BaseException:
            os.unlink(path)
            raise
        self._w = self._proc.stdin.fileno()  # type: ignore[union-attr]
        self._r = self._proc.stdout.fileno()  # type: ignore[union-attr]
        _grow_pipe(self._w)
        os.set_blocking(self._w, False)  # a full pipe: take the child's reports meanwhile
        self._lock = threading.Lock()  # one writer of chunks and commands at a time
        self._errors: list[RecorderError] = []
        self._fatal: RecorderError | None = None
        self.fatal_reported = False
        self._unseen = False
        self._frames_read = 0
        self._last_schema: Any = None
        self._stored_seen = self._refused_seen = 0
        self._sent_steps = self._sent_bytes = self._sent_chunks = 0
        self._replies: list[Any] = []
        self._closed = False
        self.stats = SenderStats()
        try:
            self._send_blocking(spec)
            reply = self._reply("ready", None)
        finally:
            os.unlink(path)
        if reply[1] is not None:
            self._proc.wait(10)
            raise reply[1]

    # -- writing ---------------------------------------------------------
    def _send_blocking(self, obj: Any) -> None:
        parts = _frame(obj)
        data: Any = None
        try:
            written = os.writev(self._w, parts)
        except BlockingIOError:
            written = 0
        except BrokenPipeError:
            self._died()
        if written < sum(memoryview(p).nbytes for p in parts):  # the pipe filled: the rest
            data = memoryview(b"".join(parts))[written:]
            self._read_ready()
            select.select([], [self._w], [], 0.05)
        while data:
            try:
                data = data[os.write(self._w, data) :]
            except BlockingIOError:
                pass
            except BrokenPipeError:
                self._died()
            if data:  # the pipe is full: the child is behind; take its reports meanwhile
                self._read_ready()
                select.select([], [self._w], [], 0.05)

    def _died(self) -> None:
        try:
            code: int | None = self._proc.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        acked = int(self._slots[_AT["chunks_acked"]])
        error = RecorderError(
            f"the recorder's sender process exited (code {code}) after {acked} acknowledged "
            "chunks; chunks recorded after those may not be stored"
        )
        if self._fatal is None:
            self._fatal = error
            self._unseen = True
        raise self._fatal

    # -- reading ---------------------------------------------------------
    def _read_ready(self) -> None:
        """Take the frames the child wrote (it counts them after writing each)."""
        written = int(self._slots[_AT["frames"]])
        while self._frames_read < written:
            self._take(self._next_frame())

    def _next_frame(self) -> Any:
        try:
            frame = _read_frame(self._r)
        except EOFError:
            self._died()
        self._frames_read += 1
        return frame

    def _take(self, frame: Any) -> None:
        kind = frame[0]
        if kind == "error":
            _, error, fatal = frame
            if fatal:
                self._fatal = error
            else:
                self._errors.append(error)
            self._unseen = True
        else:
            self._replies.append(frame)

    def _reply(self, kind: str, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout + 5.0
        while True:
            for frame in self._replies:
                if frame[0] == kind:
                    self._replies.remove(frame)
                    return frame
            if deadline is not None:
                ready, _, _ = select.select([self._r], [], [], max(0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError(f"the recorder's sender process did not answer {kind!r}")
            self._take(self._next_frame())

    def _view(self) -> np.ndarray:
        """The shared slots, read whole between two writes of the child's."""
        slots = self._slots
        while True:
            before = int(slots[0])
            if before % 2 == 0:
                copy = slots.copy()
                if int(slots[0]) == before:
                    return copy
            time.sleep(0)

    def _follow(self) -> None:
        """Take what the child reported since the last call: its errors, and its stored and
        refused chunks (the recorder's layout bookkeeping, before record() checks a chunk)."""
        if self._closed:
            return
        self._read_ready()
        stored, refused = int(self._slots[_AT["stored"]]), int(self._slots[_AT["refused"]])
        if stored != self._stored_seen:
            self._stored_seen = stored
            self._on_stored(PendingChunk(0, 0, None, schema=self._last_schema))
        if refused != self._refused_seen:
            self._refused_seen = refused
            self._on_refused(PendingChunk(0, 0, None))

    # -- ChunkSender's interface -----------------------------------------
    def follow(self) -> None:
        with self._lock:
            self._follow()

    @property
    def unseen(self) -> bool:
        """Whether an error waits for the caller: read, or written by the child and unread."""
        return self._unseen or int(self._slots[_AT["frames"]]) > self._frames_read

    def submit(self, item: PendingChunk, *, block: bool) -> bool:
        self._raise_fatal()
        # Each array as (name, dtype, shape) and its memory, sent out of band: no pickling of
        # numpy objects on the training loop's thread.
        layout, memory = [], []
        for name, value in (item.arrays or {}).items():
            array = np.ascontiguousarray(_to_host(value))
            layout.append((name, array.dtype.str, array.shape))
            memory.append(pickle.PickleBuffer(array) if array.size else b"")
        header = (
            "chunk",
            item.raw_bytes,
            item.length,
            item.envs,
            item.dones,
            item.cut_before,
            item.fresh_start,
            layout,
            memory,
        )
        with self._lock:  # the child's reports were taken by follow(), this call's first step
            self._send_blocking(header)
            self._sent_steps += item.length
            self._sent_bytes += item.raw_bytes
            self._sent_chunks += 1
            self._last_schema = item.schema
        return True

    def flush(self, timeout: float | None = None) -> None:
        with self._lock:
            self._raise_fatal()
            if self._answered():  # no round trip to the child (each learn() ends in a flush)
                self._follow()
                self._raise_fatal()
                return
            self._send_blocking(("flush", timeout))
            _, error, kind = self._reply("flushed", timeout)
            self._follow()
        if kind == "fatal" and self._fatal is None:
            self._fatal = error
        if kind in ("timeout", "exhausted"):
            raise error
        self._raise_fatal()  # refusals: raised by the recorder from take_errors()

    def _answered(self) -> bool:
        """Whether the child took every chunk sent and holds none unanswered (nor an error
        it has yet to write: its reports come before the count that shows them answered)."""
        view = self._view()
        return (
            int(view[_AT["received_chunks"]]) == self._sent_chunks
            and int(view[_AT["unanswered"]]) == 0
        )

    def take_errors(self) -> list[RecorderError]:
        with self._lock:
            self._follow()
            errors, self._errors = self._errors, []
            if not errors and self._fatal is not None and not self.fatal_reported:
                self.fatal_reported = True
                errors = [self._fatal]
            self._unseen = self._fatal is not None and not self.fatal_reported
            return errors

    def _raise_fatal(self) -> None:  # a dead child: the next write finds its pipe broken
        if self._fatal is not None:
            self.fatal_reported = True
            raise self._fatal

    def counters(self) -> tuple[bool, int]:
        view = self._view()
        in_pipe = self._sent_steps - int(view[_AT["received_steps"]])
        return bool(view[_AT["is_full"]]), int(view[_AT["steps"]]) + in_pipe

    def take_counters(self, status: Any, through: int) -> None:
        with self._lock:
            self._send_blocking(("counters", status.SerializeToString()))

    def join_limits(self, max_chunk_bytes: int, max_chunk_env_steps: int) -> None:
        pass  # the child joins, and keeps to the limits of its own joins

    @property
    def bytes_in_flight(self) -> int:
        view = self._view()
        return int(view[_AT["in_flight"]]) + self._sent_bytes - int(view[_AT["received_bytes"]])

    def snapshot(self) -> StreamStats:
        view = self._view()
        names = "chunks_sent chunks_acked chunks_dropped_full raw_bytes wire_bytes reconnects"
        counts = {k: int(view[_AT[k]]) for k in (names + " sequences_lost chunks_joined").split()}
        return StreamStats(chunks_dropped_in_flight=0, **counts)

    def close(self) -> None:
        try:
            with self._lock:
                if self._proc.poll() is None:
                    self._send_blocking(("close",))
                    self._reply("closed", 15.0)
        except (RecorderError, TimeoutError):
            pass
        finally:
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._closed = True
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()  # type: ignore[union-attr]
                except OSError:
                    pass


# -- the child -----------------------------------------------------------------------------
class _Child:
    def __init__(self, spec: dict[str, Any], out: int) -> None:
        from ._connection import Connection
        from ._proto import recorder_pb2 as pb
        from ._stream import ChunkSender

        self.pb = pb
        fd = os.open(spec["shared"], os.O_RDWR)
        try:
            self.shared = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self.slots = np.frombuffer(self.shared, dtype=np.int64)
        self.out_lock = threading.Lock()
        self.spec = spec
        self.out = out
        self.stored = self.refused = 0
        self.received_steps = self.received_bytes = self.received_chunks = 0
        self.frames = 0
        self.orphaned = False
        self.joined = pb.JoinReply.FromString(spec["joined"])
        self.sequence = spec["sequence"]
        self.connection = Connection(spec["target"], **spec["connection"])
        self.sender = ChunkSender(
            connection=self.connection,
            join=self.join,
            session=spec["session"],
            worker_id=spec["worker_id"],
            instance=spec["instance"],
            loss=lambda: self.joined.loss if self.joined.HasField("loss") else None,
            target=spec["target"],
            max_bytes_in_flight=spec["max_bytes_in_flight"],
            compression_level=spec["compression_level"],
            reconnect_timeout=spec["reconnect_timeout"],
            wire=self.wire,
            on_stored=self.on_stored,
            on_refused=self.on_refused,
            on_error=self.on_error,
            raise_data_loss=spec["raise_data_loss"],
            linger_s=spec["linger_s"],
            # The wake record() would save is this process's own: polling only adds wake-ups
            # that can land on the training loop's core.
            poll=False,
            status_call=lambda done: self.connection.call_async(
                "GetStatus",
                pb.StatusRequest(session=spec["session"], counters_only=True),
                done,
            ),
        )
        self.sender.take_counters(self.joined.status, self.sequence)
        self.sender.join_limits(self.joined.max_chunk_bytes, self.joined.max_chunk_env_steps)

    def wire(self) -> tuple[bool, int]:
        from ._connection import wire_options

        return wire_options(self.joined)

    def join(self, acked: int = 0) -> int:
        pb = self.pb
        request = pb.JoinRequest(
            session=self.spec["session"],
            config=pb.SessionConfig.FromString(self.spec["config"]),
            worker_id=self.spec["worker_id"],
            acked_sequence=acked,
            instance_id=self.spec["instance"],
        )
        reply = self.connection.connect("Join", request)
        self.joined = reply
        self.sender.take_counters(reply.status, reply.last_sequence)
        self.sender.join_limits(reply.max_chunk_bytes, reply.max_chunk_env_steps)
        self.publish()
        return int(reply.last_sequence)

    # -- reports ---------------------------------------------------------
    def write(self, *frames: Any) -> None:
        """Errors the sender holds for the caller, then `frames`, in that order."""
        with self.out_lock:
            while errors := self.sender.take_errors():  # the failure comes after the rest
                for error in errors:
                    fatal = error is self.sender._fatal
                    self._write(("error", _portable(error), fatal))
            for frame in frames:
                self._write(frame)

    def _write(self, frame: Any) -> None:
        if self.orphaned:
            return
        try:
            _write_all(self.out, _frame(frame))
        except BrokenPipeError:  # the training process is gone; its chunks are still sent
            self.orphaned = True
            return
        self.frames += 1  # after the frame: the parent reads only frames whole
        self.publish()

    def publish(self) -> None:
        """The shared slots, under the sequence lock (and the sender's: one writer)."""
        with self.sender._cond:
            self._publish()

    def _publish(self) -> None:
        s, sender = self.slots, self.sender
        stats = sender.stats
        view = sender._view or (False, 0)
        values = (
            stats.chunks_sent,
            stats.chunks_acked,
            stats.chunks_dropped_full,
            stats.raw_bytes,
            stats.wire_bytes,
            stats.reconnects,
            stats.sequences_lost,
            stats.chunks_joined,
            self.frames,
            int(view[0]),
            view[1],
            self.received_steps,
            self.received_bytes,
            sender.bytes_in_flight,
            self.stored,
            self.refused,
            self.received_chunks,
            # Queued, unacknowledged, or an error not yet handed to on_error (a refusal
            # arrives with an ack: its frame is written after this count drops).
            len(sender._to_send) + len(sender._unacked) + len(sender._outbox),
        )
        s[0] += 1
        s[1:] = values
        s[0] += 1

    def on_stored(self, item: PendingChunk) -> None:
        self.stored += 1
        self.publish()

    def on_refused(self, item: PendingChunk) -> None:
        # Published with the refusal's frame (on_error follows): the parent sees the ack
        # no sooner than the error it must raise.
        self.refused += 1

    def on_error(self, error: RecorderError) -> None:
        self.write()  # the sender's errors, each once (take_errors), in order

    # -- commands --------------------------------------------------------
    def run(self) -> None:
        while True:
            try:
                frame = _read_frame(0)
            except EOFError:  # the training process is gone: send what it gave, then exit
                self.finish(self.spec["reconnect_timeout"])
                return
            kind = frame[0]
            if kind == "chunk":
                self.chunk(*frame[1:])
            elif kind == "flush":
                self.write(("flushed", *self.flush(frame[1])))
            elif kind == "counters":
                self.sender.take_counters(self.pb.StatusReply.FromString(frame[1]), self.sequence)
                self.publish()
            elif kind == "close":  # after the parent's flush: what is left gets 10 s, as threads
                self.finish(10.0)
                self.write(("closed",))
                return

    def chunk(self, raw, length, envs, dones, cut, fresh, layout, memory) -> None:
        arrays = {
            name: np.frombuffer(buffer, dtype).reshape(shape)
            for (name, dtype, shape), buffer in zip(layout, memory)
        }
        item = PendingChunk(
            self.sequence + 1,
            raw,
            arrays,
            length=length,
            dones=dones,
            envs=envs,
            cut_before=cut,
            fresh_start=fresh,
        )
        # Which chunks may join one message (linger_ms): those of one layout.
        item.signature = tuple((name, shape[1:], dtype) for name, dtype, shape in layout)
        try:
            self.sender.submit(item, block=True)
        except RecorderError as exc:  # the stream failed: the parent raises it from now on
            with self.out_lock:
                self._write(("error", _portable(exc), True))
            return
        if not item.merged:
            self.sequence += 1
        with self.sender._cond:  # the counters and what is received change together
            self.received_steps += length
            self.received_bytes += raw
            self.received_chunks += 1
            self.publish()

    def flush(self, timeout: float | None) -> tuple[BaseException | None, str | None]:
        """Wait for every ack: (None, None), or the error that ended the wait and its kind:
        "timeout", "exhausted" (the server is out of space) or "fatal"."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.sender.flush(left)
                return None, None
            except TimeoutError as exc:
                return exc, "timeout"
            except RecorderError as exc:
                if exc is self.sender._fatal:
                    return _portable(exc), "fatal"
                if exc is self.sender._exhausted:
                    return _portable(exc), "exhausted"
                with self.out_lock:  # a refusal flush() took out of the sender's list
                    self._write(("error", _portable(exc), False))

    def finish(self, timeout: float | None) -> None:
        try:
            if self.sender._fatal is None:
                self.flush(timeout)
        finally:
            self.sender.close()
            self.connection.close()


def _yield_to_the_trainer() -> None:
    """Background work for the training loop: a chunk that wakes this process does not
    preempt the loop where both share a core (SCHED_BATCH), and where they contend for one
    the loop gets most of it (nice + SENDER_NICE). With neither, this process and the server
    preempted CartPole's loop about 12 times a 160 ms round, with both 4-9 times (bench
    `gym_record_rollouts`)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        pass
    try:
        os.nice(SENDER_NICE)
    except (AttributeError, OSError):
        pass


def _write_all(fd: int, parts: list[Any]) -> None:
    view = memoryview(b"".join(parts))
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    # Ctrl-C reaches the whole process group: the training process's close() sends what
    # is left, which this process must still be there to send.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _yield_to_the_trainer()
    out = os.dup(1)  # frames only: anything printed goes to stderr
    os.dup2(2, 1)
    _grow_pipe(out)
    spec = _read_frame(0)
    logging.basicConfig(level=spec["log_level"], format="%(name)s (sender process): %(message)s")
    try:
        child = _Child(spec, out)
    except BaseException as exc:  # the parent raises it from RolloutRecorder()
        _write_all(out, _frame(("ready", _portable(exc))))
        return
    child.write(("ready", None))
    child.run()


if __name__ == "__main__":
    main()
