"""RolloutRecorder: the in-process recorder's API, recording into a remote server."""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import _checks, _chunk, _torch, _wire
from ._chunk import take as _take
from ._connection import Connection, wire_options
from ._credentials import PemSource
from ._finish import assemble as _assemble
from ._finish import checked, raises_on_loss
from ._launch import EmbeddedServer
from ._messages import file_parts, join_parts, session_status
from ._proto import recorder_pb2 as pb
from ._stream import ChunkSender, PendingChunk, StreamStats
from ._torch import STARTED as _started
from ._torch import fence_copies as _fence_copies
from .capture import RemoteCapture
from .capture_types import TrajectoryTrainingConfiguration
from .errors import InvalidChunkError, InvalidNameError, RecorderError, WorkerIdInUseError
from .status import SessionStatus
from .trajectory import Trajectory

logger = logging.getLogger(__name__)

_JOINED_HERE: set[tuple[int, str, str]] = set()  # (pid, session, worker_id) joined here

TARGET_ENV = "ROLLOUT_RECORDER_TARGET"
DEFAULT_STATE_FIELDS = ("player_positions", "player_inventory")


class RolloutRecorder:
    """Drop-in remote twin of `factoriax.analysis.recorder.RolloutRecorder`.

    `record()` returns at once; a background thread compresses and streams the
    chunk. `finish()` waits for every chunk of this worker to be acknowledged,
    then asks the server for the padded trajectory of the whole session.

    `linger_ms` (0: off): a chunk under 1 MiB recorded within `linger_ms` of the one before
    waits up to that long for the next ones, which join it along time into one message
    (fewer wake-ups of the client's threads in a loop recording small chunks quickly). The
    server takes its episodes call by call as before; sequences, chunk counts and loss
    reports count messages (docs/concepts.md). Never with `max_episodes`.

    `sender="process"`: the stream runs in a child process of its own instead of threads of
    this one. For a loop busy in Python between calls (a Gymnasium or SB3 loop), whose
    speed the stream's threads cost in GIL hand-overs: `record()` then checks the chunk and
    writes it to a pipe, and the child sends it (and what was recorded when this process
    dies). Device arrays are read in `record()`; errors of earlier chunks are raised by a
    later call, not handed to `on_error`. Not with `max_episodes`, `on_error` or
    `on_backpressure="drop"`.

    `record_obs=False` leaves a `trajectories` struct's `obs` and `final_obs` unread:
    a struct that carries observations for other uses (purejaxrl's `Transition`) then
    records exactly the fields factoriax's recorder does.

    Without `target` (and without ROLLOUT_RECORDER_TARGET) the client starts a
    private server process and stops it on `close()`.

    An error that arrives after `record()` returned (a chunk the server refused,
    chunks lost after their ack, the stream's failure) is raised by this
    recorder's next call of any kind: `record`, `flush`, `finish`, `is_full`,
    `num_recorded_steps`, `status`, `close`; each error once, and acknowledged
    chunks stay. `on_error(exc)`, if given, is also called with each one as it
    arrives, on the stream's background thread: keep it short (an exception it
    raises is logged).
    """

    def __init__(
        self,
        max_episodes: int | None = None,
        record_states: bool = False,
        state_fields: list[str] | tuple[str, ...] = DEFAULT_STATE_FIELDS,
        *,
        target: str | None = None,
        session: str = "default",
        worker_id: str | None = None,
        connect_timeout: float = 10.0,
        rpc_timeout: float = 300.0,
        reconnect_timeout: float = 60.0,
        keepalive_seconds: float = 10.0,
        max_bytes_in_flight: int = 256 << 20,
        on_backpressure: str = "block",
        compression_level: int = 1,
        token: str | None = None,
        root_certificates: PemSource = None,
        client_certificate: PemSource = None,
        client_key: PemSource = None,
        capture: TrajectoryTrainingConfiguration | None = None,
        on_data_loss: str = "raise",
        on_error: Callable[[RecorderError], None] | None = None,
        record_obs: bool = True,
        linger_ms: float = 0.0,
        sender: str = "thread",
    ) -> None:
        _wire.check_options(
            max_episodes, on_backpressure, keepalive_seconds, max_bytes_in_flight, linger_ms
        )
        _check_sender(
            sender,
            {
                "max_episodes": max_episodes,
                "on_error": on_error,
                "on_backpressure": on_backpressure,
            },
        )
        raise_loss = raises_on_loss(on_data_loss)
        if on_error is not None and not callable(on_error):
            raise ValueError(f"on_error: expected a callable or None, got {on_error!r}")
        try:
            _wire.check_session_name(session)
            if worker_id is not None:
                _wire.check_worker_id(worker_id)
        except ValueError as exc:
            raise InvalidNameError(str(exc)) from None
        self.max_episodes = None if max_episodes is None else int(max_episodes)
        self.record_states = bool(record_states)
        # False: a struct's obs / final_obs are not read (factoriax's field set exactly).
        self.record_obs = bool(record_obs)
        self.state_fields = _wire.check_state_fields(state_fields)
        self._state_keys = tuple((name, f"state:{name}") for name in self.state_fields)
        if capture is not None and not isinstance(capture, TrajectoryTrainingConfiguration):
            raise ValueError(
                f"capture: expected a TrajectoryTrainingConfiguration or None, got {capture!r}"
            )
        self.capture_config = capture
        self.session = session
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Proves to the server that this recorder holds its worker id (never shown to others):
        # its own reconnect takes the id back; another recorder given the same id is refused.
        self._instance = uuid.uuid4().hex
        self._block = on_backpressure == "block"
        self.sender = sender  # "thread" or "process"
        self._follows = sender == "process"
        self._raise_loss = raise_loss
        self._lock = threading.Lock()
        self._sequence = 0
        # This worker's layout: fixed by its first chunk, so that a change is refused by
        # record() even while the first is in flight; forgotten if the server refuses that
        # chunk before storing any (the session's layout may be another worker's).
        self._schema: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._schema_stored = False
        self._signature: tuple | None = None
        # The previous chunk's exact shapes and dtypes, and its raw bytes: the same again
        # (a fixed T) is answered by one list comparison.
        self._shapes: list | None = None
        self._shapes_raw = 0
        self._shapes_tn = (0, 0)
        self._layout: Any = None
        self._step_bytes = 0
        # (N,) whether each env's open episode has no step yet, after the chunks with a
        # valid mask (None: not known here; the server checks then).
        self._open_empty: np.ndarray | None = None
        self._dropped = False  # chunks dropped at the cap since the last queued: a hole
        self._closed = False
        self._embedded: EmbeddedServer | None = None
        self._connection: Connection | None = None

        target = target or os.environ.get(TARGET_ENV) or None
        if target is None:
            self._embedded = EmbeddedServer()
            target = self._embedded.address
        self.target = target
        connection = {
            "token": token,
            "root_certificates": root_certificates,
            "client_certificate": client_certificate,
            "client_key": client_key,
            "rpc_timeout": rpc_timeout,
            "connect_timeout": connect_timeout,
            "keepalive_seconds": keepalive_seconds,
        }
        try:
            self._connection = Connection(target, **connection)
            self._sequence = self._first_join(connect_timeout)
            self._finished_at = self._sequence  # the last chunk a finish() has read
            # Another process's envs are gone: new episodes. This process's: continued.
            here = (os.getpid(), session, self.worker_id)  # any address: a server may move
            self._fresh_start = self._sequence > 0 and here not in _JOINED_HERE
            if worker_id is not None:  # a generated id is never given again
                _JOINED_HERE.add(here)
            if sender == "process":
                self._sender = self._process_sender(
                    connection=connection,
                    max_bytes_in_flight=max_bytes_in_flight,
                    compression_level=compression_level,
                    reconnect_timeout=reconnect_timeout,
                    linger_s=linger_ms / 1e3,
                )
            else:
                self._sender = ChunkSender(
                    connection=self._connection,
                    join=self._join,
                    session=session,
                    worker_id=self.worker_id,
                    instance=self._instance,
                    loss=lambda: self._joined.loss if self._joined.HasField("loss") else None,
                    target=target,
                    max_bytes_in_flight=max_bytes_in_flight,
                    compression_level=compression_level,
                    reconnect_timeout=reconnect_timeout,
                    wire=self._wire_options,
                    on_stored=self._stored,
                    on_refused=self._refused,
                    on_error=on_error,
                    raise_data_loss=self._raise_loss,
                    max_episodes=self.max_episodes,
                    linger_s=linger_ms / 1e3,
                    status_call=lambda done: self._connection.call_async(
                        "GetStatus", pb.StatusRequest(session=session, counters_only=True), done
                    ),
                )
            self._sender.take_counters(self._joined.status, self._sequence)
            self._sender.join_limits(self._joined.max_chunk_bytes, self._joined.max_chunk_env_steps)
        except BaseException:
            self._shutdown_transport()
            raise
        #: The session's trajectory store, called remotely (see RemoteCapture).
        self.capture = RemoteCapture(self._connection, session, self.flush)
        self._finalizer = weakref.finalize(self, _close_quietly, weakref.ref(self))
        atexit.register(self._finalizer)

    # -- connection ------------------------------------------------------
    def _config(self) -> pb.SessionConfig:
        msg = pb.SessionConfig(record_states=self.record_states, state_fields=self.state_fields)
        if self.max_episodes is not None:
            msg.max_episodes = self.max_episodes
        if self.capture_config is not None:
            msg.capture_config_json = json.dumps(self.capture_config.to_dict(), sort_keys=True)
        return msg

    def _join(self, acked: int = 0) -> int:
        """Join (or rejoin) the session; returns the last sequence the server holds.
        ``acked``: the highest sequence the server acknowledged to this client."""
        request = pb.JoinRequest(
            session=self.session,
            config=self._config(),
            worker_id=self.worker_id,
            acked_sequence=acked,
            instance_id=self._instance,
        )
        # Waits for a server still starting, up to connect_timeout.
        reply = self._connection.connect("Join", request)
        self.worker_index = reply.worker_index
        self._joined = reply
        sender = getattr(self, "_sender", None)
        if sender is not None:  # a rejoin: the server's counters count up to last_sequence
            sender.take_counters(reply.status, reply.last_sequence)
            sender.join_limits(reply.max_chunk_bytes, reply.max_chunk_env_steps)
        return int(reply.last_sequence)

    def _process_sender(self, **options: Any) -> Any:
        from ._sender_process import ProcessSender

        spec = {
            "target": self.target,
            "session": self.session,
            "worker_id": self.worker_id,
            "instance": self._instance,
            "config": self._config().SerializeToString(),
            "joined": self._joined.SerializeToString(),
            "sequence": self._sequence,
            "raise_data_loss": self._raise_loss,
            **options,
        }
        return ProcessSender(spec, on_stored=self._stored, on_refused=self._refused)

    def _first_join(self, timeout: float) -> int:
        # A worker id kept for the reconnect of a holder with no stream open (one that
        # crashed) is free within the server's retry_after: waited for up to connect_timeout.
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._join()
            except WorkerIdInUseError as exc:
                wait = exc.retry_after
                if wait is None or time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait + 0.05)

    def _check_open(self) -> None:
        if self._closed:
            raise RecorderError("the recorder is closed")

    def _raise_async_errors(self) -> None:
        """Raise what the server refused since the caller last heard (each error once)."""
        if not self._sender.unseen:
            return
        errors = self._sender.take_errors()
        if errors:
            if len(errors) > 1:
                logger.error("%d further refused chunks: %s", len(errors) - 1, errors[1:])
            raise errors[0]

    # -- the in-process recorder's API ----------------------------------
    def record(self, trajectories: Any, env_states: Any = None, *, outcome: Any = None) -> bool:
        """Queue one (T, N) chunk and return; compression and I/O happen in the background.

        `trajectories` (mapping keys or attributes; numpy arrays, torch tensors or JAX
        arrays) holds `action` (T, N, ...), `reward` (T, N) and either `done` (T, N) or
        `terminated` and `truncated` (T, N) bool each (done is their OR; given all three,
        they must agree). Optional: `valid` (T, N) bool (False: a row of no episode, only
        where the env's open episode has no step yet, with no flag), `obs` (an array
        (T, N, ...) or a nested dict / tuple of them: recorded as the state fields `obs`,
        `obs.<key>`, `obs.<i>`) and `final_obs` (the same structure: the observation after
        each step, read where an episode ends). docs/concepts.md states the contract.

        `outcome` (or an `outcome` field of `trajectories`) gives optional per-step
        outcome codes (T, N): 0 unknown, 1 win, 2 loss, 3 draw, 4 incomplete; an
        episode's outcome is its last non-zero code.
        The arrays are referenced, not copied: do not write into them afterwards.
        A chunk recorded after the session is full is dropped, as in-process.
        Returns False when the chunk was dropped: the session is full (as
        in-process, where record() returns at once), or the in-flight cap was
        reached with on_backpressure="drop" (counted in `dropped_chunks`).
        Raises InvalidChunkError (a ValueError) for a chunk whose shapes disagree
        with its (T, N), or whose N, dtypes, trailing shapes or state fields differ
        from this worker's earlier chunks; nothing is queued then. A refusal the server
        sent for an earlier chunk (InvalidChunkError), or chunks it lost after
        acknowledging them (DataLossError), are raised after this call's own
        chunk was queued: catching the exception never costs a chunk.
        """
        if self._full():
            return False
        # Inlined lookups: after a training step the caches are cold, and every call and
        # object touched here is paid for at p99.
        arrays: dict[str, Any] = {}
        # A CPU tensor is kept after two properties; its nesting and dtype are checked with
        # the layout (_validate), as one of the worker's last chunk's or in full.
        tensor, strided = _torch.KEPT
        get = trajectories.get if isinstance(trajectories, Mapping) else None
        for name in ("action", "reward", "done"):
            value = get(name) if get else getattr(trajectories, name, None)
            if value is None:
                if name == "done":  # terminated and truncated may stand for it
                    break
                raise InvalidChunkError(
                    f"trajectories.{name}: expected an array (attribute or mapping key), got none"
                )
            arrays[name] = (
                value
                if type(value) is np.ndarray
                or (type(value) is tensor and value.is_cpu and value.layout is strided)
                else _take(value, f"trajectories.{name}")
            )
        if outcome is None:
            outcome = get("outcome") if get else getattr(trajectories, "outcome", None)
        if outcome is not None:
            arrays["outcome"] = _take(outcome, "trajectories.outcome", defer=False)
        if self.record_states and env_states is not None:
            state_get = env_states.get if isinstance(env_states, Mapping) else None
            for name, key in self._state_keys:
                value = state_get(name) if state_get else getattr(env_states, name, None)
                if value is not None:
                    arrays[key] = (
                        value
                        if type(value) is np.ndarray
                        or (type(value) is tensor and value.is_cpu and value.layout is strided)
                        else _take(value, f"env_states.{name}")
                    )
        # The contract's flags, valid mask and observations (done from the flags' OR).
        done_given = "done" in arrays
        _chunk.add_contract(arrays, trajectories, get, self.record_obs)
        if "valid" in arrays or "terminated" in arrays:
            open_empty = _checks.check_flags(arrays, self._open_empty, done_given)
        else:
            open_empty = None
        if _started.copies:  # CUDA copies this call started: one event after them all
            _fence_copies()
        return self._queue(arrays, open_empty)

    def _full(self) -> bool:
        """A call's first steps: the recorder open, the sender process's reports taken
        (before a chunk is checked), and whether the session is full (the chunk dropped and
        counted, as in-process)."""
        self._check_open()
        if self._follows:
            self._sender.follow()
        if self.max_episodes is not None and self._sender.counters()[0]:
            self._sender.stats.chunks_dropped_full += 1
            self._raise_async_errors()
            return True
        return False

    def _record_built(self, arrays: dict[str, Any]) -> bool:
        """record() for a chunk this package's Gymnasium wrappers built: numpy arrays under
        the names record() gives them (action, reward, done, terminated, truncated, valid,
        state:obs..., final:obs...), done their OR. Their shapes and dtypes are checked as
        record() checks them; the flag and mask rules, which the wrapper's buffers keep by
        construction, are left to the server, which applies each of them to every chunk
        (about a third of record()'s time on a CartPole chunk)."""
        if self._full():
            return False
        if not self.record_obs:
            arrays = {k: v for k, v in arrays.items() if not k.startswith(("state:", "final:"))}
        return self._queue(arrays, None)

    def _queue(self, arrays: dict[str, Any], open_empty: np.ndarray | None) -> bool:
        """Check a chunk's layout and queue it (record()'s last steps); ``open_empty``: which
        envs have an empty open episode after it (None: not known)."""
        raw, schema, (length, envs) = self._validate(arrays)
        with self._lock:
            self._sequence += 1
            done = arrays["done"]
            item = PendingChunk(
                self._sequence,
                raw,
                arrays,
                schema=schema,
                length=int(length),
                # Counted now, while the sender threads sleep (a device array: later).
                dones=int(np.count_nonzero(done))
                if self.max_episodes is not None and isinstance(done, np.ndarray)
                else None,
                envs=int(envs),
                cut_before=self._dropped,
                fresh_start=self._fresh_start,
            )
            item.signature = self._signature
            if not self._sender.submit(item, block=self._block):
                self._sequence -= 1
                self._dropped = True
                self._open_empty = None
                self._raise_async_errors()
                return False
            if item.merged:  # it joined the chunk queued before it, and that one's sequence
                self._sequence -= 1
            self._open_empty = open_empty
            self._dropped = self._fresh_start = False
        # A refusal of an earlier chunk is raised here, after this call's chunk is queued:
        # catching it never costs a chunk.
        self._raise_async_errors()
        return True

    @property
    def dropped_chunks(self) -> int:
        """Chunks dropped at the in-flight cap (on_backpressure="drop")."""
        return self._sender.stats.chunks_dropped_in_flight

    @property
    def bytes_in_flight(self) -> int:
        """Raw bytes recorded but not yet acknowledged by the server."""
        return self._sender.bytes_in_flight

    def _validate(self, arrays: dict[str, Any]) -> tuple[int, Any, tuple[int, int]]:
        """Check shapes and dtypes against this worker's stored chunks; returns raw bytes,
        the chunk's layout and its (T, N)."""
        if "outcome" in arrays:
            _checks.check_outcome(arrays["outcome"])
        # Fast path (record() is on the training loop's thread): the same layout as the
        # previous chunk, one T for every array. Anything else takes the full check.
        # One shape at a time, compared and let go: a tensor's shape is a new torch.Size,
        # an object the garbage collector counts, and a list of them held five at once.
        # A tensor record() kept (_torch.KEPT) with the dtype the last chunk had there was
        # checked in full once; a nested one has no shape (RuntimeError), and the full
        # check refuses it.
        previous = self._shapes
        if previous is not None and len(previous) == len(arrays):
            try:
                for (key, value), (key_was, shape, dtype) in zip(arrays.items(), previous):
                    if key != key_was or value.dtype != dtype or value.shape != shape:
                        break
                else:
                    return self._shapes_raw, self._layout, self._shapes_tn
            except RuntimeError:
                pass
        _checks.check_kept_tensors(arrays)
        shapes = [(k, tuple(v.shape), v.dtype) for k, v in arrays.items()]
        signature = tuple((k, tuple(shape[1:]), dtype) for k, shape, dtype in shapes)
        lengths = {shape[0] if shape else None for _, shape, _ in shapes}
        if signature == self._signature and len(lengths) == 1:
            raw = lengths.pop() * self._step_bytes
        else:
            # Bytes per step of this layout: the next chunks of it are sized without a read.
            step_bytes, layout = _checks.check_layout(arrays, self._schema, self.capture_config)
            if self._schema is None:
                self._schema = layout
            self._signature, self._layout, self._step_bytes = signature, layout, step_bytes
            raw = lengths.pop() * step_bytes  # one T once checked
        tn = next(shape for key, shape, _ in shapes if key == "done")  # (T, N), checked
        self._shapes, self._shapes_raw, self._shapes_tn = shapes, raw, tn
        return raw, self._layout, tn

    def _wire_options(self) -> tuple[bool, int]:
        return wire_options(self._joined)  # the server last joined

    def _stored(self, item: PendingChunk) -> None:
        # The sender thread: the server stored a chunk of this layout.
        if not self._schema_stored and item.schema is not None:
            self._schema_stored = True
            if self._schema is None:
                self._schema = item.schema
                self._signature = self._shapes = None  # the next chunk is checked in full

    def _refused(self, item: PendingChunk) -> None:
        # The sender thread: a refusal before anything was stored unfixes the layout.
        self._open_empty = None  # the server cut the worker's episodes there
        if not self._schema_stored:
            self._schema = None
            self._signature = self._shapes = None

    def _forget_layout(self) -> None:
        self._open_empty = None
        self._schema = None
        self._schema_stored = False
        self._signature = self._shapes = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every recorded chunk is acknowledged by the server."""
        self._check_open()
        self._sender.flush(timeout)
        self._raise_async_errors()

    def status(self) -> SessionStatus:
        """The session's counters and its workers', as the server has them now."""
        self._check_open()
        self._raise_async_errors()
        reply = self._connection.call("GetStatus", pb.StatusRequest(session=self.session))
        return session_status(reply)

    @property
    def stats(self) -> StreamStats:
        """This worker's stream: chunks sent, acknowledged and dropped, bytes, reconnects."""
        return self._sender.snapshot()

    @property
    def is_full(self) -> bool:
        """Whether the session's done count reached max_episodes, answered here: see
        num_recorded_steps for what it counts."""
        if self._sender.unseen:
            self._raise_async_errors()
        return self.max_episodes is not None and self._sender.counters()[0]

    @property
    def num_recorded_steps(self) -> int:
        """Sum of T over the session's stored chunks, answered here without a server call.

        It counts every chunk this worker recorded (before the server takes it, as it
        will unless another worker fills the session first), and other workers' chunks as
        of the server's last answer to this worker: an ack or, with nothing of this worker's
        in flight for 20 ms, a status that reading this asks for in the background
        (docs/concepts.md, "Semantics"). status() asks the server and waits.
        """
        if self._sender.unseen:
            self._raise_async_errors()
        return self._sender.counters()[1]

    def finish(self, pad_incomplete: bool = True, include_partial: bool = False) -> Trajectory:
        """The padded trajectory of every episode in the session (does not clear).

        Chunks lost after their ack (a sequence gap) cut every open episode of their worker:
        the piece before the gap is an unfinished tail (kept with ``pad_incomplete``), the
        piece after it up to its env's next done starts unknown (kept with
        ``include_partial``); ``episode_partial`` says which, and nothing spans a gap.

        Raises NoDataError (a ValueError) when nothing was recorded or no episode
        was found, with the in-process recorder's messages. When some chunk it reads
        was acknowledged and then found not to decode (those frames read as zeros), it
        raises DataLossError with the result as ``.trajectory``, or with
        ``on_data_loss="continue"`` logs a WARNING and returns it.
        """
        self.flush()
        through = self._sequence
        request = pb.FinishRequest(
            session=self.session,
            pad_incomplete=bool(pad_incomplete),
            include_partial=bool(include_partial),
            chunk_frames=True,
        )
        out = checked(_assemble(self._connection.download("Finish", request)), self._raise_loss)
        self._finished_at = through
        return out

    @property
    def _unread_private(self) -> bool:
        """Whether this recorder's private server holds chunks no finish() has read: they
        end with close()."""
        return self._embedded is not None and self._sequence != self._finished_at

    def runtime_state(self) -> bytes:
        """The session's whole state (configuration, workers, sequence numbers, chunks,
        open episodes, counters, store) as bytes to keep in the trainer's own checkpoint."""
        self.flush()
        parts = self._connection.download(
            "GetRuntimeState", pb.RuntimeStateRequest(session=self.session)
        )
        file = join_parts(parts)
        if file is None or file.data is None:
            raise RecorderError("GetRuntimeState: the server sent no state")
        return file.data

    def load_runtime_state(self, state: bytes) -> None:
        """Replace the session's state with one from runtime_state() (same session name).

        Load before workers stream into the session; the server checkpoints it at once.
        """
        self.flush()
        self._connection.upload(
            "LoadRuntimeState", file_parts(self.session, f"{self.session}.state", bytes(state))
        )
        # This worker's place, sequence and open episodes come from the loaded state now.
        self._sequence = self._join(0)  # which also takes the loaded counters
        self._fresh_start = False
        self._forget_layout()

    def checkpoint(self) -> str:
        """Ask the server to checkpoint every session now; returns the file's path."""
        self.flush()
        return self._connection.call("Checkpoint", pb.CheckpointRequest()).path

    def reset(self) -> None:
        """Drop every stored chunk of the session; the configuration stays."""
        self.flush()
        reply = self._connection.call("Reset", pb.ResetRequest(session=self.session))
        self._sender.take_counters(reply.status, self._sequence)
        self._finished_at = self._sequence  # nothing left to read
        self._forget_layout()

    # -- lifetime --------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, stop the stream, leave the session (this worker no longer counts against
        its worker limit; its chunks stay), and stop the embedded server if this client
        started it."""
        if self._closed:
            return
        try:
            if self._sender is not None:
                try:
                    if not self._sender.fatal_reported:
                        self._sender.flush(timeout)
                finally:
                    self._sender.close()
                    self._leave()
        finally:
            self._closed = True
            self._shutdown_transport()
            self._finalizer.detach()
            atexit.unregister(self._finalizer)
        self._raise_async_errors()  # a refusal that came after the last call

    def _leave(self) -> None:
        # The worker stops counting against the session's worker limit; its chunks stay.
        if self._embedded is not None or self._connection is None:
            return
        try:
            self._connection.call(
                "Leave",
                pb.LeaveRequest(
                    session=self.session, worker_id=self.worker_id, instance_id=self._instance
                ),
                5.0,
                wait=False,  # leaving a server that is gone is not worth a wait
            )
        except RecorderError as exc:
            logger.info("leaving session %r: %s", self.session, exc)

    def _shutdown_transport(self) -> None:
        if self._connection is not None:
            self._connection.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def __enter__(self) -> RolloutRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RolloutRecorder(max_episodes={self.max_episodes}, record_states={self.record_states}, "
            f"state_fields={self.state_fields}, target={self.target!r}, session={self.session!r})"
        )


# What the process sender cannot keep: each option, the value it needs there, and why.
_PROCESS_NEEDS = (
    ("max_episodes", None, "is_full is answered from acks this process lacks"),
    ("on_error", None, "errors reach this process at its next call"),
    ("on_backpressure", "block", "a full pipe to the sender blocks"),
)


def threads_needed(options: Mapping[str, Any]) -> bool:
    """Whether recorder options ask for what only the thread sender does."""
    return any(options.get(name, wanted) != wanted for name, wanted, _ in _PROCESS_NEEDS)


def _check_sender(sender: Any, options: Mapping[str, Any]) -> None:
    if sender not in ("thread", "process"):
        raise ValueError(f'sender: expected "thread" or "process", got {sender!r}')
    if sender != "process":
        return
    for name, wanted, why in _PROCESS_NEEDS:
        value = options[name]
        if value != wanted:
            raise ValueError(
                f'{name}: expected {wanted!r} with sender="process" ({why}), got {value!r}'
            )


def _close_quietly(ref: weakref.ref[RolloutRecorder]) -> None:
    recorder = ref()
    if recorder is not None:
        try:
            recorder.close(timeout=10)
        except Exception as exc:  # interpreter exit: report, never raise
            logger.warning("closing the recorder at exit: %s", exc)


__all__ = ["RolloutRecorder"]
