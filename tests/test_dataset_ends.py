"""How episodes end, in the dataset layout: the terminated / truncated columns and the final
observations (`final.<field>`), laid out on each episode's last row (null elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq

from recorder_client import dataset as client_dataset
from recorder_server.dataset import layout


def test_the_table_sets_flags_and_finals_on_last_steps_only(tmp_path: Path):
    """Flags true only on an episode's last row; final.obs.pos there when the episode has
    one, null on every other row; DuckDB reads the columns; the metadata names the finals."""
    rng = np.random.default_rng(3)
    lengths = np.array([3, 1, 4, 2])
    total = int(lengths.sum())
    fields = layout.field_specs(
        {
            "action": (np.dtype(np.int64), ()),
            "state:obs.pos": (np.dtype(np.float32), (2,)),
            "state:obs.0": (np.dtype(np.int8), ()),
        },
        ["obs.0"],
    )
    assert [f.column for f in fields] == ["action", "reward", "obs.0", "obs.pos"]
    finals = layout.final_specs(fields, ["obs.pos", "obs.0"])
    final_pos = rng.standard_normal((4, 2)).astype(np.float32)
    final_0 = np.array([5, 6, 7, 8], dtype=np.int8)
    valid = np.array([True, True, False, True])
    episodes = layout.Episodes(
        node="n",
        session="s",
        generation=0,
        worker_ids=["w"] * 4,
        worker_index=np.zeros(4, dtype=np.int64),
        env=np.array([0, 0, 1, 1]),
        start=np.array([0, 3, 0, 4]),
        lengths=lengths,
        outcome=np.zeros(4, dtype=np.int64),
        values={
            "action": np.arange(total),
            "reward": np.ones(total, np.float32),
            "obs.0": np.arange(total, dtype=np.int8),
            "obs.pos": np.zeros((total, 2), np.float32),
        },
        roster=[("w", 0)],
        terminated=np.array([True, False, False, True]),
        truncated=np.array([False, True, False, False]),
        finals={"final.obs.pos": final_pos, "final.obs.0": final_0},
        final_valid={"final.obs.pos": valid, "final.obs.0": valid},
    )
    path = tmp_path / "part.parquet"
    path.write_bytes(layout.parquet_bytes(layout.episode_table(episodes, fields, {}, finals)))
    table = pq.read_table(path)
    last = np.cumsum(lengths) - 1
    expect_term = np.zeros(total, bool)
    expect_term[last] = [True, False, False, True]
    expect_trunc = np.zeros(total, bool)
    expect_trunc[last[1]] = True
    assert table["terminated"].to_numpy().tolist() == expect_term.tolist()
    assert table["truncated"].to_numpy().tolist() == expect_trunc.tolist()
    column = table["final.obs.pos"].to_pylist()
    for row in range(total):
        if row in last[valid]:
            b = int(np.flatnonzero(last == row)[0])
            assert column[row] == final_pos[b].tolist()
        else:
            assert column[row] is None
    assert table["final.obs.0"].to_pylist() == [None, None, 5, 6, None, None, None, None, None, 8]
    meta = client_dataset.file_metadata(table.schema)
    assert [f["column"] for f in meta["finals"]] == ["final.obs.pos", "final.obs.0"]
    assert meta["finals"][0] == {
        "name": "obs.pos",
        "key": "final:obs.pos",
        "column": "final.obs.pos",
        "dtype": "<f4",
        "shape": [2],
    }
    rows = duckdb.sql(
        f"""SELECT episode_id, bool_or(terminated), bool_or(truncated),
                   count("final.obs.pos"), max("final.obs.0")
            FROM read_parquet('{path}') GROUP BY episode_id ORDER BY min(start), min(env)"""
    ).fetchall()
    assert sorted(r[1:] for r in rows) == sorted(
        [(True, False, 1, 5), (False, True, 1, 6), (False, False, 0, None), (True, False, 1, 8)]
    )


def test_state_fields_named_like_the_new_columns_keep_apart():
    assert client_dataset.state_column("terminated") == "state_terminated"
    assert client_dataset.state_column("final.obs") == "state_final.obs"
    assert client_dataset.state_column("obs.pos") == "obs.pos"
    assert client_dataset.final_column("obs.pos") == "final.obs.pos"


def test_files_from_before_the_flags_read_beside_new_ones(tmp_path: Path):
    """A session whose first file lacks terminated / truncated / final.* (written before
    them) and whose second has them: read_episodes reads the old episodes as terminated,
    not truncated, zero finals; the new ones as written."""
    fields = layout.field_specs(
        {"action": (np.dtype(np.int64), ()), "state:obs": (np.dtype(np.float32), (3,))}, []
    )
    finals = layout.final_specs(fields, ["obs"])
    rng = np.random.default_rng(5)

    def episodes(start: int, lengths: list[int], **ends) -> layout.Episodes:
        total = sum(lengths)
        return layout.Episodes(
            node="n",
            session="s",
            generation=0,
            worker_ids=["w"] * len(lengths),
            worker_index=np.zeros(len(lengths), dtype=np.int64),
            env=np.arange(len(lengths)),
            start=np.full(len(lengths), start),
            lengths=np.array(lengths),
            outcome=np.zeros(len(lengths), dtype=np.int64),
            values={
                "action": np.arange(total),
                "reward": np.ones(total, np.float32),
                "obs": rng.standard_normal((total, 3)).astype(np.float32),
            },
            roster=[("w", 0)],
            **ends,
        )

    directory = tmp_path / "session=s"
    directory.mkdir()
    old = layout.episode_table(episodes(0, [2, 3]), fields, {})
    old = old.drop_columns(["terminated", "truncated"])
    meta = json.loads(old.schema.metadata[client_dataset.METADATA_KEY])
    del meta["finals"]
    old = old.replace_schema_metadata({client_dataset.METADATA_KEY: json.dumps(meta)})
    pq.write_table(old, directory / layout.file_name("n", 0, 0))
    final = rng.standard_normal((2, 3)).astype(np.float32)
    new = episodes(
        10,
        [1, 4],
        terminated=np.array([False, True]),
        truncated=np.array([True, False]),
        finals={"final.obs": final},
        final_valid={"final.obs": np.array([True, True])},
    )
    table = layout.episode_table(new, fields, {}, finals)
    (directory / layout.file_name("n", 0, 1)).write_bytes(layout.parquet_bytes(table))
    traj = client_dataset.read_episodes(str(tmp_path), "s")
    # Episodes come env by env, in time order: env 0 (old, new), env 1 (old, new).
    assert traj.lengths.tolist() == [2, 1, 3, 4]
    assert traj.episode_terminated.tolist() == [True, False, True, True]
    assert traj.episode_truncated.tolist() == [False, True, False, False]
    assert np.array_equal(
        traj.final_states["obs"], np.stack([np.zeros(3), final[0], np.zeros(3), final[1]])
    )
    assert traj.final_states["obs"].dtype == np.float32
