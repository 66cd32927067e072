"""The dataset sink (serve --dataset-uri): every finished episode, written to Parquet files on
any fsspec filesystem or object store while the run goes on.

The sink holds no copy of the data: a session keeps every chunk anyway, and the sink reads the
episodes its cursor has not reached from there, one bounded row group at a time, on its own
thread, while a second thread encodes the row group before.
Ingest never waits for it. A failed write is retried with backoff and counted; what it would
have written stays in the session, the log and its checkpoints until a write commits (see
cursor.py), so a crash or an unreachable store delays episodes and loses none. Ingest comes
first: the writer runs at a lower CPU priority, and a write that falls due while chunks keep
arriving waits for a gap (up to twice the flush interval), as between a training loop's
collection phases.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recorder_client import dataset as client_dataset
from recorder_client.trajectory import CORRUPT

from ..chunks import FINAL, STATE
from ..durability import records
from ..episode_ends import end_flags, final_names, final_rows
from ..errors import ErrorKind, RequestError
from . import gather, layout
from .cursor import Intent
from .lag import LagClock

logger = logging.getLogger(__name__)

NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Ingest counts as busy while some session took a chunk (or a call) this recently: a write
# that is due waits for such a gap, up to twice the flush interval.
QUIET_S = 0.2
WRITER_NICE = 10


def storage_options(options: DatasetOptions) -> dict:
    """The filesystem arguments: the caller's, and for S3 the io_timeout and one botocore
    retry (the sink retries a failed write itself, with its own backoff)."""
    extra = dict(options.storage_options)
    if options.uri.startswith(("s3://", "s3a://")):
        config = {
            "connect_timeout": options.io_timeout,
            "read_timeout": options.io_timeout,
            "retries": {"max_attempts": 2},
        }
        extra["config_kwargs"] = {**config, **extra.get("config_kwargs", {})}
    return extra


def default_node_id() -> str:
    """The hostname, cut to the node id rule."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].lstrip("._-")
    return name or "node"


def check_node_id(node: str) -> str:
    if not NODE_ID.fullmatch(node):
        raise ValueError(
            f"--node-id: expected 1-64 characters from [A-Za-z0-9._-] starting with a letter "
            f"or digit, got {node!r}"
        )
    return node


@dataclass(frozen=True)
class DatasetOptions:
    uri: str
    """Where the dataset lives: a path, file://, s3://bucket/prefix, or any fsspec URL."""
    node_id: str = field(default_factory=default_node_id)
    """Prefix of this sidecar's episode ids and file names (unique per sidecar of a run)."""
    flush_seconds: float = 30.0
    """How long a finished episode waits before it is written; while chunks keep arriving,
    the write waits for a gap in ingest, up to twice this."""
    file_bytes: int = 64 << 20
    """Raw bytes of episodes per file (a flush writes several when more are waiting)."""
    storage_options: dict = field(default_factory=dict)
    """Extra fsspec filesystem arguments."""
    stop_timeout: float = 20.0
    """Seconds a stop waits for the last writes (what is left is written on the next start)."""
    retry_max_seconds: float = 8.0
    """Longest wait between retries of a failed write (the backoff doubles from 1 s up to
    this): once the store answers again, the dataset catches up within about this."""
    io_timeout: float = 10.0
    """S3: seconds to connect and to wait for each answer (botocore's 60 s would hold a write
    that long on a store that stopped answering); a timed-out write is retried."""

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        for name, flag in (("retry_max_seconds", "retry-max"), ("io_timeout", "timeout")):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"--dataset-{flag}-seconds: expected seconds > 0, got {getattr(self, name)}"
                )
        if not self.flush_seconds > 0:
            raise ValueError(
                f"--dataset-flush-seconds: expected seconds > 0, got {self.flush_seconds}"
            )
        if not self.file_bytes >= 1 << 10:
            raise ValueError(f"--dataset-file-mib: expected at least 1 KiB, got {self.file_bytes}")


@dataclass
class _State:
    last_flush: float = 0.0
    steps_at_flush: int = 0
    failures: int = 0
    retry_at: float = 0.0
    lag: LagClock = field(default_factory=LagClock)


class DatasetSink:
    def __init__(self, options: DatasetOptions, sessions: Any, metrics: Any) -> None:
        self.options = options
        self.node = check_node_id(options.node_id)
        self.fs, self.root = client_dataset.filesystem(options.uri, storage_options(options))
        if hasattr(self.fs, "retries"):
            # s3fs retries a timed-out request 5 times over botocore's own attempts: a store
            # that stopped answering would hold one write for minutes. The sink retries.
            self.fs.retries = 1
        self.sessions = sessions
        self.metrics = metrics
        self._states: dict[str, _State] = {}
        self._described: set[str] = set()
        # (session, node) -> every column its files hold, as its columns file lists them.
        self._columns: dict[tuple[str, str], Any] = {}
        self._stop = threading.Event()
        self._lag_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._encoding: ThreadPoolExecutor | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Write what recovery left pending at once, then every flush interval."""
        self._thread = threading.Thread(target=self._run, name="recorder-dataset", daemon=True)
        self._thread.start()
        # The lag moves while a write hangs on a store that stopped answering.
        threading.Thread(target=self._publish_lag, name="recorder-dataset-lag", daemon=True).start()

    def close(self) -> None:
        """Stop the thread, then write every finished episode (as long as stop_timeout
        allows; the rest stays in the log and its checkpoints for the next start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.options.stop_timeout)
        deadline = time.monotonic() + self.options.stop_timeout
        for session in self.sessions.all():
            if time.monotonic() > deadline:
                logger.warning("dataset: stop timeout reached; the rest is written next start")
                break
            try:
                with session.dataset_lock:
                    self._flush(session)
            except Exception as exc:  # noqa: BLE001 - a stop reports, it does not raise
                logger.error(
                    "dataset: session %r not fully written at stop (%s); the log keeps it",
                    session.name,
                    exc,
                )
        if self._encoding is not None:
            self._encoding.shutdown(wait=False)

    def flush_now(self, session: Any) -> None:
        """Write every finished episode of ``session`` now; the caller holds its
        dataset_lock. RequestError (STORAGE) when the dataset cannot take it."""
        try:
            self._flush(session, closing=True)
        except Exception as exc:  # noqa: BLE001 - any store failure refuses the request
            self._failed(session.name, exc)
            raise RequestError(
                ErrorKind.STORAGE,
                f"dataset {self.options.uri}: cannot write the finished episodes of session "
                f"{session.name!r} ({exc}); nothing changed, retry once it can",
            ) from None

    # -- the writer thread -------------------------------------------------
    def _run(self) -> None:
        _lower_priority()
        tick = min(1.0, max(0.05, self.options.flush_seconds / 4))
        while True:
            now = time.monotonic()
            live = self.sessions.all()
            busy = any(now - s.last_used < QUIET_S for s in live)
            for session in live:
                state = self._states.setdefault(session.name, _State())
                if now >= state.retry_at and self._due(session, state, now, busy):
                    try:
                        with session.dataset_lock:
                            self._flush(session)
                        state.failures = 0
                    except Exception as exc:  # noqa: BLE001 - retried with backoff
                        self._failed(session.name, exc)
                        state.failures += 1
                        backoff = min(self.options.retry_max_seconds, 0.5 * 2**state.failures)
                        state.retry_at = time.monotonic() + backoff
                    state.last_flush = now
            names = {s.name for s in live}
            for name in [n for n in self._states if n not in names]:
                del self._states[name]
            if self._stop.wait(tick):
                return

    def _due(self, session: Any, state: _State, now: float, busy: bool) -> bool:
        if session.dataset.pending is not None or state.last_flush == 0.0:
            return True
        waited = now - state.last_flush
        if waited >= 2 * self.options.flush_seconds:
            return True  # however busy ingest is
        if busy:
            return False  # ingest first: the write waits for a gap
        if waited >= self.options.flush_seconds:
            return True
        # Enough new steps for a whole file: write without waiting for the interval.
        steps = session.env_steps - state.steps_at_flush
        return steps * self._step_bytes(session) >= self.options.file_bytes

    def _failed(self, name: str, exc: BaseException) -> None:
        self.metrics.inc("Recorder/dataset_write_failures", 1, session=name)
        logger.warning("dataset: write for session %r failed, retried: %s", name, exc)

    # -- writing -----------------------------------------------------------
    def _flush(self, session: Any, *, closing: bool = False) -> None:
        """Write the pending intent, then every finished episode not written yet (call with
        the session's dataset_lock held). ``closing``: the session is being dropped."""
        if session.dropped and not closing:
            return
        state = self._states.setdefault(session.name, _State())
        state.steps_at_flush = session.env_steps
        if session.dataset.fresh:
            # A session of this name written here before (dropped, then joined again): its
            # files keep their names, and this one starts past their generations.
            after = self._next_generation(session.name)  # listed outside the session lock
            with session.lock:
                if session.dataset.fresh:
                    session.dataset.generation = max(session.dataset.generation, after)
                    session.dataset.probed = True
        while True:
            intent = session.dataset.pending
            if intent is None:
                intent = self._plan(session)
                if intent is None:
                    break
                with session.lock:
                    self._journal(session, records.dataset_write(session.name, intent))
                    session.dataset.intent(intent)
            self._write(session, intent)
            with session.lock:
                self._journal(session, records.dataset_commit(session.name, intent.seq))
                session.dataset.commit(intent.seq)
        with session.lock:
            waiting = sum(
                tl.episodes_finished - session.dataset.written.get(w, 0)
                for w, tl in session.workers.items()
            )
        self.metrics.set("Recorder/dataset_pending_episodes", waiting, session=session.name)
        self._measure_lag(session, state)  # 0 as soon as the write is committed

    def _measure_lag(self, session: Any, state: _State) -> None:
        """The session's Recorder/dataset_lag_seconds, every half second and after each
        flush (a copy of two small dicts under its lock)."""
        with session.lock:
            if session.dropped:
                return
            finished = {w: tl.episodes_finished for w, tl in session.workers.items()}
            written = dict(session.dataset.written)
        with self._lag_lock:
            lag = state.lag.observe(time.monotonic(), finished, written)
        self.metrics.set("Recorder/dataset_lag_seconds", lag, session=session.name)

    def _publish_lag(self) -> None:
        """Measures the lag on its own thread: it keeps growing while a write hangs on a
        store that stopped answering (the writer's thread is held then)."""
        while not self._stop.wait(0.5):
            for session in self.sessions.all():
                state = self._states.get(session.name)
                if state is not None:
                    self._measure_lag(session, state)

    @staticmethod
    def _journal(session: Any, record: list) -> None:
        if session.journal is not None:
            session.journal(record)

    def _step_bytes(self, session: Any) -> int:
        schema = session.schema
        if schema is None:
            return layout.ROW_OVERHEAD
        specs = layout.field_specs(schema, session.config.state_fields)
        return layout.ROW_OVERHEAD + sum(s.step_bytes for s in specs)

    def _plan(self, session: Any) -> Intent | None:
        """The next file: finished episodes past the cursor, worker by worker, within
        file_bytes (at least one episode)."""
        budget = self.options.file_bytes
        step_bytes = self._step_bytes(session)
        ranges: dict[str, tuple[int, int]] = {}
        with session.lock:
            cursor = session.dataset
            for worker_id, tl in session.workers.items():
                _env, start, end = tl.table.arrays()
                first = cursor.written.get(worker_id, 0)
                if end.size <= first:
                    continue
                size = np.cumsum(end[first:] - start[first:]) * step_bytes
                take = int(np.searchsorted(size, budget, side="right"))
                if ranges and take == 0:
                    break
                take = max(take, 1)
                ranges[worker_id] = (first, first + take)
                budget -= int(size[take - 1])
                if budget <= 0:
                    break
            if not ranges:
                return None
            return Intent(cursor.seq, cursor.generation, ranges, self.node)

    def _next_generation(self, session: str) -> int:
        """One past the highest generation of this node's files of ``session`` (0: none)."""
        directory = layout.session_dir(self.root, session)
        found = -1
        for path in client_dataset.episode_files(self.fs, directory):
            match = layout.FILE_NAME.fullmatch(path.rsplit("/", 1)[-1])
            if match is not None and match["node"] == self.node:
                found = max(found, int(match["generation"]))
        return found + 1

    def _write(self, session: Any, intent: Intent) -> None:
        """Write the intent's file: its episodes gathered a row group at a time on this
        thread while the encoder thread writes the one before (pyarrow releases the GIL), so
        the two overlap and memory holds two row groups, not the file."""
        fields, roster, parts = self._collect(session, intent)
        # One set of final columns for every row group of the file: the fields any of its
        # chunks sent a final observation of.
        names = [f.key[len(STATE) :] for f in fields if f.key.startswith(STATE)]
        finals = layout.final_specs(fields, final_names([c for p in parts for c in p[5]], names))
        config = session.config.to_dict()
        if session.name not in self._described:
            layout.describe(self.fs, self.root, session.name, fields, config)
            self._described.add(session.name)
        name = layout.file_name(intent.node or self.node, intent.generation, intent.seq)
        path = f"{layout.session_dir(self.root, session.name)}/{name}"
        step_bytes = layout.ROW_OVERHEAD + sum(f.step_bytes for f in fields)
        episodes = steps = 0
        out = layout.EpisodeFile(self.fs, path)
        encoding = None
        try:
            for batch in gather.batches(parts, step_bytes, layout.ROW_GROUP_BYTES):
                gathered = self._episodes(session, intent, fields, roster, batch, finals)
                table = layout.episode_table(gathered, fields, config, finals)
                episodes += int(gathered.lengths.size)
                steps += gathered.num_steps
                del gathered
                if encoding is not None:
                    encoding.result()
                encoding = self._encoder().submit(out.write, table)
                del table
            if encoding is not None:
                encoding.result()
            payload = out.finish()
        except BaseException:
            if encoding is not None:
                futures.wait([encoding])  # the encoder lets go of the file first
            out.discard()
            raise
        try:
            self._record_columns(session.name, intent.node or self.node, payload, fields, name)
            size = layout.put_whole(self.fs, path, payload)
        finally:
            out.discard()  # a staged file not renamed into place goes
        labels = {"session": session.name}
        self.metrics.inc("Recorder/dataset_files_written", 1, **labels)
        self.metrics.inc("Recorder/dataset_episodes_written", episodes, **labels)
        self.metrics.inc("Recorder/dataset_steps_written", steps, **labels)
        self.metrics.inc("Recorder/dataset_bytes_written", size, **labels)

    def _record_columns(
        self, session: str, node: str, payload: Any, fields: list, name: str
    ) -> None:
        """Before a file that adds a column or a field spec is committed, the node's columns
        file lists it: readers take a session's columns and fields from there instead of
        every file's footer. Without one yet (or one that lists no fields), this node's files
        there (an older server's) are read once to start it."""
        key = (session, node)
        known = self._columns.get(key)
        if known is None:
            known = client_dataset.columns_entry(self.fs, self.root, session, node)
        absent = known is None or known[1] is None
        if absent:
            schema, specs = None if known is None else known[0], []
            for path in layout.node_files(self.fs, self.root, session, node):
                theirs, listed = client_dataset.file_description(self.fs, path)
                schema = layout.with_columns(schema, theirs)
                specs = layout.with_fields(specs, listed, path.rsplit("/", 1)[-1])
            known = (schema, specs)
        merged = layout.with_columns(known[0], layout.payload_schema(payload))
        specs = layout.with_fields(known[1], [f.to_dict() for f in fields], name)
        if absent or merged.names != known[0].names or len(specs) != len(known[1]):
            layout.write_columns(self.fs, self.root, session, node, merged, specs)
        self._columns[key] = (merged, specs)

    def _encoder(self) -> ThreadPoolExecutor:
        if self._encoding is None:
            self._encoding = ThreadPoolExecutor(
                1, thread_name_prefix="recorder-dataset-encode", initializer=_lower_priority
            )
        return self._encoding

    def _collect(self, session: Any, intent: Intent) -> tuple[list, list, list]:
        """The intent's fields, the session's roster, and per worker its episodes' rows and
        the chunks they span (read under the session's lock; nothing decoded)."""
        with_store = session.processor.store is not None
        if with_store:
            session.drain()  # the store's ids of these episodes are known once it is fed
        with session.lock:
            fields = layout.field_specs(dict(session.schema), session.config.state_fields)
            roster = [(w, tl.index) for w, tl in session.workers.items()]
            parts = []
            for worker_id, (first, end_row) in intent.ranges.items():
                tl = session.workers.get(worker_id)
                if tl is None:
                    raise RuntimeError(f"worker {worker_id!r} of a logged dataset write is gone")
                env, start, end = (a[first:end_row].copy() for a in tl.table.arrays())
                flags = tl.table.flags()[first:end_row].astype(np.int64)
                if env.size != end_row - first:
                    raise RuntimeError(
                        f"worker {worker_id!r}: rows {first}..{end_row} of a logged dataset "
                        f"write are not held (it holds {first + env.size})"
                    )
                ids = None
                if with_store:
                    known = session.feeder.trajectory_id_table(tl.index)[first:end_row]
                    ids = np.full(env.size, -1, dtype=np.int64)
                    ids[: known.size] = known
                parts.append((worker_id, tl.index, env, start, end, list(tl.chunks), ids, flags))
        return fields, roster, parts

    def _episodes(
        self, session: Any, intent: Intent, fields: list, roster: list, parts: list, finals: list
    ) -> layout.Episodes:
        """Episodes of ``parts`` (as `_collect` gives them) as flat step arrays, with how
        each ended (its last step's flags, the ``finals`` it sent)."""
        values: dict[str, list[np.ndarray]] = {f.column: [] for f in fields}
        worker_ids: list[str] = []
        windex, envs, starts, lengths, outcomes, store_ids = [], [], [], [], [], []
        partial, terminated, truncated = [], [], []
        ends: dict[str, list] = {f.column: [] for f in finals}
        valid: dict[str, list] = {f.column: [] for f in finals}
        for worker_id, index, env, start, end, chunks, ids, flags in parts:
            n = end - start
            chunks = gather.spanned(chunks, int(start.min()), int(end.max()))
            session.verify(chunks)
            for chunk in chunks:  # proved: its zeros are marked, never written as data
                if chunk.corrupt:
                    flags[(start < chunk.t0 + chunk.length) & (chunk.t0 < end)] |= CORRUPT
            partial.append(flags)
            picked, codes = gather.gather_steps(chunks, fields, env, start, n)
            for spec in fields:
                values[spec.column].append(picked[spec.column])
            outcomes.append(gather.last_nonzero(codes, n))
            done = np.ones(env.size, dtype=bool)  # a written episode is one a flag ended
            term, trunc = end_flags(chunks, env, end, done)
            terminated.append(term)
            truncated.append(trunc)
            for spec in finals:
                out = np.zeros((env.size, *spec.shape), dtype=spec.dtype)
                name = spec.key[len(FINAL) :]
                valid[spec.column].append(final_rows(chunks, name, env, end, done, out))
                ends[spec.column].append(out)
            worker_ids.extend([worker_id] * env.size)
            windex.append(np.full(env.size, index, dtype=np.int64))
            envs.append(env)
            starts.append(start)
            lengths.append(n)
            store_ids.append(np.full(env.size, -1, dtype=np.int64) if ids is None else ids)
        episodes = layout.Episodes(
            node=intent.node or self.node,
            session=session.name,
            generation=intent.generation,
            worker_ids=worker_ids,
            worker_index=np.concatenate(windex),
            env=np.concatenate(envs),
            start=np.concatenate(starts),
            lengths=np.concatenate(lengths),
            outcome=np.concatenate(outcomes),
            values={k: gather.joined(v) for k, v in values.items()},
            store_ids=np.concatenate(store_ids),
            roster=roster,
            partial=np.concatenate(partial),
            terminated=np.concatenate(terminated),
            truncated=np.concatenate(truncated),
            finals={k: gather.joined(v) for k, v in ends.items()},
            final_valid={k: gather.joined(v) for k, v in valid.items()},
        )
        return episodes


def _lower_priority() -> None:
    # Below ingest in the scheduler: a busy machine takes chunks first and writes the
    # dataset with what is left (it catches up when ingest pauses).
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
