"""record()'s arguments as the chunk's arrays, keyed as the wire keys them.

``action``, ``reward``, ``done`` (the OR of ``terminated`` and ``truncated`` when only they
are given), ``terminated``, ``truncated``, ``valid``, ``outcome``, ``state:<name>`` (env
state fields, and the observation fields ``obs``, ``obs.<key>``, ...) and ``final:<name>``
(the final observation, same names). Host arrays are referenced; a device array's copy to
the host is started here, and read by the sender thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _torch
from ._checks import check_kept_tensors
from ._obs import flatten
from .errors import InvalidChunkError


def take(value: Any, what: str = "trajectories", defer: bool = True) -> Any:
    """A reference to a host array, or a device array whose host copy has started. ``what``
    names the field in the error for a value that is no array. A CPU tensor is held for
    the sender to read (``defer``), or read at once for record() to check its values."""
    if isinstance(value, np.ndarray):
        return value
    if _torch.is_tensor(value):
        return _torch.take(value, what, defer)
    start_copy = getattr(value, "copy_to_host_async", None)
    if start_copy is not None and hasattr(value, "shape") and hasattr(value, "dtype"):
        if not _on_cpu(value):
            start_copy()
        return value
    try:
        return np.asarray(value)
    except Exception as exc:  # a ragged list, an object whose __array__ fails ...
        raise InvalidChunkError(
            f"{what}: expected a numpy array, torch tensor or JAX array, got "
            f"{type(value).__name__} ({exc})"
        ) from None


# Whether each sharding seen puts its arrays on CPU devices only (a loop's arrays share a
# few shardings, and asking their devices costs the caller a microsecond an array).
_ON_CPU: dict[Any, bool] = {}
_MAX_SHARDINGS = 64


def _on_cpu(value: Any) -> bool:
    """Whether a (JAX) device array lives on CPU devices only. Its buffer is host memory,
    which the sender thread reads in place (np.asarray is a view), so no copy is started:
    on CPU, copy_to_host_async() only cost the caller time (bench `latency_jax`: p99 from
    0.3-2.9 ms down to 75-156 us, the slow calls waiting for the GIL inside it)."""
    sharding = getattr(value, "sharding", None)
    try:
        return _ON_CPU[sharding]
    except (KeyError, TypeError):  # not seen, or not hashable
        pass
    devices = getattr(sharding, "device_set", None)
    on_cpu = bool(devices) and all(getattr(d, "platform", None) == "cpu" for d in devices)
    if len(_ON_CPU) < _MAX_SHARDINGS:
        try:
            _ON_CPU[sharding] = on_cpu
        except TypeError:
            pass
    return on_cpu


_PLAIN = frozenset({"action", "reward", "done", "outcome"})
_CONTRACT = frozenset({"terminated", "truncated", "valid", "obs", "final_obs"})
# Per class with declared fields (a NamedTuple, a dataclass): whether none is the contract's.
_CLASSES: dict[type, bool] = {}


def _without_contract(trajectories: Any) -> bool:
    """Whether ``trajectories`` surely holds none of the contract's optional names, answered
    from a dict's keys or a class's declared fields (False when unsure)."""
    kind = type(trajectories)
    if kind is dict:
        return trajectories.keys() <= _PLAIN
    known = _CLASSES.get(kind)
    if known is None:
        fields = getattr(kind, "_fields", None) or getattr(kind, "__dataclass_fields__", None)
        if fields is None or len(_CLASSES) >= 64:
            return False
        known = _CLASSES[kind] = not (set(fields) & _CONTRACT)
    return known


def add_contract(
    arrays: dict[str, Any], trajectories: Any, get: Any, observations: bool = True
) -> None:
    """Add the contract's optional arrays of ``trajectories`` to ``arrays`` (which holds
    action, reward, done when given, outcome and env state fields): terminated and
    truncated (and done as their OR when it was not given), valid, the observation fields
    and the final observation's (unless ``observations`` is False). ``get``: the mapping's
    get, or None to read attributes.
    InvalidChunkError names a field that is missing or given in a way the contract does
    not allow; shapes and values are checked later."""
    if "done" in arrays and _without_contract(trajectories):
        return  # the factoriax call: nothing more to read (record()'s p99 counts each read)
    if get is None:
        get = lambda name: getattr(trajectories, name, None)  # noqa: E731
    terminated, truncated = get("terminated"), get("truncated")
    valid = get("valid")
    obs, final = (get("obs"), get("final_obs")) if observations else (None, None)
    if terminated is None and truncated is None and valid is None and obs is None:
        if final is None and "done" in arrays:
            return  # the factoriax call: nothing more to read
    check_kept_tensors(arrays)  # the values and shapes of action and done are read below
    if (terminated is None) != (truncated is None):
        given, missing = ("terminated", "truncated")
        if terminated is None:
            given, missing = missing, given
        raise InvalidChunkError(
            f"trajectories.{missing}: expected an array alongside trajectories.{given} "
            "(give both, or done alone), got none"
        )
    if terminated is not None:
        term = take(terminated, "trajectories.terminated", defer=False)
        trunc = take(truncated, "trajectories.truncated", defer=False)
        # Before their OR, which would fail or broadcast on other shapes and dtypes.
        _check_pair(term, trunc, arrays["action"].shape)
    if "done" not in arrays:
        if terminated is None:
            raise InvalidChunkError(
                "trajectories.done: expected an array (attribute or mapping key), or "
                "terminated and truncated, got none"
            )
        # On the caller's arrays, before any host copy: a device array's OR stays there.
        try:
            done = terminated | truncated
        except (TypeError, RuntimeError):  # lists; a tensor with an array of another kind
            done = np.logical_or(term, trunc)
        arrays["done"] = take(done, "trajectories.done")
    if terminated is not None:
        arrays["terminated"], arrays["truncated"] = term, trunc
    if valid is not None:
        arrays["valid"] = take(valid, "trajectories.valid", defer=False)
    if obs is None:
        if final is not None:
            raise InvalidChunkError(
                "trajectories.final_obs: expected it alongside trajectories.obs (the "
                "observation each action was taken from), got final_obs alone"
            )
        return
    for key in arrays:
        if key == "state:obs" or key.startswith("state:obs."):
            raise InvalidChunkError(
                f"env_states.{key[6:]}: expected observations once, in trajectories.obs, got "
                f"the state field {key[6:]!r} as well"
            )
    names = []
    for name, value in flatten(obs, "obs", "trajectories.obs"):
        arrays[f"state:{name}"] = take(value, f"trajectories.{name}")
        names.append(name)
    if final is not None:
        finals = flatten(final, "obs", "trajectories.final_obs")
        got = sorted(name for name, _ in finals)
        if got != sorted(names):  # a dict's keys in another order are the same structure
            raise InvalidChunkError(
                f"trajectories.final_obs: expected the structure of trajectories.obs "
                f"(fields {sorted(names)}), got fields {got}"
            )
        for name, value in finals:
            arrays[f"final:{name}"] = take(value, f"trajectories.final_{name}")


def _check_pair(terminated: Any, truncated: Any, action_shape: Any) -> None:
    """terminated and truncated: bool, of shape (T, N) like the action (or like each other
    when the action's own shape is wrong, which check_layout refuses)."""
    want = tuple(action_shape[:2]) if len(action_shape) in (2, 3) else None
    for name, value in (("terminated", terminated), ("truncated", truncated)):
        shape = tuple(value.shape)
        if want is None:
            want = shape if len(shape) == 2 else None
        if shape != want:
            expected = "(T, N)" if want is None else f"(T, N) = {want}"
            raise InvalidChunkError(f"trajectories.{name}: expected shape {expected}, got {shape}")
        if np.dtype(value.dtype) != np.bool_:
            raise InvalidChunkError(f"trajectories.{name}: expected dtype bool, got {value.dtype}")
