"""`rollout-recorder status`: a live view of a running server (or one snapshot)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from google.protobuf import json_format

from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_client.errors import handshake_hint

from .common import Credentials, add_flags, fail


def fetch(target: str, timeout: float, credentials: Credentials | None = None) -> pb.MetricsReply:
    """One GetMetrics reply. A server that cannot be reached fails the call at once (UNAVAILABLE,
    with the reason: refused, or a TLS handshake that failed), not after `timeout` s."""
    with (credentials or Credentials()).channel(target) as channel:
        stub = pb_grpc.RecorderStub(channel)
        return stub.GetMetrics(pb.MetricsRequest(), timeout=timeout)


def _labelled(values: dict[str, float], prefix: str, session: str) -> dict[str, float]:
    """{worker: value} of a tag labelled session=..., worker=...."""
    out = {}
    head = f"{prefix}/session={session}/worker="
    for key, value in values.items():
        if key.startswith(head):
            out[key[len(head) :]] = value
    return out


def render(reply: pb.MetricsReply, previous: pb.MetricsReply | None, dt: float) -> str:
    values = dict(reply.values)
    before = {s.session: s for s in previous.sessions} if previous else {}
    lines = [f"rollout-recorder: {len(reply.sessions)} sessions, up {reply.uptime_s:,.0f} s"]
    header = (
        f"{'session':<16} {'workers':>7} {'chunks':>8} {'steps':>10} {'episodes':>9} "
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
            f"{s.num_recorded_steps:>10} {s.episodes_finished:>9} {s.raw_bytes / 1e6:>9.1f} "
            f"{s.wire_bytes / 1e6:>8.1f} {ratio:>6.1f} {rate:>7.1f} {str(s.is_full):>5} "
            f"{cells:>7.0f} {store / 1e6:>8.2f}"
        )
        lags = _labelled(values, "Recorder/worker_lag_seconds", s.session)
        acks = _labelled(values, "Recorder/ack_latency_seconds", s.session)
        for w in s.workers:
            lag = lags.get(w.worker_id)
            ack = acks.get(w.worker_id)
            lines.append(
                f"  {w.worker_index:>3} {w.worker_id:<28} chunks {w.chunks_stored:>6} "
                f"dropped {w.chunks_dropped:>4} steps {w.steps:>8} episodes "
                f"{w.episodes_finished:>6} lag {'-' if lag is None else f'{lag:.1f}s':>6} "
                f"ack {'-' if ack is None else f'{ack * 1e3:.1f}ms':>8}"
            )
    return "\n".join(lines)


def status_main(args: argparse.Namespace) -> int:
    try:
        credentials = Credentials.from_args(args)
        reply = fetch(args.target, args.timeout, credentials)
    except ValueError as exc:
        return fail("status", str(exc))
    except grpc.RpcError as err:
        details = err.details() or ""
        return fail(
            "status", f"{args.target}: {err.code().name}: {details}{handshake_hint(details)}"
        )
    if args.json:
        print(json.dumps(json_format.MessageToDict(reply), indent=2, sort_keys=True))
        return 0
    if args.once:
        print(render(reply, None, 0.0))
        return 0
    previous, last = reply, time.monotonic()
    try:
        while True:
            time.sleep(args.interval)
            reply = fetch(args.target, args.timeout, credentials)
            now = time.monotonic()
            sys.stdout.write("\x1b[2J\x1b[H" + render(reply, previous, now - last) + "\n")
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
