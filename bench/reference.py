"""The in-process reference recorder (factoriax 0.1.0), loaded without jax.

Goes through tests/factoriax_reference.py, which loads factoriax's
`analysis/recorder.py` and `analysis/trajectory.py` by file path; never
`import factoriax.analysis` (its __init__ imports jax).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


def _module() -> Any:
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    import factoriax_reference

    return factoriax_reference


def load_reference_recorder() -> tuple[type, type]:
    """(RolloutRecorder, Trajectory) from factoriax; raises when it is not installed."""
    loaded = _module().load_factoriax_recorder()
    if loaded is None:
        raise RuntimeError(
            "factoriax is not installed: pip install --no-deps factoriax==0.1.0 orjson"
        )
    return loaded


def reference_arrays(traj: Any) -> dict[str, Any]:
    """The non-None array fields of a factoriax Trajectory, by trajectory name."""
    return _module().trajectory_arrays(traj)
