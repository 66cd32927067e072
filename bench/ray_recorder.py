"""The Ray baseline: an actor that wraps the in-process factoriax recorder.

Workers call `actor.record.remote(traj_dict, states_dict)`; Ray serialises the
arrays into its object store and the actor records them (the factoriax
recorder keeps references, exactly as in-process). The actor process imports
this module by name, so bench/ must be on the workers' PYTHONPATH (run.py sets
it before `ray.init`).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from reference import load_reference_recorder

NAMESPACE = "rollout-recorder-bench"


class FactoriaxRecorderActor:
    def __init__(self, record_states: bool, state_fields: list[str]) -> None:
        recorder_cls, _ = load_reference_recorder()
        self.recorder = recorder_cls(record_states=record_states, state_fields=list(state_fields))
        self.calls = 0

    def ping(self) -> int:
        return os.getpid()

    def record(self, traj: dict[str, Any], states: dict[str, Any] | None) -> None:
        self.recorder.record(
            SimpleNamespace(**traj), None if states is None else SimpleNamespace(**states)
        )
        self.calls += 1

    def stats(self) -> dict[str, Any]:
        from procs import proc_status

        return {
            "calls": self.calls,
            "num_recorded_steps": self.recorder.num_recorded_steps,
            "pid": os.getpid(),
            **proc_status(os.getpid()),
        }
