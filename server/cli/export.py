"""`rollout-recorder export`: a session's finished episodes, read from a running server
without joining the session, written as Parquet files in the dataset layout (what
``serve --dataset-uri`` writes) or as a Minari dataset.

Progress (episodes and bytes) goes to stderr on one updated line; the summary to stdout.
Exit status 0 on success, 2 with one line on stderr otherwise (unreachable, unknown session,
no episodes, bad space spec, minari not installed, files already there).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from .common import Credentials, add_flags

_COMMAND = "export"


def _error(message: str) -> int:
    print(f"rollout-recorder {_COMMAND}: {message}", file=sys.stderr)
    return 2


class _ProgressLine:
    """``\\r``-updated progress on stderr, ended with a newline by ``done``."""

    def __init__(self, session: str, total: int) -> None:
        self.session, self.total, self.shown = session, total, False

    def __call__(self, episodes: int, written: int) -> None:
        self.shown = True
        size = f"{written / 1e6:.1f} MB" if written >= 1e5 else f"{written / 1e3:.1f} kB"
        print(
            f"\rexport {self.session!r}: {episodes}/{self.total} episodes, {size}",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def done(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)


def _observation_specs(given: list[str]) -> tuple[str | None, dict[str, str]]:
    """--observation-space values: one bare SPEC (every field) and/or FIELD=SPEC entries."""
    from ..dataset import spaces

    default: str | None = None
    per_field: dict[str, str] = {}
    for text in given:
        field, sep, spec = text.rpartition("=")
        spaces.parse_spec(spec, f"--observation-space {text!r}")
        if sep:
            per_field[field] = spec
        elif default is not None:
            raise ValueError(
                f"--observation-space: expected one SPEC for every field, got {default!r} "
                f"and {spec!r} (use FIELD=SPEC for one field)"
            )
        else:
            default = spec
    return default, per_field


def cmd_export(args: argparse.Namespace) -> int:
    import recorder_client

    from ..dataset import export, spaces
    from ..dataset.sink import check_node_id

    minari = args.format == "minari"
    try:
        credentials = Credentials.from_args(args)
        if not minari:
            for flag, value in (
                ("--dataset-id", args.dataset_id),
                ("--action-space", args.action_space),
                ("--observation-space", args.observation_space),
            ):
                if value:
                    raise ValueError(f"{flag}: only with --format minari")
            check_node_id(args.node_id)
        else:
            if args.node_id != "export":
                raise ValueError("--node-id: only with --format parquet")
            if args.action_space is not None:
                spaces.parse_spec(args.action_space, "--action-space")
            default, per_field = _observation_specs(args.observation_space)
            export.require_minari()  # before the download, which may be long
        trajectory = recorder_client.fetch_episodes(
            args.target,
            args.session,
            pad_incomplete=False,
            timeout=args.timeout,
            on_data_loss=args.on_data_loss,
            **credentials.client_kwargs(),
        )
        progress = _ProgressLine(args.session, trajectory.num_episodes)
        try:
            if minari:
                observation: Any = default
                if per_field:  # a field not recorded stays in, for the error naming it
                    observed = export.observation_names(trajectory)
                    observation = dict.fromkeys(observed, default) | per_field
                dataset_id = args.dataset_id or default_dataset_id(args.session)
                export.write_minari(
                    trajectory,
                    args.to,
                    dataset_id,
                    action_space=args.action_space,
                    observation_space=observation,
                    progress=progress,
                )
                where = f"Minari dataset {dataset_id!r} under {args.to}"
            else:
                export.write_parquet(
                    trajectory, args.to, session=args.session, node=args.node_id, progress=progress
                )
                where = args.to
        finally:
            progress.done()
    except (recorder_client.RecorderError, ValueError, ImportError, OSError) as exc:
        return _error(str(exc))
    steps = int(trajectory.lengths.sum())
    print(
        f"exported {trajectory.num_episodes} episodes ({steps} steps) of session "
        f"{args.session!r} to {where}"
    )
    return 0


def default_dataset_id(session: str) -> str:
    """``rollout-recorder/SESSION-v0``, with characters Minari ids refuse as ``_``."""
    return f"rollout-recorder/{re.sub(r'[^-_0-9A-Za-z]', '_', session)}-v0"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `export` to the CLI's subparsers."""
    from ..dataset.spaces import SPEC_HELP

    parser = sub.add_parser(
        "export",
        help="write a session's finished episodes to Parquet or a Minari dataset",
        description="Read a session's finished episodes from a running server (without "
        "joining it) and write them as Parquet files in the layout serve --dataset-uri "
        "writes, or as a Minari dataset (pip install 'rollout-recorder[minari]'). Minari "
        "observations are the recorded observations (obs fields, rebuilt into Dict/Tuple "
        "spaces), else the state fields (a Dict when several; the step index when none); "
        "each episode's final observation is its recorded final_obs, else its last one "
        "repeated.",
    )
    parser.add_argument("--target", required=True, help="HOST:PORT or unix:PATH")
    parser.add_argument("--session", required=True, help="the session's name")
    parser.add_argument(
        "--to",
        required=True,
        metavar="URI",
        help="parquet: the dataset's URI (a path, file://, s3://...); minari: the Minari root "
        "directory (what MINARI_DATASETS_PATH names when loading)",
    )
    parser.add_argument(
        "--format", choices=("parquet", "minari"), default="parquet", help="default parquet"
    )
    parser.add_argument(
        "--dataset-id",
        metavar="ID",
        help="minari: the dataset id; default rollout-recorder/SESSION-v0",
    )
    parser.add_argument(
        "--action-space",
        metavar="SPEC",
        help="minari: the action space instead of the derived one (Discrete for scalar "
        f"integer actions, else a Box over the dtype's range); SPEC: {SPEC_HELP}",
    )
    parser.add_argument(
        "--observation-space",
        metavar="[FIELD=]SPEC",
        action="append",
        default=[],
        help="minari: the space of every observed field (obs fields, else state fields), or "
        "of FIELD only, e.g. obs.pos=box (repeat the flag for several); SPEC as for "
        "--action-space",
    )
    parser.add_argument(
        "--node-id",
        default="export",
        metavar="ID",
        help="parquet: the node id in episode ids and file names; default %(default)s",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to connect and download the episodes; default %(default)s",
    )
    parser.add_argument(
        "--on-data-loss",
        choices=("raise", "continue"),
        default="raise",
        help="when some acknowledged chunk was found not to decode (its frames read as "
        "zeros): raise stops with an error naming it, continue exports with a warning; "
        "default %(default)s",
    )
    add_flags(parser)
    parser.set_defaults(func=cmd_export)


__all__ = ["add_parser", "default_dataset_id"]
