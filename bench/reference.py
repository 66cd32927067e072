"""The in-process reference recorder: factoriax's own `RolloutRecorder` (factoriax 0.1.0).

`factoriax.analysis`'s `__init__` imports jax and matplotlib, which the Makefile does not
install (`pip install --no-deps factoriax==0.1.0`; the recorder needs only numpy and orjson).
So the bench registers `factoriax.analysis` as a bare package, with factoriax's own
directory as its path and without running its `__init__`, and then imports
`factoriax.analysis.recorder` and `.trajectory` by their real names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

import numpy as np

_ANALYSIS = "factoriax.analysis"


def _analysis_module(name: str) -> Any:
    if _ANALYSIS not in sys.modules:
        spec = importlib.util.find_spec("factoriax")  # factoriax/__init__ imports nothing
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                "factoriax is not installed: pip install --no-deps factoriax==0.1.0 orjson"
            )
        package = types.ModuleType(_ANALYSIS)
        package.__path__ = [f"{p}/analysis" for p in spec.submodule_search_locations]
        package.__package__ = _ANALYSIS
        importlib.import_module("factoriax")
        sys.modules[_ANALYSIS] = package
    return importlib.import_module(f"{_ANALYSIS}.{name}")


def load_reference_recorder() -> tuple[type, type]:
    """(RolloutRecorder, Trajectory) from factoriax; raises when it is not installed."""
    return (
        _analysis_module("recorder").RolloutRecorder,
        _analysis_module("trajectory").Trajectory,
    )


def reference_arrays(traj: Any) -> dict[str, np.ndarray]:
    """The non-None array fields of a factoriax Trajectory, by trajectory name."""
    fields = _analysis_module("trajectory")._OPTIONAL_ARRAY_FIELDS
    out = {"actions": traj.actions}
    out.update({name: getattr(traj, name) for name in fields if getattr(traj, name) is not None})
    return out
