"""Hypothesis strategies for recorder scenarios.

A :class:`Scenario` is a recorder configuration plus the sequence of
``record()`` calls to make, then one ``finish(pad_incomplete)``.  Drive any
recorder (reference model, factoriax, remote client) with::

    rec = Recorder(**scenario.config())
    for trajectories, env_states in scenario.calls():      # or calls("mapping")
        rec.record(trajectories, env_states)
    result = rec.finish(pad_incomplete=scenario.pad_incomplete)

Structure (sizes, dtypes, done patterns, which fields exist) is drawn with
Hypothesis so that it shrinks; array contents come from ``numpy``'s
``default_rng(seed)`` with a drawn seed, which keeps generation fast.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from reference_model import traj_name

ACTION_DTYPES = (
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "float16",
    "float32",
    "float64",
    "bool",
)
REWARD_DTYPES = ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool")
STATE_DTYPES = ACTION_DTYPES + ("uint16", "uint32", "uint64")
DONE_DTYPES = ("bool", "bool", "bool", "uint8", "int32", "float32")  # 0/1 values
DONE_PATTERNS = ("none", "all", "dense", "sparse", "final")

#: Env-state names that factoriax 0.1.0's ``Trajectory`` accepts (a copy of its
#: ``_OPTIONAL_ARRAY_FIELDS`` minus ``rewards``, plus ``player_positions`` and
#: ``map``); test_reference_model checks this copy against the installed file.
FACTORIAX_STATE_FIELDS: tuple[str, ...] = (
    "player_positions",
    "positions",
    "player_directions",
    "player_inventory",
    "map",
    "block_map",
    "block_resources",
    "machine_types",
    "tile_entity",
    "ent_y",
    "ent_x",
    "ent_type",
    "ent_direction",
    "ent_power",
    "ent_buf_type",
    "ent_buf_count",
    "ent_asm_in_type",
    "ent_asm_in_count",
    "ent_asm_out_type",
    "ent_asm_out_count",
    "ent_health",
    "selected_player",
    "achievements",
    "achievements_unlocked",
    "items_mined",
    "science_consumed_step",
    "timesteps",
)

#: Result keys a state field may not map to (see reference_model.RESERVED_KEYS).
RESERVED_NAMES = frozenset(
    {
        "actions",
        "rewards",
        "lengths",
        "episode_env",
        "episode_start",
        "episode_done",
        "episode_worker",
    }
)

#: Names any recorder must handle, whether or not factoriax knows them.
COMMON_NAMES = (
    "player_positions",
    "player_inventory",
    "positions",
    "map",
    "block_map",
    "foo_bar",
    "x",
    "timesteps",
    "health2",
    "items",
    "keys",
    "get",
)

_name = st.from_regex(r"[a-z][a-z0-9_]{0,9}", fullmatch=True).filter(
    lambda s: s not in RESERVED_NAMES
)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, repr=False)
class Chunk:
    """One ``record()`` call's data.

    ``states`` is None when the call passes ``env_states=None``; otherwise it
    maps env-state names to arrays ``(T, N, *trailing)`` or to None (an
    attribute/key whose value is None, which recorders skip).
    """

    action: np.ndarray  # (T, N) or (T, N, P)
    reward: np.ndarray  # (T, N)
    done: np.ndarray  # (T, N), 0/1 values
    states: Mapping[str, np.ndarray | None] | None

    def trajectories(self, style: str = "attribute") -> Any:
        """The ``trajectories`` argument: SimpleNamespace or dict with action/reward/done."""
        return to_input({"action": self.action, "reward": self.reward, "done": self.done}, style)

    def env_states(self, style: str = "attribute") -> Any:
        """The ``env_states`` argument (None, SimpleNamespace or dict)."""
        return None if self.states is None else to_input(self.states, style)

    def __repr__(self) -> str:
        def d(a: np.ndarray) -> str:
            return f"{a.dtype}{list(a.shape)}"

        states = (
            None
            if self.states is None
            else {k: (None if v is None else d(v)) for k, v in self.states.items()}
        )
        return (
            f"Chunk(action={d(self.action)}, reward={d(self.reward)}, "
            f"done={d(self.done)} sum={int(self.done.sum())}, states={states})"
        )


def to_input(fields: Mapping[str, Any], style: str) -> Any:
    """``style="attribute"``: a SimpleNamespace; ``style="mapping"``: a plain dict."""
    if style == "attribute":
        return types.SimpleNamespace(**fields)
    if style == "mapping":
        return dict(fields)
    raise ValueError(f"unknown style {style!r}")


@dataclass(frozen=True)
class Scenario:
    max_episodes: int | None
    record_states: bool
    state_fields: tuple[str, ...]
    pad_incomplete: bool
    chunks: tuple[Chunk, ...]
    style: str = "attribute"  # the style calls() uses by default
    seed: int = 0

    def config(self) -> dict[str, Any]:
        """Keyword arguments of the recorder constructor."""
        return {
            "max_episodes": self.max_episodes,
            "record_states": self.record_states,
            "state_fields": list(self.state_fields),
        }

    def calls(self, style: str | None = None) -> list[tuple[Any, Any]]:
        """``[(trajectories, env_states), ...]`` in record() order."""
        style = style or self.style
        return [(c.trajectories(style), c.env_states(style)) for c in self.chunks]


@dataclass(frozen=True)
class MultiScenario:
    """Several workers of one session.

    ``workers[w]`` are worker ``w``'s chunks (``w`` = join order); ``order``
    is the global interleaving: the k-th occurrence of ``w`` is worker ``w``'s
    k-th ``record()``.
    """

    max_episodes: int | None
    record_states: bool
    state_fields: tuple[str, ...]
    pad_incomplete: bool
    workers: tuple[tuple[Chunk, ...], ...]
    order: tuple[int, ...]
    style: str = "attribute"
    seed: int = 0

    def config(self) -> dict[str, Any]:
        return {
            "max_episodes": self.max_episodes,
            "record_states": self.record_states,
            "state_fields": list(self.state_fields),
        }

    def worker_calls(self, style: str | None = None) -> list[list[tuple[Any, Any]]]:
        style = style or self.style
        return [[(c.trajectories(style), c.env_states(style)) for c in w] for w in self.workers]

    def interleaved_calls(self, style: str | None = None) -> list[tuple[int, Any, Any]]:
        """``[(worker, trajectories, env_states), ...]`` in global order."""
        calls = self.worker_calls(style)
        pos = [0] * len(calls)
        out = []
        for w in self.order:
            out.append((w, *calls[w][pos[w]]))
            pos[w] += 1
        return out


# --------------------------------------------------------------------------- values


def random_values(rng: np.random.Generator, shape: tuple, dtype: str, mode: str) -> np.ndarray:
    """Array of ``dtype``.

    mode "small": small non-negative numbers (like action ids); "full": the
    whole integer range / normal floats with NaN, -0.0 and inf sprinkled in;
    "bits": uniformly random bit patterns (any NaN payload, denormals).
    """
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        if mode == "small":
            return rng.integers(0, 12, size=shape).astype(dt)
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    # floats
    if mode == "bits":
        uint = np.dtype(f"u{dt.itemsize}")
        return rng.integers(0, np.iinfo(uint).max, size=shape, dtype=uint, endpoint=True).view(dt)
    if mode == "small":
        return rng.integers(0, 12, size=shape).astype(dt)
    arr = (rng.standard_normal(shape) * 100.0).astype(dt)
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 0.0], dtype=dt)
    mask = rng.random(shape) < 0.1
    arr[mask] = rng.choice(special, size=int(mask.sum()))
    return arr


def random_dones(rng: np.random.Generator, shape: tuple, pattern: str, dtype: str) -> np.ndarray:
    if pattern == "none":
        flags = np.zeros(shape, dtype=bool)
    elif pattern == "all":
        flags = np.ones(shape, dtype=bool)
    elif pattern == "dense":
        flags = rng.random(shape) < 0.5
    elif pattern == "sparse":
        flags = rng.random(shape) < 0.1
    elif pattern == "final":  # done at the last step of the chunk only
        flags = np.zeros(shape, dtype=bool)
        if shape[0]:
            flags[-1] = True
    else:
        raise ValueError(pattern)
    return flags.astype(dtype)


# --------------------------------------------------------------------------- strategies


@st.composite
def _layout(draw: Any, factoriax_compatible: bool, mixed_dtypes: bool) -> dict:
    """Everything about a recording except the per-worker chunk count and N."""
    P = draw(st.one_of(st.none(), st.integers(1, 3)))
    action_dtype = draw(st.sampled_from(ACTION_DTYPES))
    reward_dtype = draw(st.sampled_from(REWARD_DTYPES))
    done_dtype = draw(st.sampled_from(DONE_DTYPES))
    value_mode = draw(st.sampled_from(("small", "full", "bits")))
    done_mode = draw(st.sampled_from(DONE_PATTERNS + ("mixed", "mixed")))

    # State fields that the env states carry: name -> (trailing shape, dtype).
    pool = FACTORIAX_STATE_FIELDS if factoriax_compatible else COMMON_NAMES
    present_names = draw(
        st.lists(
            st.one_of(st.sampled_from(pool), _name)
            if not factoriax_compatible
            else st.sampled_from(pool),
            max_size=4,
            unique=True,
        )
    )
    if draw(st.integers(0, 4)) == 0:  # two names that map to one trajectory name
        pair = draw(st.sampled_from((("positions", "player_positions"), ("map", "block_map"))))
        present_names = list(dict.fromkeys([*present_names, *pair]))
    trailing = st.lists(st.integers(1, 3), max_size=2).map(tuple)
    specs = {name: (draw(trailing), draw(st.sampled_from(STATE_DTYPES))) for name in present_names}
    # Requested names: some present, some absent (absent names may be anything).
    absent = draw(st.lists(st.one_of(st.sampled_from(COMMON_NAMES), _name), max_size=2))
    requested = [n for n in present_names if draw(st.integers(0, 3)) > 0] + absent
    requested = list(dict.fromkeys(draw(st.permutations(requested))))
    if draw(st.integers(0, 9)) == 0:
        state_fields = None  # use the recorder's default
    else:
        state_fields = tuple(requested)
    # How state fields appear per chunk: always / sometimes missing / env_states None at times
    presence = draw(st.sampled_from(("always", "always", "always", "sometimes", "none_states")))

    return {
        "P": P,
        "action_dtype": action_dtype,
        "reward_dtype": reward_dtype,
        "done_dtype": done_dtype,
        "value_mode": value_mode,
        "done_mode": done_mode,
        "specs": specs,
        "state_fields": state_fields,
        "presence": presence,
        "mixed_dtypes": mixed_dtypes,
        "max_episodes": draw(st.one_of(st.none(), st.integers(0, 12))),
        "record_states": draw(st.integers(0, 2)) > 0,
        "pad_incomplete": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _draw_chunks(
    draw: Any, layout: dict, rng: np.random.Generator, n_envs: int, lengths: list[int]
) -> tuple[Chunk, ...]:
    chunks = []
    for T in lengths:
        pattern = layout["done_mode"]
        if pattern == "mixed":
            pattern = draw(st.sampled_from(DONE_PATTERNS))
        action_dtype = layout["action_dtype"]
        reward_dtype = layout["reward_dtype"]
        if layout["mixed_dtypes"] and draw(st.booleans()):
            action_dtype = draw(st.sampled_from(ACTION_DTYPES))
            reward_dtype = draw(st.sampled_from(REWARD_DTYPES))
        a_shape = (T, n_envs) if layout["P"] is None else (T, n_envs, layout["P"])
        action = random_values(rng, a_shape, action_dtype, layout["value_mode"])
        reward = random_values(rng, (T, n_envs), reward_dtype, layout["value_mode"])
        done = random_dones(rng, (T, n_envs), pattern, layout["done_dtype"])

        states: dict[str, np.ndarray | None] | None = {}
        presence = layout["presence"]
        if presence == "none_states" and draw(st.booleans()):
            states = None
        else:
            for name, (trail, dtype) in layout["specs"].items():
                if presence == "sometimes" and not draw(st.booleans()):
                    if draw(st.booleans()):
                        states[name] = None  # present, but None
                    continue
                states[name] = random_values(rng, (T, n_envs, *trail), dtype, layout["value_mode"])
        chunks.append(Chunk(action, reward, done, states))
    return tuple(chunks)


def _consistent(layout: dict) -> dict:
    """Same state fields in every chunk; requested names map to distinct trajectory names."""
    layout = {**layout, "presence": "always"}
    if layout["state_fields"] is not None:
        by_traj: dict[str, str] = {}
        for name in layout["state_fields"]:
            by_traj.setdefault(traj_name(name), name)
        layout["state_fields"] = tuple(by_traj.values())
    return layout


#: Chunk length T: 1..12, and 0 now and then.
_chunk_len = st.sampled_from((0,) + tuple(range(1, 13)) * 3)


@st.composite
def scenarios(
    draw: Any,
    *,
    factoriax_compatible: bool = False,
    mixed_dtypes: bool = False,
    max_chunks: int = 6,
    style: str | None = None,
    consistent_states: bool = False,
) -> Scenario:
    """A single-worker scenario.

    ``factoriax_compatible``: attribute-style inputs, and only state fields that
    factoriax's Trajectory accepts are present in the env states (absent
    requested names may still be anything).  ``mixed_dtypes``: chunks may
    differ in action/reward dtype (joined with numpy promotion).  ``style``:
    fix the input style; default draws "attribute" or "mapping" (attribute
    only when factoriax_compatible).  ``consistent_states``: every chunk carries
    the same state fields and no two requested names map to one trajectory name
    (the remote recorder refuses the other cases with an error instead of
    returning misaligned data).
    """
    layout = draw(_layout(factoriax_compatible, mixed_dtypes))
    if consistent_states:
        layout = _consistent(layout)
    rng = np.random.default_rng(layout["seed"])
    n_envs = draw(st.integers(1, 5))
    lengths = draw(st.lists(_chunk_len, min_size=1, max_size=max_chunks))
    chunks = _draw_chunks(draw, layout, rng, n_envs, lengths)
    if style is None:
        style = (
            "attribute" if factoriax_compatible else draw(st.sampled_from(("attribute", "mapping")))
        )
    state_fields = layout["state_fields"]
    return Scenario(
        max_episodes=layout["max_episodes"],
        record_states=layout["record_states"],
        state_fields=(
            ("player_positions", "player_inventory") if state_fields is None else state_fields
        ),
        pad_incomplete=layout["pad_incomplete"],
        chunks=chunks,
        style=style,
        seed=layout["seed"],
    )


@st.composite
def multi_worker_scenarios(
    draw: Any,
    *,
    max_workers: int = 4,
    max_chunks_per_worker: int = 4,
    same_time_axes: bool = False,
    consistent_states: bool = False,
) -> MultiScenario:
    """A multi-worker scenario: 1..max_workers workers, each 0..max chunks.

    Workers share P, dtypes and state-field layouts; N may differ per worker
    unless ``same_time_axes`` (then every worker has the same N, the same chunk
    lengths and the same per-chunk state-field presence, so the workers' chunks
    can also be glued along the env axis into one wide single-worker run).
    """
    layout = draw(_layout(False, False))
    if consistent_states:
        layout = _consistent(layout)
    rng = np.random.default_rng(layout["seed"])
    n_workers = draw(st.integers(1, max_workers))
    workers = []
    if same_time_axes:
        n_envs = draw(st.integers(1, 3))
        lengths = draw(st.lists(_chunk_len, min_size=1, max_size=max_chunks_per_worker))
        if layout["presence"] != "always":
            layout = {**layout, "presence": "always"}
        for _ in range(n_workers):
            workers.append(_draw_chunks(draw, layout, rng, n_envs, lengths))
    else:
        for _ in range(n_workers):
            n_envs = draw(st.integers(1, 4))
            lengths = draw(st.lists(_chunk_len, max_size=max_chunks_per_worker))
            workers.append(_draw_chunks(draw, layout, rng, n_envs, lengths))
    slots = [w for w, chunks in enumerate(workers) for _ in chunks]
    order = tuple(draw(st.permutations(slots)))
    state_fields = layout["state_fields"]
    return MultiScenario(
        max_episodes=layout["max_episodes"],
        record_states=layout["record_states"],
        state_fields=(
            ("player_positions", "player_inventory") if state_fields is None else state_fields
        ),
        pad_incomplete=layout["pad_incomplete"],
        workers=tuple(workers),
        order=order,
        style=draw(st.sampled_from(("attribute", "mapping"))),
        seed=layout["seed"],
    )


# A store episode's step: two cell-key values and a reward, drawn from few values so that
# episodes share cells and tie on return and step (the store's tie-breaks get exercised).
store_step_st = st.tuples(
    st.integers(-2, 2), st.integers(-3, 3), st.sampled_from([-1.0, -0.0, 0.0, 0.5, 1.0])
)
