"""The `rollout-recorder` command line: serve, status, health, sessions, export, store, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import metadata

from ..extras import MissingExtraError
from . import demo, export, health, serve, sessions, status, store, upgrade

LOG_ENV = "ROLLOUT_RECORDER_LOG"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def version() -> str:
    """The installed distribution's version, else the client package's ``__version__``."""
    try:
        return metadata.version("rollout-recorder")
    except metadata.PackageNotFoundError:
        from recorder_client import __version__

        return __version__


def log_level(value: str) -> str:
    """A --log-level value, any case, as the upper-case level name."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(LOG_LEVELS)} (any case), got {value!r}"
        )
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-recorder", description="Out-of-process rollout recorder for RL training."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=None,
        metavar="LEVEL",
        help=f"log level, one of {', '.join(LOG_LEVELS)} (any case); default ${LOG_ENV}, "
        "else WARNING",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    demo.add_parsers(sub)
    health.add_parser(sub)
    status.add_parser(sub)
    sessions.add_parser(sub)
    export.add_parser(sub)
    store.add_parser(sub)
    upgrade.add_parser(sub)
    return parser


def _log_level(parser: argparse.ArgumentParser, given: str | None) -> str:
    if given is not None:
        return given
    value = os.environ.get(LOG_ENV, "")
    if not value.strip():
        return "WARNING"
    try:
        return log_level(value)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"${LOG_ENV}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=_log_level(parser, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except MissingExtraError as exc:  # a feature asked for needs the server extra
        print(f"rollout-recorder {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
