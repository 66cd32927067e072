"""Env-state field names -> trajectory field names (the in-process recorder's rule)."""

from __future__ import annotations

# Only the names that differ; every other name passes through unchanged.
STATE_TO_TRAJECTORY: dict[str, str] = {
    "player_positions": "positions",
    "map": "block_map",
}

# Names a Trajectory already uses for its own arrays; a state field may not take them.
RESERVED_NAMES = frozenset(
    {
        "actions",
        "rewards",
        "lengths",
        "episode_worker",
        "episode_env",
        "episode_start",
        "episode_done",
        "worker_ids",
    }
)


def trajectory_name(state_field: str) -> str:
    return STATE_TO_TRAJECTORY.get(state_field, state_field)


def check_state_fields(state_fields: list[str] | tuple[str, ...]) -> list[str]:
    """Validate a state_fields list; returns it as a list of str."""
    if isinstance(state_fields, str):
        raise ValueError(f"state_fields: expected a list of names, got the string {state_fields!r}")
    fields = list(state_fields)
    seen: dict[str, str] = {}
    for name in fields:
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 128:
            raise ValueError(
                f"state_fields: expected non-empty printable names of at most 128 characters, "
                f"got {name!r}"
            )
        traj = trajectory_name(name)
        if traj in RESERVED_NAMES:
            raise ValueError(
                f"state_fields: {name!r} maps to the trajectory name {traj!r}, which is reserved"
            )
        if traj in seen:
            raise ValueError(
                f"state_fields: {name!r} and {seen[traj]!r} both map to trajectory name {traj!r}"
            )
        seen[traj] = name
    return fields
