"""`rollout-recorder status`: a live view of a running server (or one snapshot).

Per session: its counters (steps are env steps, T x N), a table of its workers (lag, ack latency, drops, losses) and, for a
session with a trajectory store, a small text heatmap of the archive's visits over its first
two cell-key fields. ``--json`` prints one snapshot with snake_case keys and every number as a
JSON number, zeros included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import grpc
import numpy as np

from recorder_client._messages import array_from_proto, session_status
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_client.errors import handshake_hint

from .common import Credentials, add_flags, fail

# Shades of the heatmap, from few visits to many (log scale); a blank is an unvisited cell.
_SHADES = ".:-=+*#%@"
# The heatmap's most rows and columns (a wider archive is shown in buckets of cells).
_MAP_SIZE = 24


def fetch(
    target: str, timeout: float, credentials: Credentials | None = None
) -> tuple[pb.MetricsReply, dict[str, pb.ArchiveReply]]:
    """One GetMetrics reply and the archive of each session with a store. A server that cannot
    be reached fails the call at once (UNAVAILABLE, with the reason: refused, or a TLS
    handshake that failed), not after `timeout` s."""
    with (credentials or Credentials()).channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        reply = stub.GetMetrics(pb.MetricsRequest(), timeout=timeout)
        archives = {}
        for s in reply.sessions:
            if s.config.capture_config_json:
                request = pb.ArchiveRequest(session=s.session)
                try:
                    archives[s.session] = stub.GetArchive(request, timeout=timeout)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:  # dropped meanwhile
                        raise
        return reply, archives


def heatmap(archive: pb.ArchiveReply, size: int = _MAP_SIZE) -> list[str]:
    """Visits over the first two cell-key fields as text: one character per (bucket of)
    cells, darker for more visits (log scale), blank where no cell was visited."""
    columns = {c.name: array_from_proto(c.array, c.name) for c in archive.columns}
    names = list(archive.key_names)
    visits = columns.get("visits")
    if visits is None or not visits.size or not names:
        return ["  (empty archive)"]
    x = columns[f"cell:{names[0]}"]
    y = columns[f"cell:{names[1]}"] if len(names) > 1 else np.zeros_like(x)
    ylabel = names[1] if len(names) > 1 else "-"
    bx = max(1, math.ceil((int(x.max()) - int(x.min()) + 1) / size))
    by = max(1, math.ceil((int(y.max()) - int(y.min()) + 1) / size))
    col, row = (x - x.min()) // bx, (y - y.min()) // by
    grid = np.zeros((int(row.max()) + 1, int(col.max()) + 1), dtype=np.float64)
    np.add.at(grid, (row, col), visits)
    top = math.log1p(grid.max())
    lines = [
        f"  archive: {visits.size} cells over {names[0]} (x, {x.min()}..{x.max()}) and "
        f"{ylabel} (y, {y.min()}..{y.max()}); shades {_SHADES!r} by visits, up to "
        f"{int(grid.max())}" + (f"; {bx}x{by} cells a character" if bx * by > 1 else "")
    ]
    for r in range(grid.shape[0]):
        chars = [
            " "
            if v == 0
            else _SHADES[min(len(_SHADES) - 1, int(math.log1p(v) / top * len(_SHADES)))]
            for v in grid[r]
        ]
        lines.append("  |" + "".join(chars) + "|")
    return lines


def as_json(reply: pb.MetricsReply, archives: dict[str, pb.ArchiveReply]) -> dict:
    """The snapshot as plain JSON: snake_case keys, numbers as numbers, zeros included."""
    sessions = []
    for s in reply.sessions:
        entry = dataclasses.asdict(session_status(s))
        entry["state_fields"] = list(entry["state_fields"])
        entry["env_steps"] = sum(w.steps * w.num_envs for w in s.workers)  # T x N
        entry["store"] = bool(s.config.capture_config_json)
        archive = archives.get(s.session)
        if archive is not None:
            visits = next((c for c in archive.columns if c.name == "visits"), None)
            entry["archive_cells"] = int(visits.array.shape[0]) if visits is not None else 0
        sessions.append(entry)
    return {
        "uptime_s": reply.uptime_s,
        "sessions": sessions,
        "values": {k: reply.values[k] for k in sorted(reply.values)},
    }


def _labelled(values: dict[str, float], prefix: str, session: str) -> dict[str, float]:
    """{worker: value} of a tag labelled session=..., worker=...."""
    out = {}
    head = f"{prefix}/session={session}/worker="
    for key, value in values.items():
        if key.startswith(head):
            out[key[len(head) :]] = value
    return out


def render(
    reply: pb.MetricsReply,
    previous: pb.MetricsReply | None,
    dt: float,
    archives: dict[str, pb.ArchiveReply] | None = None,
) -> str:
    values = dict(reply.values)
    before = {s.session: s for s in previous.sessions} if previous else {}
    lines = [f"rollout-recorder: {len(reply.sessions)} sessions, up {reply.uptime_s:,.0f} s"]
    header = (
        f"{'session':<16} {'workers':>7} {'chunks':>8} {'env steps':>10} {'episodes':>9} "
        f"{'raw MB':>9} {'wire MB':>8} {'ratio':>6} {'MB/s':>7} {'full':>5} {'cells':>7} "
        f"{'store MB':>8}"
    )
    lines += [header, "-" * len(header)]
    for s in reply.sessions:
        old = before.get(s.session)
        rate = (s.raw_bytes - old.raw_bytes) / 1e6 / dt if old and dt > 0 else 0.0
        cells = values.get(f"Trajectories/archive_cells/session={s.session}", 0.0)
        store = values.get(f"Trajectories/repository_bytes/session={s.session}", 0.0)
        ratio = s.raw_bytes / s.wire_bytes if s.wire_bytes else 0.0
        lines.append(
            f"{s.session:<16} {len(s.workers):>7} {s.chunks_stored:>8} "
            f"{sum(w.steps * w.num_envs for w in s.workers):>10} {s.episodes_finished:>9} "
            f"{s.raw_bytes / 1e6:>9.1f} "
            f"{s.wire_bytes / 1e6:>8.1f} {ratio:>6.1f} {rate:>7.1f} {str(s.is_full):>5} "
            f"{cells:>7.0f} {store / 1e6:>8.2f}"
        )
        lags = _labelled(values, "Recorder/worker_lag_seconds", s.session)
        acks = _labelled(values, "Recorder/ack_latency_seconds", s.session)
        if s.workers:
            lines.append(
                f"  {'#':>3} {'worker':<28} {'chunks':>7} {'dropped':>7} {'lost':>5} "
                f"{'env steps':>9} {'episodes':>8} {'lag':>7} {'ack':>9} {'active':>6} "
                f"{'joined':>8}"
            )
        for w in s.workers:
            lag = lags.get(w.worker_id, w.idle_seconds)
            ack = acks.get(w.worker_id)
            lines.append(
                f"  {w.worker_index:>3} {w.worker_id[:28]:<28} {w.chunks_stored:>7} "
                f"{w.chunks_dropped:>7} {w.sequences_lost:>5} {w.steps * w.num_envs:>9} "
                f"{w.episodes_finished:>8} {f'{lag:.1f}s':>7} "
                f"{'-' if ack is None else f'{ack * 1e3:.1f}ms':>9} {str(w.active):>6} "
                f"{_clock(w.joined_unix):>8}"
            )
        if archives and s.session in archives:
            lines += heatmap(archives[s.session])
    return "\n".join(lines)


def _clock(unix: float) -> str:
    """A wall-clock time of day (local), or '-' when unknown."""
    return time.strftime("%H:%M:%S", time.localtime(unix)) if unix else "-"


def status_main(args: argparse.Namespace) -> int:
    try:
        credentials = Credentials.from_args(args)
        reply, archives = fetch(args.target, args.timeout, credentials)
    except ValueError as exc:
        return fail("status", str(exc))
    except grpc.RpcError as err:
        details = err.details() or ""
        return fail(
            "status", f"{args.target}: {err.code().name}: {details}{handshake_hint(details)}"
        )
    if args.json:
        print(json.dumps(as_json(reply, archives), indent=2, sort_keys=True))
        return 0
    if args.once:
        print(render(reply, None, 0.0, archives))
        return 0
    previous, last = reply, time.monotonic()
    try:
        while True:
            time.sleep(args.interval)
            reply, archives = fetch(args.target, args.timeout, credentials)
            now = time.monotonic()
            view = render(reply, previous, now - last, archives)
            sys.stdout.write("\x1b[2J\x1b[H" + view + "\n")
            sys.stdout.flush()
            previous, last = reply, now
    except KeyboardInterrupt:
        return 0
    except grpc.RpcError as err:
        return fail("status", f"lost {args.target}: {err.details()}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="show a running server's sessions and rates")
    status.add_argument("--target", required=True, help="HOST:PORT or unix:PATH")
    status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    status.add_argument("--json", action="store_true", help="print one snapshot as JSON")
    status.add_argument("--interval", type=float, default=2.0, help="refresh seconds")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    add_flags(status, channel=True)
    status.set_defaults(func=status_main)
