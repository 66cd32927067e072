"""`rollout-recorder store merge`: merge trajectory-store checkpoints from several sidecars.

Writes the merged checkpoint atomically and prints one summary line. Exit status 0 on success,
2 with one line on stderr for unreadable, malformed or incompatible inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..durability.files import atomic_write
from ..store.merge import encode_checkpoint_file, merge_checkpoints

_DEFAULT_LABEL = "-"


def cmd_merge(args: argparse.Namespace) -> int:
    sources = None
    if args.source is not None:
        sources = [None if s == _DEFAULT_LABEL else s for s in args.source]
    try:
        state = merge_checkpoints(args.checkpoints, sources=sources)
        atomic_write(Path(args.output), encode_checkpoint_file(state, args.compress))
    except (OSError, ValueError) as exc:
        print(f"rollout-recorder store merge: {exc}", file=sys.stderr)
        return 2
    arrays = state["arrays"]
    names = [s["name"] for s in state["merge"]["sources"]]
    print(
        f"merged {len(args.checkpoints)} checkpoints into {args.output}: "
        f"{arrays['archive/keys'].shape[0]} cells, {int(arrays['archive/visits'].sum())} visits, "
        f"{arrays['repository/ids'].shape[0]} trajectories, "
        f"{len(names)} sources ({', '.join(names)})"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `store merge` to the CLI's subparsers."""
    store = sub.add_parser(
        "store",
        help="work with trajectory-store checkpoints",
        description="Work with trajectory-store checkpoint files.",
    )
    verbs = store.add_subparsers(dest="verb", required=True, metavar="{merge}")
    merge = verbs.add_parser(
        "merge",
        help="merge the checkpoints of several stores into one",
        description="Merge trajectory-store checkpoints (one per sidecar) into the checkpoint "
        "of the archive one store fed every episode would hold: cells unite, visits and "
        "utility sums add, the best reference per cell wins by return, then length. See "
        "docs/store-merge.md.",
    )
    merge.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="input files")
    merge.add_argument("-o", "--output", required=True, metavar="OUT", help="the merged file")
    merge.add_argument(
        "--source",
        action="append",
        metavar="NAME",
        help="label of each input's store, once per input in order (default: the paths as given); "
        f"'{_DEFAULT_LABEL}' keeps the default, and must be given for an input that is "
        "itself a merge (its labels are kept)",
    )
    merge.add_argument(
        "--compress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compress the store payload inside the checkpoint frame (default), or not",
    )
    merge.set_defaults(func=cmd_merge)


__all__ = ["add_parser"]
