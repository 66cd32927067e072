"""Sessions as server resources: list them, read one's episodes, drop one (no recorder
needed)."""

from __future__ import annotations

from typing import Any

from ._connection import Connection
from ._credentials import PemSource
from ._finish import assemble, checked, raises_on_loss
from ._proto import recorder_pb2 as pb
from .trajectory import Trajectory


def _connection(
    target: str,
    token: str | None,
    root_certificates: PemSource,
    client_certificate: PemSource,
    client_key: PemSource,
    timeout: float,
) -> Connection:
    return Connection(
        target,
        token=token,
        root_certificates=root_certificates,
        client_certificate=client_certificate,
        client_key=client_key,
        rpc_timeout=timeout,
        connect_timeout=timeout,
    )


def list_sessions(
    target: str,
    token: str | None = None,
    *,
    root_certificates: PemSource = None,
    client_certificate: PemSource = None,
    client_key: PemSource = None,
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    """Every session the server holds, by name: ``name``, ``workers`` (active ones),
    ``episodes``, ``num_recorded_steps``, ``raw_bytes``, ``wire_bytes``, ``idle_seconds``
    and ``is_full``."""
    connection = _connection(
        target, token, root_certificates, client_certificate, client_key, timeout
    )
    try:
        reply = connection.call("ListSessions", pb.ListSessionsRequest())
    finally:
        connection.close()
    return [
        {
            "name": s.name,
            "workers": s.workers,
            "episodes": s.episodes,
            "num_recorded_steps": s.num_recorded_steps,
            "raw_bytes": s.raw_bytes,
            "wire_bytes": s.wire_bytes,
            "idle_seconds": s.idle_seconds,
            "is_full": s.is_full,
        }
        for s in reply.sessions
    ]


def fetch_episodes(
    target: str,
    session: str,
    *,
    pad_incomplete: bool = False,
    include_partial: bool = False,
    token: str | None = None,
    root_certificates: PemSource = None,
    client_certificate: PemSource = None,
    client_key: PemSource = None,
    timeout: float = 300.0,
    on_data_loss: str = "raise",
) -> Trajectory:
    """The session's episodes as ``finish()`` returns them (``include_partial`` as there),
    read without joining it as a worker. Raises UnknownSessionError for a name the server does not hold, NoDataError
    when it holds no episode, and DataLossError as finish() does (``on_data_loss``).
    ``timeout`` bounds the connection and the whole download."""
    raise_loss = raises_on_loss(on_data_loss)
    connection = _connection(
        target, token, root_certificates, client_certificate, client_key, timeout
    )
    try:
        request = pb.FinishRequest(
            session=session,
            pad_incomplete=bool(pad_incomplete),
            include_partial=bool(include_partial),
            chunk_frames=True,
        )
        return checked(assemble(connection.download("Finish", request)), raise_loss)
    finally:
        connection.close()


def drop_session(
    target: str,
    name: str,
    token: str | None = None,
    *,
    root_certificates: PemSource = None,
    client_certificate: PemSource = None,
    client_key: PemSource = None,
    timeout: float = 10.0,
) -> None:
    """Drop a session: its memory, log records and checkpoint entries, durably, before this
    returns. Raises UnknownSessionError for a name the server does not hold."""
    connection = _connection(
        target, token, root_certificates, client_certificate, client_key, timeout
    )
    try:
        connection.call("DropSession", pb.DropSessionRequest(session=name))
    finally:
        connection.close()
