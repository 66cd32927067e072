"""`rollout-recorder upgrade --data-dir D`: convert a data directory written by an earlier
format version in place, atomically and after a backup (server/durability/upgrade.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..durability.upgrade import UpgradeError, inspect, upgrade


def cmd_upgrade(args: argparse.Namespace) -> int:
    root = Path(args.data_dir)
    if args.check:
        versions = inspect(root)
        for line in versions.lines():
            print(line)
        print("current" if versions.current else "an upgrade would convert it")
        return 0 if versions.current else 1
    try:
        report = upgrade(root)
    except (UpgradeError, OSError) as exc:
        print(f"rollout-recorder upgrade: {exc}", file=sys.stderr)
        return 1
    for line in report.before.lines():
        print(f"before: {line}")
    if report.after is None:
        print(f"{root}: every file is in the current format; nothing to do")
        return 0
    print(f"backup: {report.backup}")
    for line in report.recovery:
        print(f"recovery: {line}")
    for line in report.after.lines():
        print(f"after: {line}")
    print(f"upgraded {root}: the whole state is in {report.checkpoint}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `upgrade` subcommand to the CLI's subparsers."""
    parser = sub.add_parser(
        "upgrade",
        help="convert a data directory written by an earlier version, in place",
        description="Load a data directory written by an earlier format version (the server "
        "reads the previous one as is), copy its files to backup-<UTC time>/ inside it, then "
        "write its whole state as a checkpoint in the current format and remove the older "
        "checkpoints and the log. Each file is replaced atomically; stop the server first.",
    )
    parser.add_argument("--data-dir", required=True, help="the server's --data-dir")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only print the versions found; exit 0 when all are current, 1 otherwise",
    )
    parser.set_defaults(func=cmd_upgrade)
    return parser


__all__ = ["add_parser"]
