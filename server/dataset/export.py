"""Export a session's episodes (a Trajectory) after the run: to Parquet files in the layout
the live dataset sink writes, or to a Minari dataset (``rollout-recorder export``).

Parquet: the files ``serve --dataset-uri`` would have written for these episodes, one node
(``node``, default "export"), generation 0, outcome codes 0 (a Trajectory carries none).
``recorder_client.dataset.read_episodes`` reads them back as the same Trajectory.

Minari (0.5.x, ``pip install 'rollout-recorder[minari]'``): one Minari episode per recorded
episode, in the Trajectory's order, stored in Minari's "arrow" format, lossless (no JPEG).
A Minari episode of T steps holds T+1 observations: observation t is the one step t acted
on, and the last is the episode's final observation (``final_obs``) when a flag ended it and
one was recorded, else its last observation repeated. Observations are the observation
fields (``obs``, ``obs.<key>``, ``obs.<i>``) rebuilt into the observation (a Dict space per
key level, a Tuple per index level, nested) when they were recorded; otherwise, as before
observations were a field, the state fields (a Dict of them by trajectory name when several)
or, with none, the step index within the episode (0..T, int64). Actions are as recorded
(int64 under a Discrete space, Minari's dtype for it); rewards are float32 as recorded;
terminations and truncations are the terminated and truncated flags of each episode's last
step (a recording with ``done`` only: terminated).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from recorder_client import dataset as client_dataset
from recorder_client import unflatten
from recorder_client._wire import STATE_TO_TRAJECTORY, check_session_name
from recorder_client.trajectory import PARTIAL_NAMES, Trajectory

from ..chunks import is_obs_field
from . import layout, spaces
from .sink import check_node_id

Progress = Callable[[int, int], None]
"""progress(episodes_done, bytes_done), called after each file or batch."""

MINARI_HINT = "pip install 'rollout-recorder[minari]'"
DEFAULT_FILE_BYTES = 64 << 20
_TO_STATE = {name: state for state, name in STATE_TO_TRAJECTORY.items()}


# -- Parquet -----------------------------------------------------------------
def write_parquet(
    trajectory: Trajectory,
    uri: str,
    *,
    session: str,
    node: str = "export",
    progress: Progress | None = None,
    file_bytes: int = DEFAULT_FILE_BYTES,
    storage_options: dict | None = None,
) -> dict[str, Any]:
    """Write every episode of ``trajectory`` under ``uri`` as session ``session``, in files of
    about ``file_bytes`` raw bytes each (at least one episode), each written whole.

    Episode b's worker is ``worker_ids[episode_worker[b]]`` at worker_index
    ``episode_worker[b]``. read_episodes returns episodes in (worker, env, start) order and
    numbers workers by the roster every file carries (``worker_ids``), so
    finish(pad_incomplete=False) output comes back equal. Returns a summary: uri, session, files, episodes, steps, bytes (written).
    Raises ValueError for unfinished episodes (the layout holds finished ones), and
    FileExistsError when the session already has episode files there.
    """
    check_session_name(session)
    check_node_id(node)
    if trajectory.num_episodes == 0:
        raise ValueError("trajectory: expected at least one episode, got none")
    unfinished = np.flatnonzero(~np.asarray(trajectory.episode_done, dtype=bool))
    if unfinished.size:
        raise ValueError(
            f"trajectory: the dataset layout holds finished episodes only, got "
            f"{unfinished.size} unfinished (episode {int(unfinished[0])} first); "
            "use finish(pad_incomplete=False)"
        )
    fs, root = client_dataset.filesystem(uri, storage_options)
    directory = layout.session_dir(root, session)
    if client_dataset.episode_files(fs, directory):
        raise FileExistsError(
            f"{uri}: session {session!r} already has episode files; export to another URI or "
            "session"
        )
    fields = _field_specs(trajectory)
    names = [_TO_STATE.get(n, n) for n in trajectory.final_states]
    finals = layout.final_specs(fields, names)
    config = {
        "record_states": bool(trajectory.states),
        "state_fields": [_TO_STATE.get(n, n) for n in trajectory.states],
        "exported": True,
    }
    layout.describe(fs, root, session, fields, config)
    lengths = np.asarray(trajectory.lengths, dtype=np.int64)
    terminated = np.asarray(trajectory.episode_terminated, dtype=bool)
    truncated = np.asarray(trajectory.episode_truncated, dtype=bool)
    ended = terminated | truncated  # the episodes whose final observation was recorded
    position = np.asarray(trajectory.episode_worker, dtype=np.int64)
    names = list(trajectory.worker_ids)
    # A hand-made Trajectory may lack worker ids: its positions name the workers then.
    ids = [names[p] if p < len(names) else f"worker-{p}" for p in position.tolist()]
    step_bytes = layout.ROW_OVERHEAD + sum(f.step_bytes for f in fields)
    written = 0
    ranges = _file_ranges(lengths * step_bytes, file_bytes)
    for seq, (lo, hi) in enumerate(ranges):
        rows = slice(lo, hi)
        mask = np.arange(trajectory.max_length)[None, :] < lengths[rows, None]
        episodes = layout.Episodes(
            node=node,
            session=session,
            generation=0,
            worker_ids=ids[lo:hi],
            worker_index=position[rows],
            env=np.asarray(trajectory.episode_env[rows], dtype=np.int64),
            start=np.asarray(trajectory.episode_start[rows], dtype=np.int64),
            lengths=lengths[rows],
            outcome=np.zeros(hi - lo, dtype=np.int64),
            values={f.column: trajectory.fields[f.name][rows][mask] for f in fields},
            roster=list(zip(names, range(len(names)))),
            partial=_flags(trajectory.episode_partial[rows]),
            terminated=terminated[rows],
            truncated=truncated[rows],
            finals={f.column: trajectory.final_states[f.name][rows] for f in finals},
            final_valid={f.column: ended[rows] for f in finals},
        )
        data = layout.parquet_bytes(layout.episode_table(episodes, fields, config, finals))
        name = layout.file_name(node, 0, seq)
        if seq == 0:  # every file has the same columns: listed before the first lands
            specs = layout.with_fields([], [f.to_dict() for f in fields], name)
            layout.write_columns(fs, root, session, node, layout.payload_schema(data), specs)
        layout.put_whole(fs, f"{directory}/{name}", data)
        written += len(data)
        if progress is not None:
            progress(hi, written)
    return {
        "uri": uri,
        "session": session,
        "files": len(ranges),
        "episodes": trajectory.num_episodes,
        "steps": int(lengths.sum()),
        "bytes": written,
    }


def _flags(reasons: np.ndarray) -> np.ndarray:
    """Partial flags of reason strings ("gap_before+corrupt" -> GAP_BEFORE | CORRUPT)."""
    bits = {name: bit for bit, name in PARTIAL_NAMES.items()}
    flags = np.zeros(len(reasons), dtype=np.int64)
    for i, reason in enumerate(reasons.tolist()):
        for name in filter(None, str(reason).split("+")):
            if name not in bits:
                raise ValueError(
                    f"trajectory.episode_partial[{i}]: expected '' or names from "
                    f"{sorted(bits)} joined by '+', got {reason!r}"
                )
            flags[i] |= bits[name]
    return flags


def _field_specs(trajectory: Trajectory) -> list[layout.FieldSpec]:
    """The layout's fields for the trajectory's arrays (state fields under their recorded
    names, so that their columns are the sink's)."""
    schema = {
        "action": (trajectory.actions.dtype, tuple(trajectory.actions.shape[2:])),
    }
    order = []
    for name, values in trajectory.states.items():
        state = _TO_STATE.get(name, name)
        schema[f"state:{state}"] = (values.dtype, tuple(values.shape[2:]))
        order.append(state)
    return layout.field_specs(schema, order)


def _file_ranges(episode_bytes: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive episode ranges of at most ``budget`` bytes each (at least one episode)."""
    ranges, lo, total = [], 0, 0
    for i, size in enumerate(episode_bytes.tolist()):
        if i > lo and total + size > budget:
            ranges.append((lo, i))
            lo, total = i, 0
        total += size
    ranges.append((lo, episode_bytes.size))
    return ranges


# -- Minari ------------------------------------------------------------------
SpaceArg = Any  # a gymnasium Space, a spec string (spaces.SPEC_HELP), or None: derived


def write_minari(
    trajectory: Trajectory,
    root: str | os.PathLike[str],
    dataset_id: str,
    *,
    observation_space: SpaceArg | Mapping[str, SpaceArg] = None,
    action_space: SpaceArg = None,
    observation_fields: list[str] | tuple[str, ...] | None = None,
    progress: Progress | None = None,
    description: str | None = None,
) -> Any:
    """Write ``trajectory`` as the Minari dataset ``dataset_id`` under the Minari root
    ``root`` (what MINARI_DATASETS_PATH names when loading it); returns the MinariDataset.

    Observations are the recorded observation fields (`obs`, `obs.<key>`, `obs.<i>`) rebuilt
    into the observation itself (nested Dict / Tuple spaces) when there are any, else every
    state field; ``observation_fields`` picks state fields (trajectory names) instead. Spaces
    are derived (see spaces.derive_action; observations: Box over each field's dtype range)
    unless given: ``action_space`` as a Space or spec; ``observation_space`` as a Space (the
    env's own, nested, for observation fields; a Dict of the fields for several state
    fields), a spec for every field, or a mapping of field name to Space or spec.
    ``progress`` gets raw bytes converted. MINARI_DATASETS_PATH is set to ``root`` while this
    runs (Minari reads its root from there), so do not run two at once in one process.
    """
    minari = require_minari()
    from minari.data_collector import EpisodeBuffer

    if trajectory.num_episodes == 0:
        raise ValueError("trajectory: expected at least one episode, got none")
    lengths = np.asarray(trajectory.lengths, dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError(f"trajectory.lengths: expected episodes of 1 step or more, got {lengths}")
    fields = observation_names(trajectory, observation_fields)
    nested = observation_fields is None and bool(fields) and is_obs_field(fields[0])
    mask = trajectory.mask()
    terminated = np.asarray(trajectory.episode_terminated, dtype=bool)
    truncated = np.asarray(trajectory.episode_truncated, dtype=bool)
    ended = terminated | truncated  # these episodes' final observations were recorded
    finals = {f: trajectory.final_states[f] for f in fields if f in trajectory.final_states}
    act_space = _action_space(action_space, trajectory.actions[mask])
    values = {f: _observed_values(trajectory, f, mask, finals, ended) for f in fields}
    obs_space = _observation_space(observation_space, trajectory, values, nested)
    if description is None:
        description = minari_description(trajectory, fields, nested)
    step_bytes = (
        trajectory.actions[0, 0].nbytes + 4 + sum(trajectory.states[f][0, 0].nbytes for f in fields)
    )

    def episode(b: int) -> Any:
        n = int(lengths[b])
        if fields:
            flat = {}
            for f in fields:
                steps = trajectory.states[f][b, :n]
                last = finals[f][b : b + 1] if f in finals and ended[b] else steps[-1:]
                flat[f] = np.concatenate([steps, last])
            obs: Any = unflatten(flat) if nested else flat
            if not nested and len(fields) == 1:
                obs = flat[fields[0]]
            obs = _cast(obs, obs_space)
        else:
            obs = np.arange(n + 1, dtype=obs_space.dtype)
        terminations = np.zeros(n, dtype=bool)
        terminations[-1] = terminated[b]
        truncations = np.zeros(n, dtype=bool)
        truncations[-1] = truncated[b]
        return EpisodeBuffer(
            observations=obs,
            actions=_unflattened(act_space, trajectory.actions[b, :n]).astype(
                act_space.dtype, copy=False
            ),
            rewards=trajectory.rewards[b, :n],
            terminations=terminations,
            truncations=truncations,
        )

    dataset = None
    batches = _file_ranges(lengths * step_bytes, DEFAULT_FILE_BYTES)
    with _datasets_path(root), warnings.catch_warnings():
        # Minari warns about every metadata field an export cannot know (author, env...).
        warnings.filterwarnings("ignore", category=UserWarning, module=r"minari\.")
        for lo, hi in batches:
            buffers = [episode(b) for b in range(lo, hi)]
            if dataset is None:
                dataset = minari.create_dataset_from_buffers(
                    dataset_id,
                    buffers,
                    action_space=act_space,
                    observation_space=obs_space,
                    description=description,
                    algorithm_name="rollout-recorder export",
                    data_format="arrow",
                    jpeg_encoding=False,
                )
            else:
                dataset.update_dataset_from_buffer(buffers)
            if progress is not None:
                progress(hi, int(lengths[:hi].sum()) * step_bytes)
        dataset.storage.update_episode_metadata(_episode_metadata(trajectory), range(len(lengths)))
    return dataset


def minari_description(trajectory: Trajectory, fields: list[str], nested: bool = False) -> str:
    """How the recorded arrays map to Minari's, stored as the dataset's description."""
    last = (
        "; observation t is the one step t acted on, and each episode's final observation is "
        "the recorded final_obs when a flag ended it, else its last observation repeated "
        "(T+1 observations for T steps)"
    )
    if nested:
        observed = f"the recorded observation fields {fields}, rebuilt as the observation" + last
    elif fields:
        observed = (
            f"the recorded state fields {fields} (a Dict space)"
            if len(fields) > 1
            else f"the recorded state field {fields[0]!r}"
        ) + last
    else:
        observed = "the step index within the episode, 0..T (no state was recorded)"
    return (
        f"Rollout Recorder episodes ({trajectory.num_episodes}). Observations: {observed}. "
        "Actions as recorded (as int64 under a Discrete space); rewards float32; "
        "terminations and truncations from the terminated and truncated flags on each "
        "episode's last step (a recording with done only: terminated). Episode metadata: "
        "worker_id, worker_index (join order), env, start (first step on the worker's time "
        "axis)."
    )


def require_minari() -> Any:
    """The minari module; ImportError naming the pip line when it is not installed."""
    try:
        import minari
        import PIL  # noqa: F401 - minari's arrow storage imports it, but does not require it
        import pyarrow  # noqa: F401 - the storage format written here
    except ImportError as exc:
        raise ImportError(f"the Minari export needs minari: {MINARI_HINT} ({exc})") from None
    return minari


@contextlib.contextmanager
def _datasets_path(root: str | os.PathLike[str]) -> Iterator[None]:
    old = os.environ.get("MINARI_DATASETS_PATH")
    # Absolute: Minari joins the root with paths of its own, relative to other directories.
    os.environ["MINARI_DATASETS_PATH"] = os.path.abspath(os.fspath(root))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def observation_names(
    trajectory: Trajectory, wanted: list[str] | tuple[str, ...] | None = None
) -> list[str]:
    """The fields a Minari export observes: ``wanted`` (state fields), else the observation
    fields (`obs...`) when recorded, else every state field."""
    if wanted is None:
        names = [n for n in trajectory.states if is_obs_field(n)]
        return names or list(trajectory.states)
    names = [STATE_TO_TRAJECTORY.get(w, w) for w in wanted]  # recorded names work too
    for w, name in zip(wanted, names):
        if name not in trajectory.states:
            raise ValueError(
                f"observation_fields: expected state fields from {sorted(trajectory.states)}, "
                f"got {w!r}"
            )
    return names


def _observed_values(
    trajectory: Trajectory, name: str, mask: np.ndarray, finals: dict, ended: np.ndarray
) -> np.ndarray:
    """Every observation of field ``name`` the export writes (steps, then finals)."""
    values = trajectory.states[name][mask]
    if name in finals and ended.any():
        values = np.concatenate([values, finals[name][ended]])
    return values


def _space_of(node: Any) -> Any:
    """The space of an unflattened structure of leaf spaces: Dict per dict, Tuple per tuple."""
    from gymnasium.spaces import Dict, Tuple

    if isinstance(node, dict):
        return Dict({k: _space_of(v) for k, v in node.items()})
    if isinstance(node, tuple):
        return Tuple([_space_of(v) for v in node])
    return node


def _flat_space(space: Any, prefix: str = "obs") -> dict[str, Any]:
    """A nested observation space as flat `obs...` names to leaf spaces."""
    from gymnasium.spaces import Dict, Tuple

    if isinstance(space, Dict):
        out: dict[str, Any] = {}
        for key, sub in space.spaces.items():
            out |= _flat_space(sub, f"{prefix}.{key}")
        return out
    if isinstance(space, Tuple):
        out = {}
        for i, sub in enumerate(space.spaces):
            out |= _flat_space(sub, f"{prefix}.{i}")
        return out
    return {prefix: space}


def _action_space(given: SpaceArg, values: np.ndarray) -> Any:
    if given is None:
        return spaces.derive_action(values)
    if isinstance(given, str):
        return spaces.from_spec(spaces.parse_spec(given, "action_space"), values, "action_space")
    spaces.check(given, _unflattened(given, values), "action_space")
    return given


def _unflattened(space: Any, values: np.ndarray) -> np.ndarray:
    """Actions (steps, P) back in the shape of a space of more than one dimension, which
    record() took flattened to P (the wrappers do that for a Box of shape (2, 2), say)."""
    shape = tuple(getattr(space, "shape", None) or ())
    if len(shape) > 1 and values.shape[1:] == (int(np.prod(shape)),):
        return values.reshape(values.shape[0], *shape)
    return values


def _observation_space(
    given: SpaceArg | Mapping[str, SpaceArg],
    trajectory: Trajectory,
    values: dict[str, np.ndarray],
    nested: bool,
) -> Any:
    """The observation space: ``given`` checked against every observation ``values`` (per
    field), or derived."""
    from gymnasium.spaces import Box, Dict, Space

    fields = list(values)
    if not fields:
        steps = int(trajectory.max_length)
        index = np.arange(steps + 1, dtype=np.int64)
        if given is None:
            return Box(0, steps, (), dtype=np.int64)
        if isinstance(given, Mapping):
            raise ValueError("observation_space: no state field was recorded to map a space to")
        return _action_space(given, index)  # one field: the step index
    if isinstance(given, Space):
        if nested:
            flat = _flat_space(given)
            if set(flat) != set(fields):
                raise ValueError(
                    f"observation_space: expected a space of the observation fields "
                    f"{sorted(fields)}, got {given} (fields {sorted(flat)})"
                )
            for f in fields:
                spaces.check(flat[f], values[f], f"observation_space[{f!r}]")
        elif len(fields) > 1:
            if not isinstance(given, Dict) or set(given.spaces) != set(fields):
                raise ValueError(
                    f"observation_space: expected a Dict space of the fields {fields}, got {given}"
                )
            for f in fields:
                spaces.check(given[f], values[f], f"observation_space[{f!r}]")
        else:
            spaces.check(given, values[fields[0]], "observation_space")
        return given
    per_field: Mapping[str, SpaceArg]
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise ValueError(
                f"observation_space: expected fields from {fields}, got {unknown[0]!r}"
            )
        per_field = given
    else:
        per_field = {f: given for f in fields}
    chosen = {}
    for f in fields:
        what = f"observation_space[{f!r}]"
        arg = per_field.get(f)
        if arg is None:
            chosen[f] = spaces.dtype_box(values[f].dtype, values[f].shape[1:])
        elif isinstance(arg, str):
            chosen[f] = spaces.from_spec(spaces.parse_spec(arg, what), values[f], what)
        else:
            spaces.check(arg, values[f], what)
            chosen[f] = arg
    if nested:
        return _space_of(unflatten(chosen))
    return chosen[fields[0]] if len(fields) == 1 else Dict(chosen)


def _cast(obs: Any, space: Any) -> Any:
    # Minari writes each leaf as its space's dtype (Discrete: int64), and needs it so.
    if isinstance(obs, dict):
        return {k: _cast(v, space[k]) for k, v in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_cast(v, sub) for v, sub in zip(obs, space.spaces))
    return obs.astype(space.dtype, copy=False)


def _episode_metadata(trajectory: Trajectory) -> list[dict[str, Any]]:
    names = list(trajectory.worker_ids)
    return [
        {
            "worker_id": names[w] if w < len(names) else f"worker-{w}",
            "worker_index": int(w),
            "env": int(e),
            "start": int(s),
        }
        for w, e, s in zip(
            trajectory.episode_worker.tolist(),
            trajectory.episode_env.tolist(),
            trajectory.episode_start.tolist(),
        )
    ]


__all__ = [
    "MINARI_HINT",
    "minari_description",
    "observation_names",
    "require_minari",
    "write_minari",
    "write_parquet",
]
