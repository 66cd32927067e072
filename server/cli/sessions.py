"""`rollout-recorder sessions list|drop`: see a server's sessions, drop one.

Dropping frees the session's memory, its write-ahead log records and checkpoint entries, and
its room under ``serve --max-sessions``, at once. Exit status 0 on success, 1 with one line on
stderr otherwise (unreachable, refused, unknown session).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .common import Credentials, add_flags, fail

# (heading, key, format) of the table's columns; bytes are shown in MB (1e6).
_COLUMNS = (
    ("session", "name", "{}"),
    ("workers", "workers", "{:d}"),
    ("episodes", "episodes", "{:d}"),
    ("raw MB", "raw_bytes", "{:.1f}"),
    ("wire MB", "wire_bytes", "{:.1f}"),
    ("idle s", "idle_seconds", "{:.0f}"),
)
_MB_KEYS = ("raw_bytes", "wire_bytes")


def render(sessions: Sequence[Mapping[str, Any]]) -> str:
    """An aligned table: the name left, the numbers right; a line when there is none."""
    if not sessions:
        return "no sessions"
    rows = [[heading for heading, _, _ in _COLUMNS]]
    for s in sorted(sessions, key=lambda s: s["name"]):
        rows.append(
            [fmt.format(s[key] / 1e6 if key in _MB_KEYS else s[key]) for _, key, fmt in _COLUMNS]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> int:
    import recorder_client

    try:
        credentials = Credentials.from_args(args)
        sessions = recorder_client.list_sessions(
            args.target, timeout=args.timeout, **credentials.client_kwargs()
        )
    except (recorder_client.RecorderError, ValueError) as exc:
        return fail("sessions list", str(exc))
    if args.json:
        print(json.dumps(list(sessions), indent=2, sort_keys=True))
    else:
        print(render(sessions))
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    import recorder_client

    try:
        credentials = Credentials.from_args(args)
        recorder_client.drop_session(
            args.target, args.name, timeout=args.timeout, **credentials.client_kwargs()
        )
    except (recorder_client.RecorderError, ValueError) as exc:
        return fail("sessions drop", str(exc))
    print(f"dropped session {args.name!r} on {args.target}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `sessions list` and `sessions drop` to the CLI's subparsers."""
    sessions = sub.add_parser(
        "sessions",
        help="list a server's sessions, or drop one",
        description="List the sessions a server holds, or drop one (its memory, log records "
        "and checkpoint entries, durably).",
    )
    verbs = sessions.add_subparsers(dest="verb", required=True, metavar="{list,drop}")
    listing = verbs.add_parser("list", help="one line per session (or JSON)")
    listing.add_argument("--json", action="store_true", help="print a JSON list instead")
    listing.set_defaults(func=cmd_list)
    drop = verbs.add_parser("drop", help="drop one session")
    drop.add_argument("name", help="the session's name")
    drop.set_defaults(func=cmd_drop)
    for parser in (listing, drop):
        parser.add_argument("--target", required=True, help="HOST:PORT or unix:PATH")
        parser.add_argument(
            "--timeout", type=float, default=10.0, help="seconds; default %(default)s"
        )
        add_flags(parser)


__all__ = ["add_parser", "render"]
