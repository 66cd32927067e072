"""Episode datasets: the Parquet files a server writes with ``serve --dataset-uri``, read back.

Layout (one row per step, partitioned by session)::

    URI/_dataset.json                              format, layout version, column meanings
    URI/session=NAME/_session.json                 dtypes, trailing shapes, configuration
    URI/session=NAME/_columns-NODE.json            every column of NODE's files, Arrow types
    URI/session=NAME/part-NODE-gG-SEQ.parquet      finished episodes, whole files

Columns: ``episode_id`` (``NODE/SESSION/G/WORKER_INDEX/ENV/START``, unique across sidecars),
``node``, ``generation`` (resets of the session so far), ``worker`` (its id), ``worker_index``
(its place in join order on that node), ``env``, ``start`` (the episode's first step on the
worker's time axis), ``step`` (within the episode), ``action``, ``reward`` (float32, as
finish() returns it), ``done`` (true on an episode's last step), ``terminated`` and
``truncated`` (the flag that ended the episode, on its last step; a done-only recording's are
terminated), ``outcome`` (the episode's outcome code, on every row), ``store_trajectory`` (the episode's id in the node's trajectory
store, which the store's references name; -1 without one), ``partial`` (why the episode is
not whole: "" when it is, "gap_before" when chunks lost just before it hid its start,
"corrupt" when it reads frames that did not decode, or several joined by "+"; files from
before it lack the column), one column per recorded state field under its trajectory name
(observations: ``obs``, ``obs.KEY``, ``obs.I``) and ``final.<column>`` per final observation
recorded (``final_obs``), set on each episode's last step and null on every other row.
A field with trailing dimensions is a fixed-size list of the flattened step; each file's
Parquet metadata (``rollout_recorder``) holds the dtypes and shapes to restore. Names starting
with ``_`` are skipped by Parquet readers (Arrow, Spark, DuckDB globs of ``*.parquet``).

Files of one session need not have the same columns: ``final.<column>`` is in a file when
one of its episodes' chunks sent that final observation, and sidecars (or generations) of a
session may record different fields. Each sidecar keeps ``_columns-NODE.json`` (one writer
each, replaced whole like every file here), every column its files of the session hold, with
its Arrow type, ``final.*`` included, and every field spec (dtype, trailing shape) they
record; it lists a new column or spec before it commits the file that adds it, and starts
the list from its older files' footers when there is none. `open_dataset` unifies these
lists, one small read per node and session, and reads the footers of every file of a node
without one (files of an older server or export): no column is left out; `read_episodes`
takes the union of the fields the same way.

pyarrow and fsspec are imported on first use (``pip install 'rollout-recorder[dataset]'``;
s3fs for ``s3://``). S3 settings come from the standard AWS environment variables, the
endpoint (``AWS_ENDPOINT_URL``) included.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import numpy as np

from ._wire import trajectory_name
from .trajectory import Trajectory

LAYOUT_VERSION = 1
METADATA_KEY = b"rollout_recorder"
PARTITION = "session"
DATASET_FILE = "_dataset.json"
SESSION_FILE = "_session.json"
# Per node and session: every column of that node's files (recorder_server.dataset.sink).
COLUMNS_FILE = "_columns-{node}.json"
# The sink's file names (recorder_server.dataset.layout.file_name).
FILE_NAME = re.compile(r"part-(?P<node>.+)-g(?P<generation>\d+)-(?P<seq>\d+)\.parquet")

# Every column the layout defines besides the state fields, in file order.
FIXED_COLUMNS = (
    "episode_id",
    "node",
    "generation",
    "worker",
    "worker_index",
    "env",
    "start",
    "step",
    "action",
    "reward",
    "done",
    "terminated",
    "truncated",
    "outcome",
    "store_trajectory",
    "partial",
)
_ORDER = ("node", "generation", "worker_index", "env", "start", "step")


FINAL_PREFIX = "final."


def state_column(state_field: str) -> str:
    """The column of a state field: its trajectory name, unless the layout already uses it
    (a layout column, the partition, or a final observation's `final.` prefix)."""
    name = trajectory_name(state_field)
    taken = name in FIXED_COLUMNS or name == PARTITION or name.startswith(FINAL_PREFIX)
    return f"state_{name}" if taken else name


def final_column(column: str) -> str:
    """The column of a field's final observation (null except on episodes' last steps)."""
    return FINAL_PREFIX + column


def _require() -> tuple[Any, Any, Any]:
    try:
        import fsspec
        import pyarrow
        import pyarrow.dataset
    except ImportError as exc:
        raise ImportError(
            "episode datasets need pyarrow and fsspec: pip install 'rollout-recorder[dataset]' "
            f"(and s3fs for s3:// URIs): {exc}"
        ) from exc
    return fsspec, pyarrow, pyarrow.dataset


def filesystem(uri: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``uri`` and the dataset's root path on it."""
    fsspec, _, _ = _require()
    fs, root = fsspec.core.url_to_fs(str(uri), **(storage_options or {}))
    return fs, root.rstrip("/") or root


def episode_files(fs: Any, root: str) -> list[str]:
    """Every committed episode file under ``root`` (partial and hidden files excluded)."""
    # Object stores: list what is there now, not a cached listing. s3fs forgets a path and
    # its parents only: the directories below, which a later read of a file consults, too.
    cached = getattr(fs, "dircache", {})
    for path in [p for p in cached if p == root or str(p).startswith(f"{root}/")]:
        cached.pop(path, None)
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return []
    found = []
    for path in fs.find(root):
        rel = path[len(root) :].lstrip("/") if path.startswith(root) else path
        parts = rel.split("/")
        if path.endswith(".parquet") and not any(p.startswith(("_", ".")) for p in parts):
            found.append(path)
    return sorted(found)


def open_dataset(
    uri: str, *, storage_options: dict | None = None, session: str | None = None
) -> Any:
    """The episodes under ``uri`` as a ``pyarrow.dataset.Dataset`` (``session`` is a column);
    with ``session``, that session's files alone (another may record other dtypes). Its
    schema holds every column of every file (a file without one reads null there).

    Raises FileNotFoundError when no episode file is there yet."""
    fs, root = filesystem(uri, storage_options)
    files = episode_files(fs, root)
    if session is not None:
        files = [p for p in files if f"/{PARTITION}={session}/" in f"/{p}"]
    if not files:
        raise FileNotFoundError(
            f"{uri}: no episode files (expected {PARTITION}=NAME/part-*.parquet, written by "
            "serve --dataset-uri or rollout-recorder export)"
        )
    schemas, _ = _described(fs, files, with_fields=False)
    try:
        return _dataset(fs, root, files, schemas)
    except (TypeError, ValueError):  # pyarrow: ArrowTypeError, ArrowInvalid
        clash = _type_clash(schemas)
        if clash is None:
            raise
        name, first, second = clash
        raise ValueError(
            f"{uri}: column {name!r}: expected one type in every episode file, got {first} "
            f"and {second} (sessions may record a field two ways: open_dataset(..., "
            f"session=NAME) reads one session's files)"
        ) from None


def _type_clash(schemas: list) -> tuple[str, Any, Any] | None:
    """The first column two of ``schemas`` type differently: (name, one type, the other)."""
    seen: dict[str, Any] = {}
    for schema in schemas:
        for field in schema:
            known = seen.setdefault(field.name, field.type)
            if known != field.type:
                return field.name, known, field.type
    return None


def _described(fs: Any, files: list[str], *, with_fields: bool) -> tuple[list, list]:
    """The Arrow schemas of ``files`` and (``with_fields``) the field specs they record, each
    with ``file``, the path of a file recording it, in order of appearance."""
    # Each node's columns file lists every column (and field) of its files: one small read
    # per node and session instead of every file's footer. Without one (files of an older
    # server, an older export, a file of another name), every one of those footers is read.
    groups: dict[tuple[str, str | None], list[str]] = {}
    for path in files:
        directory, name = path.rsplit("/", 1)
        match = FILE_NAME.fullmatch(name)
        groups.setdefault((directory, match["node"] if match else None), []).append(path)
    schemas: list = []
    fields: list = []
    for (directory, node), paths in groups.items():
        listed = None if node is None else _columns_entry(fs, columns_path(directory, node))
        if listed is not None and (listed[1] is not None or not with_fields):
            schemas.append(listed[0])
            fields.extend({**f, "file": f"{directory}/{f['file']}"} for f in listed[1] or [])
            continue
        for path in paths:
            schema, specs = file_description(fs, path) if with_fields else (None, [])
            schemas.append(file_schema(fs, path) if schema is None else schema)
            fields.extend(specs)
    return schemas, fields


def _dataset(fs: Any, root: str, files: list[str], schemas: list) -> Any:
    _, pa, ds = _require()
    partitioning = ds.partitioning(pa.schema([(PARTITION, pa.string())]), flavor="hive")
    return ds.dataset(
        files,
        schema=pa.unify_schemas([*schemas, pa.schema([(PARTITION, pa.string())])]),
        filesystem=fs,
        format="parquet",
        partitioning=partitioning,
        partition_base_dir=root,
    )


def columns_path(directory: str, node: str) -> str:
    """The columns file of ``node`` in a session directory."""
    return f"{directory}/{COLUMNS_FILE.format(node=node)}"


def file_schema(fs: Any, path: str) -> Any:
    """An episode file's Arrow schema, as readers see it, from its footer (no metadata)."""
    import pyarrow.parquet as pq

    return pq.read_schema(path, filesystem=fs).remove_metadata()


def file_description(fs: Any, path: str) -> tuple[Any, list[dict[str, Any]]]:
    """An episode file's Arrow schema (no metadata) and the field specs its metadata
    records, each with ``file`` (``path``), from one read of its footer."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path, filesystem=fs)
    specs = [{**f, "file": path} for f in file_metadata(schema)["fields"]]
    return schema.remove_metadata(), specs


def columns_document(
    session: str, node: str, schema: Any, fields: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The columns file's content: every column of ``node``'s files of ``session``, with its
    Arrow type (``schema`` whole, as Arrow IPC in base64, for readers to unify), and every
    field spec they record (``fields``: name, key, column, dtype, shape, and ``file``, the
    name of a file recording it; a field recorded two ways is listed twice)."""
    schema = schema.remove_metadata()
    document = {
        "format": "rollout-recorder columns",
        "layout": LAYOUT_VERSION,
        "session": session,
        "node": node,
        "columns": [{"name": f.name, "type": str(f.type)} for f in schema],
        "arrow_schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
    }
    if fields is not None:
        document["fields"] = fields
    return document


def columns_file(fs: Any, root: str, session: str, node: str) -> Any:
    """The Arrow schema ``node``'s columns file gives for ``session`` (every column of that
    node's files there); None without one that reads."""
    listed = columns_entry(fs, root, session, node)
    return None if listed is None else listed[0]


def columns_entry(fs: Any, root: str, session: str, node: str) -> tuple[Any, list | None] | None:
    """``node``'s columns file of ``session``: the Arrow schema and the field specs it lists
    (None for a file written before it listed them); None without one that reads."""
    return _columns_entry(fs, columns_path(f"{root}/{PARTITION}={session}", node))


_SPEC_KEYS = ("name", "key", "column", "dtype", "shape", "file")


def _columns_entry(fs: Any, path: str) -> tuple[Any, list | None] | None:
    _, pa, _ = _require()
    try:
        document = json.loads(fs.cat_file(path))
        if document.get("layout") != LAYOUT_VERSION:
            return None
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(document["arrow_schema"])))
        if schema.names != [c["name"] for c in document["columns"]]:
            return None
        fields = document.get("fields")
        if fields is not None:
            fields = [{k: f[k] for k in _SPEC_KEYS} for f in fields]
            for f in fields:  # a list that does not read: every footer is read instead
                f["dtype"], f["shape"] = np.dtype(f["dtype"]).str, [int(n) for n in f["shape"]]
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: the files' own schemas are read instead
    return schema, fields


def file_metadata(schema: Any) -> dict[str, Any]:
    """The layout description an episode file carries in its Parquet metadata."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ValueError(f"not an episode file of this layout: no {METADATA_KEY.decode()!r} key")
    meta = json.loads(raw)
    if meta.get("layout") != LAYOUT_VERSION:
        raise ValueError(
            f"episode file layout: expected version {LAYOUT_VERSION}, got {meta.get('layout')!r}"
        )
    return meta


def read_episodes(
    uri: str,
    session: str | None = None,
    workers: list[str] | None = None,
    *,
    nodes: list[str] | None = None,
    storage_options: dict | None = None,
    include_partial: bool = False,
) -> Trajectory:
    """The finished episodes in a dataset, as the padded Trajectory finish() returns.

    Its fields are every field any of the files read records (sidecars of a session, or one
    node's generations, may record different state fields): an episode whose file lacks a
    field reads zeros there, as `final_states` does. The fields come from each node's
    columns file, or every file's footer where a node has none that lists them. A field
    recorded with two dtypes or trailing shapes is a ValueError naming it, both and a file
    of each (``nodes`` reads nodes apart).

    ``episode_terminated`` and ``episode_truncated`` come from the flags on each episode's
    last step (files written before those columns: terminated), ``final_states`` from the
    ``final.`` columns (zeros where null).

    Episodes the `partial` column marks (a sequence gap hid their start, or they read frames
    that did not decode) are left out unless ``include_partial``; ``episode_partial`` then
    says why each is not whole ("" when it is).

    Episodes come node by node, worker by worker (join order), environment by environment, in
    time order, and workers are numbered by the roster of each node's newest file (every
    worker the session held then, in join order): for one sidecar whose episodes are all
    written this equals ``finish(pad_incomplete=False)``, ``worker_ids`` included.
    ``session`` may be omitted when the dataset holds one; ``workers`` and ``nodes`` keep
    only those worker ids and node ids (``nodes``: only those nodes' files are read).
    """
    _, pa, _ = _require()
    import pyarrow.compute as pc

    fs, root = filesystem(uri, storage_options)
    files = episode_files(fs, root)
    if not files:
        open_dataset(uri, storage_options=storage_options)  # raises FileNotFoundError
    # From the file paths: a scan of the partition column would read every row.
    marker = f"/{PARTITION}="
    sessions = sorted({f"/{p}".rsplit(marker, 1)[1].split("/", 1)[0] for p in files})
    if session is None:
        if len(sessions) != 1:
            raise ValueError(f"session: expected one of {sessions} (the dataset holds several)")
        session = sessions[0]
    elif session not in sessions:
        raise KeyError(f"session: expected one of {sessions}, got {session!r}")
    files = [p for p in files if f"/{PARTITION}={session}/" in f"/{p}"]
    if nodes is not None:  # another node's files may record a field another way
        named = [(p, FILE_NAME.fullmatch(p.rsplit("/", 1)[-1])) for p in files]
        files = [p for p, m in named if m is None or m["node"] in {str(n) for n in nodes}]
    rosters = _rosters(fs, files, session)
    schemas, specs = _described(fs, files, with_fields=True)
    fields = merged_fields(specs)
    dataset = _dataset(fs, root, files, schemas)
    where = pc.field(PARTITION) == session
    if workers is not None:
        where &= pc.field("worker").isin([str(w) for w in workers])
    if nodes is not None:
        where &= pc.field("node").isin([str(n) for n in nodes])
    names = set(dataset.schema.names)
    # Files from before these columns lack them: their rows read as null.
    finals = [
        {**f, "column": final_column(f["column"])}
        for f in fields
        if final_column(f["column"]) in names
    ]
    flagged = "terminated" in names
    columns = list(_ORDER) + ["worker", "outcome"] + [f["column"] for f in fields + finals]
    if flagged:
        columns += ["terminated", "truncated"]
    marked = "partial" in names
    if marked:
        columns.append("partial")
    table = dataset.to_table(columns=columns, filter=where)
    for name in ("node", "worker", "partial")[: 3 if marked else 2]:
        # Dictionary columns sort and compare as their strings.
        table = table.set_column(
            table.schema.get_field_index(name), name, pc.cast(table[name], pa.string())
        )
    if marked:
        reason = pc.fill_null(table["partial"], "")
        table = table.set_column(table.schema.get_field_index("partial"), "partial", reason)
        if not include_partial:
            table = table.filter(pc.equal(reason, ""))
    if table.num_rows == 0:
        raise ValueError(f"session {session!r}: no episodes match")
    table = table.sort_by([(c, "ascending") for c in _ORDER])
    step = table["step"].to_numpy()
    firsts = np.flatnonzero(step == 0)
    lengths = np.diff(np.append(firsts, step.size)).astype(np.int64)
    if firsts.size == 0 or firsts[0] != 0 or (step != _steps(lengths)).any():
        raise ValueError(
            f"session {session!r}: episode rows are not whole (a step is missing or repeated)"
        )
    num = lengths.size
    rows = np.repeat(np.arange(num), lengths)
    node = table["node"].to_numpy(zero_copy_only=False)[firsts]
    windex = table["worker_index"].to_numpy()[firsts]
    wid = table["worker"].to_numpy(zero_copy_only=False)[firsts]
    # Workers numbered as finish() numbers them: node by node, each node's roster in join
    # order (workers without an episode too); any worker missing from it comes after.
    keep = None if workers is None else {str(w) for w in workers}
    keys: dict[tuple[str, int], int] = {}
    worker_ids: list[str] = []
    for name in sorted(rosters):
        for worker_id, index in rosters[name]:
            if keep is None or worker_id in keep:
                keys[(name, int(index))] = len(keys)
                worker_ids.append(str(worker_id))
    position = np.empty(num, dtype=np.int64)
    for i, key in enumerate(zip(node.tolist(), windex.tolist())):
        if key not in keys:
            keys[key] = len(keys)
            worker_ids.append(str(wid[i]))
        position[i] = keys[key]
    lasts = firsts + lengths - 1
    terminated = np.ones(num, dtype=bool)  # a done-only recording's episodes: terminated
    truncated = np.zeros(num, dtype=bool)
    if flagged:
        taken = table.select(["terminated", "truncated"]).take(pa.array(lasts))
        terminated = pc.fill_null(taken["terminated"], True).to_numpy(zero_copy_only=False)
        truncated = pc.fill_null(taken["truncated"], False).to_numpy(zero_copy_only=False)
    final_states = {
        spec["name"]: _finals(table[spec["column"]], lasts, spec, pa) for spec in finals
    }
    t_max = int(lengths.max())
    out: dict[str, np.ndarray] = {}
    for spec in fields:
        values = _filled(table[spec["column"]].combine_chunks(), spec, pa)
        padded = np.zeros((num, t_max, *spec["shape"]), dtype=values.dtype)
        padded[rows, step] = values
        out[spec["name"]] = padded
    return Trajectory(
        out.pop("actions"),
        out.pop("rewards"),
        out,
        lengths=lengths,
        episode_worker=position,
        episode_env=table["env"].to_numpy()[firsts].astype(np.int64),
        episode_start=table["start"].to_numpy()[firsts].astype(np.int64),
        episode_done=np.ones(num, dtype=bool),
        episode_terminated=terminated.astype(bool),
        episode_truncated=truncated.astype(bool),
        final_states=final_states,
        worker_ids=worker_ids,
        episode_partial=(
            table["partial"].to_numpy(zero_copy_only=False)[firsts].astype(np.str_)
            if marked
            else None
        ),
    )


def _rosters(fs: Any, files: list[str], session: str) -> dict[str, list]:
    """Each node's worker roster, from its newest file of ``session`` among ``files``."""
    import pyarrow.parquet as pq

    newest: dict[str, tuple[int, int, str]] = {}
    for path in files:
        match = FILE_NAME.fullmatch(path.rsplit("/", 1)[-1])
        if match is not None:
            order = (int(match["generation"]), int(match["seq"]), path)
            newest[match["node"]] = max(newest.get(match["node"], order), order)
    if not newest:
        raise ValueError(f"session {session!r}: no episode files of the selected nodes")
    return {
        node: file_metadata(pq.read_schema(path, filesystem=fs)).get("workers", [])
        for node, (_g, _s, path) in newest.items()
    }


def merged_fields(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One spec per field name, in order of appearance, from the specs of every file
    (``file`` names one recording it). A field recorded with two dtypes or trailing shapes is
    a ValueError naming it, both specs and a file of each: no one array holds both."""
    merged: dict[str, dict[str, Any]] = {}
    for spec in specs:
        first = merged.setdefault(spec["name"], spec)
        if _spec_text(first) != _spec_text(spec):
            raise ValueError(
                f"field {spec['name']!r}: recorded as {_spec_text(first)} (dtype, trailing "
                f"shape) in {first['file']} and as {_spec_text(spec)} in {spec['file']}; one "
                "Trajectory holds one of them: read those files apart (nodes=..., or "
                "open_dataset and a filter)"
            )
    return list(merged.values())


def _spec_text(spec: dict[str, Any]) -> str:
    return f"{np.dtype(spec['dtype']).str}{tuple(int(n) for n in spec['shape'])}"


def _steps(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each episode length n, joined."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts


def _column(column: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    array = column.combine_chunks()
    if shape:
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    return values.astype(dtype, copy=False).reshape(len(column), *shape)


def _finals(column: Any, lasts: np.ndarray, spec: dict[str, Any], pa: Any) -> np.ndarray:
    """(B, *shape) final observations from their column's last-step rows (null: zeros)."""
    return _filled(column.take(pa.array(lasts)).combine_chunks(), spec, pa)


def _filled(array: Any, spec: dict[str, Any], pa: Any) -> np.ndarray:
    """(rows, *shape) values of a field's column, zeros on its null rows (a file without the
    field, a step without a final observation)."""
    dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
    if array.null_count == 0:
        return _column(pa.chunked_array([array]), dtype, shape)
    out = np.zeros((len(array), *shape), dtype=dtype)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    if valid.any():
        out[valid] = _column(pa.chunked_array([array.filter(pa.array(valid))]), dtype, shape)
    return out


def describe_fields(fields: list[dict[str, Any]]) -> str:
    return ", ".join(f"{f['name']}:{f['dtype']}{tuple(f['shape'])}" for f in fields)
