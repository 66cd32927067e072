"""Episode files: Arrow tables of finished episodes in the dataset layout, written whole.

The layout itself (columns, partitions, metadata) is described in `recorder_client.dataset`,
which reads it back. A file appears under its final name only once it is complete: renamed
into place on a local filesystem, a single object PUT on an object store.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recorder_client import __version__
from recorder_client import dataset as layout
from recorder_client._wire import trajectory_name
from recorder_client.trajectory import partial_name

from ..chunks import FINAL, STATE, Schema, is_obs_field


@dataclass(frozen=True)
class FieldSpec:
    """One stored field: its trajectory name, chunk key, column, dtype and trailing shape."""

    name: str
    key: str
    column: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def step_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "column": self.column,
            "dtype": self.dtype.str,
            "shape": list(self.shape),
        }


def field_specs(schema: Schema, state_order: list[str] | tuple[str, ...]) -> list[FieldSpec]:
    """The fields of a session's episodes, in finish() order (rewards as float32): the
    configured state fields, then the observation fields (`obs...`, recorded unannounced)."""
    dtype, shape = schema["action"]
    specs = [
        FieldSpec("actions", "action", "action", np.dtype(dtype), tuple(shape)),
        FieldSpec("rewards", "reward", "reward", np.dtype(np.float32), ()),
    ]
    observed = [k[len(STATE) :] for k in schema if k.startswith(STATE)]
    for state in dict.fromkeys([*state_order, *filter(is_obs_field, observed)]):
        key = f"state:{state}"
        if key in schema:
            dtype, shape = schema[key]
            specs.append(
                FieldSpec(
                    trajectory_name(state),
                    key,
                    layout.state_column(state),
                    np.dtype(dtype),
                    tuple(shape),
                )
            )
    return specs


def final_specs(fields: list[FieldSpec], names: list[str] | tuple[str, ...]) -> list[FieldSpec]:
    """The final-observation columns of the state fields ``names`` (recorded names) among
    ``fields``: the field's dtype and shape, its column prefixed with `final.`."""
    by_key = {f.key: f for f in fields}
    specs = []
    for state in names:
        spec = by_key.get(STATE + state)
        if spec is not None:
            column = layout.final_column(spec.column)
            specs.append(FieldSpec(spec.name, FINAL + state, column, spec.dtype, spec.shape))
    return specs


@dataclass
class Episodes:
    """Finished episodes of one session, flattened step by step, ready to be a table."""

    node: str
    session: str
    generation: int
    worker_ids: list[str]
    """Per episode: its worker's id."""
    worker_index: np.ndarray
    env: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    outcome: np.ndarray
    """Per episode: its outcome code (the last non-zero code of its steps; 0 for none)."""
    values: dict[str, np.ndarray]
    """Per field column: (steps, *shape) values, episode after episode."""
    store_ids: np.ndarray | None = None
    """Per episode: its trajectory id in the session's store (-1: not there); None: none."""
    roster: list[tuple[str, int]] = field(default_factory=list)
    """Every worker the session held when the file was written, (id, worker_index) in join
    order: readers number workers as finish() does, those without an episode included."""
    partial: np.ndarray | None = None
    """Per episode: why it is not whole, as `recorder_client.trajectory` flags (0: whole);
    None: all whole."""
    terminated: np.ndarray | None = None
    """Per episode: the terminated flag of its last step (None: all True, a done-only
    session's episodes)."""
    truncated: np.ndarray | None = None
    """Per episode: the truncated flag of its last step (None: all False)."""
    finals: dict[str, np.ndarray] = field(default_factory=dict)
    """Per final column: (episodes, *shape) final observations."""
    final_valid: dict[str, np.ndarray] = field(default_factory=dict)
    """Per final column: (episodes,) bool, the episodes that have one (null elsewhere)."""

    @property
    def num_steps(self) -> int:
        return int(self.lengths.sum())


REQUIRED_COLUMNS = (
    "episode_id",
    "node",
    "generation",
    "worker",
    "worker_index",
    "env",
    "start",
    "step",
    "done",
    "terminated",
    "truncated",
    "outcome",
    "store_trajectory",
    "partial",
)


def episode_table(
    episodes: Episodes,
    fields: list[FieldSpec],
    config: dict[str, Any],
    finals: list[FieldSpec] | tuple[FieldSpec, ...] = (),
) -> Any:
    """The Arrow table of ``episodes`` in the dataset layout, its metadata attached.
    ``finals``: the final-observation columns (the same for every table of one file)."""
    import pyarrow as pa

    lengths = episodes.lengths.astype(np.int64)
    count = lengths.size
    total = int(lengths.sum())

    def per_step(values: np.ndarray, dtype: Any) -> Any:
        # Each episode's value repeated over its steps (a run, not a gather).
        return pa.array(np.repeat(np.asarray(values).astype(dtype, copy=False), lengths))

    rows = np.repeat(np.arange(count, dtype=np.int32), lengths)
    step = np.arange(total, dtype=np.int32) - np.repeat(
        (np.cumsum(lengths) - lengths).astype(np.int32), lengths
    )
    ids = [
        f"{episodes.node}/{episodes.session}/{episodes.generation}/{w}/{e}/{s}"
        for w, e, s in zip(
            episodes.worker_index.tolist(), episodes.env.tolist(), episodes.start.tolist()
        )
    ]
    names = sorted(set(episodes.worker_ids))
    where = {w: i for i, w in enumerate(names)}
    worker_codes = np.asarray([where[w] for w in episodes.worker_ids], dtype=np.int32)
    done = np.zeros(total, dtype=bool)
    last = np.cumsum(lengths) - 1
    done[last] = True
    # The flags stand on the last step only (an episode's other steps have neither).
    terminated, truncated = np.zeros(total, dtype=bool), np.zeros(total, dtype=bool)
    terminated[last] = True if episodes.terminated is None else episodes.terminated
    if episodes.truncated is not None:
        truncated[last] = episodes.truncated
    columns: dict[str, Any] = {
        "episode_id": pa.DictionaryArray.from_arrays(pa.array(rows), pa.array(ids, pa.string())),
        "node": pa.DictionaryArray.from_arrays(
            pa.array(np.zeros(total, dtype=np.int32)), pa.array([episodes.node], pa.string())
        ),
        "generation": pa.array(np.full(total, episodes.generation, dtype=np.int32)),
        "worker": pa.DictionaryArray.from_arrays(
            per_step(worker_codes, np.int32), pa.array(names, pa.string())
        ),
        "worker_index": per_step(episodes.worker_index, np.int32),
        "env": per_step(episodes.env, np.int32),
        "start": per_step(episodes.start, np.int64),
        "step": pa.array(step),
    }
    del rows, step
    for spec in fields:
        columns[spec.column] = _arrow(episodes.values[spec.column], spec)
        if spec.column == "reward":
            columns["done"] = pa.array(done)
            columns["terminated"] = pa.array(terminated)
            columns["truncated"] = pa.array(truncated)
            columns["outcome"] = per_step(episodes.outcome, np.int8)
            store = episodes.store_ids
            if store is None:
                store = np.full(count, -1, dtype=np.int64)
            columns["store_trajectory"] = per_step(store, np.int64)
            columns["partial"] = _partial_column(episodes.partial, count, lengths)
    for spec in finals:  # on each episode's last row; null elsewhere
        values = np.zeros((total, *spec.shape), dtype=spec.dtype)
        has = np.zeros(total, dtype=bool)
        valid = episodes.final_valid[spec.column]
        values[last[valid]] = episodes.finals[spec.column][valid]
        has[last[valid]] = True
        columns[spec.column] = _arrow(values, spec, null=~has)
    # These columns never hold a null: declared so, Parquet stores no definition levels for
    # them (cheaper to write; files of either kind read back alike). Named, so that every
    # row group of a file has the same schema whatever its values; any other is nullable.
    required = {*REQUIRED_COLUMNS, *(f.column for f in fields)}
    meta = {
        "layout": layout.LAYOUT_VERSION,
        "session": episodes.session,
        "node": episodes.node,
        "generation": episodes.generation,
        "fields": [f.to_dict() for f in fields],
        "finals": [f.to_dict() for f in finals],
        "workers": [[w, int(i)] for w, i in episodes.roster],
        "config": config,
        "versions": versions(),
    }
    schema = pa.schema(
        [pa.field(c, a.type, nullable=c not in required) for c, a in columns.items()],
        metadata={layout.METADATA_KEY: json.dumps(meta).encode()},
    )
    return pa.Table.from_arrays(list(columns.values()), schema=schema)


def _partial_column(flags: np.ndarray | None, count: int, lengths: np.ndarray) -> Any:
    """Per step: its episode's partial reason ("" when whole), as a dictionary column."""
    import pyarrow as pa

    flags = np.zeros(count, dtype=np.int64) if flags is None else np.asarray(flags, np.int64)
    values, codes = np.unique(flags, return_inverse=True)
    names = pa.array([partial_name(int(v)) for v in values.tolist()], pa.string())
    codes = np.repeat(codes.astype(np.int32), lengths)
    return pa.DictionaryArray.from_arrays(pa.array(codes), names)


def _arrow(values: np.ndarray, spec: FieldSpec, null: np.ndarray | None = None) -> Any:
    """The column of ``values``; ``null``: (steps,) bool, the rows stored as null."""
    import pyarrow as pa

    values = np.ascontiguousarray(values, dtype=spec.dtype)
    mask = None if null is None else pa.array(null)
    if not spec.shape:
        return pa.array(values, mask=null)
    size = int(np.prod(spec.shape, dtype=np.int64))
    flat = pa.array(values.reshape(-1))
    if size == 0:  # Arrow has no fixed-size list of 0: a list that is always empty
        offsets = pa.array(np.zeros(values.shape[0] + 1, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, flat, mask=mask)
    return pa.FixedSizeListArray.from_arrays(flat, size, mask=mask)


def versions() -> dict[str, str]:
    import pyarrow as pa

    return {"rollout_recorder": __version__, "pyarrow": pa.__version__}


# Per-step bytes besides the fields (ids, indexes, step, done, outcome) in a file's budget.
ROW_OVERHEAD = 32

_INDEXED = ["generation", "worker_index", "env", "start", "step", "outcome", "store_trajectory"]


# Bytes of steps (as the file budget counts them) per Parquet row group: the sink gathers
# and encodes a file one row group at a time, so its memory holds about two of them.
ROW_GROUP_BYTES = 32 << 20

PARQUET_OPTIONS: dict[str, Any] = {
    # zstd 1 against none on a local disk: as fast to write (fewer bytes to move) and 10-30x
    # smaller on the bench's workload; lz4 10% faster, 2x larger.
    "compression": "zstd",
    "compression_level": 1,
    # Dictionaries for the id strings only, statistics for the columns one filters on:
    # both cost time on every value of the wide numeric columns and save nothing there.
    "use_dictionary": ["episode_id", "node", "worker", "partial"],
    "write_statistics": [*_INDEXED, "episode_id", "node", "worker", "partial"],
}


def parquet_bytes(table: Any) -> bytes:
    """The table as the bytes of one Parquet file (row groups of about ROW_GROUP_BYTES)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    rows = max(1, ROW_GROUP_BYTES * table.num_rows // max(table.nbytes, 1))
    pq.write_table(table, sink, row_group_size=rows, **PARQUET_OPTIONS)
    return sink.getvalue().to_pybytes()


@dataclass(frozen=True)
class Staged:
    """A complete local file under a hidden name, for `put_whole` to rename into place."""

    path: str


class EpisodeFile:
    """One episode file written a row group at a time (`write`, one table each, from any one
    thread at a time); `finish` gives what `put_whole` puts in place: on a local disk the
    file staged under a hidden name (never a copy in memory), else its bytes."""

    def __init__(self, fs: Any, path: str) -> None:
        import pyarrow as pa

        directory, name = path.rsplit("/", 1)
        self.local = is_local(fs)
        if self.local:
            os.makedirs(directory, exist_ok=True)
            # Hidden while partial: readers skip names starting with "."
            self.where: Any = f"{directory}/.{name}.{uuid.uuid4().hex[:8]}.partial"
        else:
            self.where = pa.BufferOutputStream()
        self._writer: Any = None

    def write(self, table: Any) -> None:
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(self.where, table.schema, **PARQUET_OPTIONS)
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))

    def finish(self) -> Staged | bytes:
        if self._writer is None:
            raise ValueError("an episode file needs at least one row group")
        self._writer.close()
        if not self.local:
            return self.where.getvalue().to_pybytes()
        fd = os.open(self.where, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return Staged(self.where)

    def discard(self) -> None:
        """Close and remove what is left (nothing once `put_whole` took it)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self.local:
            with contextlib.suppress(OSError):
                os.unlink(self.where)


def is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def put_whole(fs: Any, path: str, payload: bytes | Staged) -> int:
    """Put ``payload`` (bytes, or a local file `EpisodeFile` staged) at ``path`` so that a
    reader sees all of it or nothing. Returns its size in bytes."""
    directory = path.rsplit("/", 1)[0]
    if isinstance(payload, Staged):
        os.replace(payload.path, path)
        _fsync_dir(directory)
        return os.path.getsize(path)
    if is_local(fs):
        os.makedirs(directory, exist_ok=True)
        # Hidden while partial: readers skip names starting with "."
        temp = f"{directory}/.{path.rsplit('/', 1)[1]}.{uuid.uuid4().hex[:8]}.partial"
        with open(temp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
        _fsync_dir(directory)
        return len(payload)
    fs.pipe_file(path, payload)  # one PUT: the object exists whole or not at all
    # Committed only once the store lists it at its full size.
    fs.invalidate_cache(directory)
    size = fs.info(path).get("size")
    if size != len(payload):
        raise OSError(f"{path}: the store holds {size} bytes after writing {len(payload)}")
    return size


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def session_dir(root: str, session: str) -> str:
    return f"{root}/{layout.PARTITION}={session}"


FILE_NAME = layout.FILE_NAME


def file_name(node: str, generation: int, seq: int) -> str:
    """Names sort in write order within a node (readers take the newest one's roster)."""
    return f"part-{node}-g{generation:06d}-{seq:010d}.parquet"


def describe(
    fs: Any, root: str, session: str, fields: list[FieldSpec], config: dict[str, Any]
) -> None:
    """Write the dataset's and the session's small JSON descriptions (same bytes from every
    sidecar of a run, so concurrent writers agree)."""
    dataset = {
        "format": "rollout-recorder episodes",
        "layout": layout.LAYOUT_VERSION,
        "partitioning": f"hive: {layout.PARTITION}=NAME",
        "columns": {
            "episode_id": "NODE/SESSION/GENERATION/WORKER_INDEX/ENV/START, unique per episode",
            "node": "the sidecar that wrote the episode (serve --node-id)",
            "generation": "resets of the session before the episode",
            "worker": "the worker id",
            "worker_index": "the worker's place in join order on its node",
            "env": "the environment within the worker",
            "start": "the episode's first step on the worker's time axis",
            "step": "the step within the episode, from 0",
            "partial": (
                "why the episode is not whole: '' when it is; 'gap_before' (chunks lost "
                "just before it hid its start), 'corrupt' (it reads frames that did not "
                "decode: zeros there), or several joined by '+'"
            ),
            "action": "the action taken",
            "reward": "the reward (float32)",
            "done": "true on the episode's last step",
            "terminated": (
                "true on the last step of an episode a terminal state ended (done-only "
                "recordings: equal to done)"
            ),
            "truncated": "true on the last step of an episode a time limit (or the like) cut",
            "outcome": "the episode's outcome code (EpisodeOutcome; 0: none)",
            "store_trajectory": "the episode's id in its node's trajectory store (-1: none)",
            "<state field>": (
                "one column per recorded state field, by trajectory name; observations as "
                "obs (a plain array), obs.KEY (Dict), obs.I (Tuple), nesting joined by dots"
            ),
            "final.<state field>": (
                "the observation after the episode's last step (final_obs), on that step's "
                "row, null on every other row and when none was recorded"
            ),
        },
        "versions": versions(),
    }
    put_whole(fs, f"{root}/{layout.DATASET_FILE}", _json(dataset))
    put_whole(
        fs,
        f"{session_dir(root, session)}/{layout.SESSION_FILE}",
        _json(
            {
                "session": session,
                "fields": [f.to_dict() for f in fields],
                "config": config,
                "columns": (
                    f"every column of a node's files, final.* included, with its Arrow type: "
                    f"{layout.COLUMNS_FILE.format(node='NODE')}"
                ),
            }
        ),
    )


def payload_schema(payload: bytes | Staged) -> Any:
    """The Arrow schema readers will see in an episode file `EpisodeFile.finish` gave."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = payload.path if isinstance(payload, Staged) else pa.BufferReader(payload)
    return pq.read_schema(source).remove_metadata()


def node_files(fs: Any, root: str, session: str, node: str) -> list[str]:
    """The episode files of ``node`` in ``session`` (every generation)."""
    found = []
    for path in layout.episode_files(fs, session_dir(root, session)):
        match = FILE_NAME.fullmatch(path.rsplit("/", 1)[-1])
        if match is not None and match["node"] == node:
            found.append(path)
    return found


def with_columns(known: Any, schema: Any) -> Any:
    """``known`` with the columns of ``schema`` it lacks appended (by name: a column whose
    type differs keeps the one listed first, and the write goes on; readers cast the file's
    column or report the difference)."""
    import pyarrow as pa

    if known is None:
        return schema
    return pa.schema([*known, *(f for f in schema if f.name not in known.names)])


def with_fields(known: list[dict], specs: list[dict], file: str) -> list[dict]:
    """``known`` (field specs, each with ``file``) with those of ``specs`` it lacks appended,
    naming ``file`` (one recorded with another dtype or shape too: readers report both)."""

    def spec(f: dict) -> tuple:
        return f["name"], np.dtype(f["dtype"]).str, tuple(f["shape"])

    seen = {spec(f) for f in known}
    added = [{**f, "file": file} for f in specs if spec(f) not in seen]
    return [*known, *added]


def write_columns(
    fs: Any, root: str, session: str, node: str, schema: Any, fields: list[dict] | None = None
) -> None:
    """Write ``node``'s columns file of ``session`` whole (see `recorder_client.dataset`)."""
    path = layout.columns_path(session_dir(root, session), node)
    put_whole(fs, path, _json(layout.columns_document(session, node, schema, fields)))


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
