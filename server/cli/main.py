"""The `rollout-recorder` command line: serve, status, health, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import demo, health, serve, status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-recorder", description="Out-of-process rollout recorder for RL training."
    )
    parser.add_argument("--log-level", default=os.environ.get("ROLLOUT_RECORDER_LOG", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    demo.add_parsers(sub)
    health.add_parser(sub)
    status.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
