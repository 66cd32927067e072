"""Load factoriax's real in-process recorder without importing jax.

``factoriax/analysis/__init__.py`` imports jax and matplotlib, so the usual
``import factoriax.analysis.recorder`` fails where only ``pip install --no-deps
factoriax==0.1.0 orjson`` was done.  This module loads the two files that the
recorder needs, ``analysis/trajectory.py`` and ``analysis/recorder.py``, with
``importlib.util.spec_from_file_location`` under a synthetic package name
(:data:`SYNTHETIC_PACKAGE`), so ``recorder.py``'s ``from .trajectory import``
resolves to the module loaded here and no factoriax ``__init__`` ever runs.

``importlib.util.find_spec("factoriax")`` only locates the top-level package
(it executes nothing for a name without dots), so it is safe to use; the
distribution metadata is the fallback.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

SYNTHETIC_PACKAGE = "_factoriax_reference_analysis"


def factoriax_analysis_dir() -> Path | None:
    """The installed ``factoriax/analysis`` directory, or None when not installed."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("factoriax")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) for p in spec.submodule_search_locations)
    try:
        dist = importlib.metadata.distribution("factoriax")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        candidates.append(Path(str(dist.locate_file("factoriax"))))
    for pkg_dir in candidates:
        analysis = pkg_dir / "analysis"
        if (analysis / "recorder.py").is_file() and (analysis / "trajectory.py").is_file():
            return analysis
    return None


def _load(name: str, path: Path) -> types.ModuleType:
    full_name = f"{SYNTHETIC_PACKAGE}.{name}"
    spec = importlib.util.spec_from_file_location(full_name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[full_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full_name]
        raise
    return module


@functools.cache
def load_factoriax_modules() -> tuple[types.ModuleType, types.ModuleType] | None:
    """``(recorder_module, trajectory_module)``, or None when factoriax is not installed."""
    analysis = factoriax_analysis_dir()
    if analysis is None:
        return None
    package = sys.modules.get(SYNTHETIC_PACKAGE)
    if package is None:
        package = types.ModuleType(SYNTHETIC_PACKAGE)
        package.__path__ = []  # a package, but one that finds no submodule by itself
        package.__package__ = SYNTHETIC_PACKAGE
        sys.modules[SYNTHETIC_PACKAGE] = package
    trajectory = _load("trajectory", analysis / "trajectory.py")
    recorder = _load("recorder", analysis / "recorder.py")
    return recorder, trajectory


def load_factoriax_recorder() -> tuple[type, type] | None:
    """``(RolloutRecorder, Trajectory)`` from factoriax, or None when it is not installed."""
    modules = load_factoriax_modules()
    if modules is None:
        return None
    recorder, trajectory = modules
    return recorder.RolloutRecorder, trajectory.Trajectory


def factoriax_state_fields() -> frozenset[str] | None:
    """Env-state names whose recording factoriax's ``Trajectory`` accepts.

    Every name in ``_OPTIONAL_ARRAY_FIELDS`` except ``rewards`` (which collides
    with the recorder's own ``rewards=`` keyword), plus the env-state spellings
    ``player_positions`` and ``map``.
    """
    modules = load_factoriax_modules()
    if modules is None:
        return None
    traj = modules[1]
    names = set(traj._OPTIONAL_ARRAY_FIELDS) - {"rewards"}
    names |= {traj._TRAJ_TO_STATE.get(n, n) for n in names}
    return frozenset(names)


def trajectory_arrays(traj: Any) -> dict[str, np.ndarray]:
    """The non-None array fields of a factoriax ``Trajectory``, by trajectory name."""
    modules = load_factoriax_modules()
    assert modules is not None
    out = {"actions": traj.actions}
    for name in modules[1]._OPTIONAL_ARRAY_FIELDS:
        value = getattr(traj, name)
        if value is not None:
            out[name] = value
    return out
