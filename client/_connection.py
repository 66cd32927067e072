"""One channel to a recorder server and the calls made on it, gRPC errors mapped to ours.

The recorder, its stream and its remote trajectory store all call the server through this
object; nothing else holds the stub.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from ._credentials import PemSource, make_channel
from ._proto import recorder_pb2_grpc as pb_grpc
from .errors import RecorderUnavailableError, from_rpc_error, handshake_hint

MESSAGE_CAP = 256 << 20
DEFAULT_KEEPALIVE_S = 10.0


class Connection:
    def __init__(
        self,
        target: str,
        *,
        token: str | None,
        root_certificates: PemSource,
        client_certificate: PemSource,
        client_key: PemSource,
        rpc_timeout: float,
        connect_timeout: float,
        keepalive_seconds: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        self.target = target
        self.rpc_timeout = rpc_timeout
        self.connect_timeout = connect_timeout
        self._channel = make_channel(
            target,
            token=token,
            root_certificates=root_certificates,
            client_certificate=client_certificate,
            client_key=client_key,
            options=[
                ("grpc.max_receive_message_length", MESSAGE_CAP),
                ("grpc.max_send_message_length", MESSAGE_CAP),
                # A server that stops answering without closing the connection (a partition,
                # a blackhole) is noticed by pings: one every keepalive_seconds of a call,
                # the transport dropped when one is not answered within keepalive_seconds
                # (gRPC's ping timeout covers every ping, its own flow-control ones too).
                ("grpc.keepalive_time_ms", int(keepalive_seconds * 1000)),
                ("grpc.keepalive_timeout_ms", int(keepalive_seconds * 1000)),
                ("grpc.http2.ping_timeout_ms", int(keepalive_seconds * 1000)),
                ("grpc.http2.max_pings_without_data", 0),
                # Redial at least every 5 s while the server is away (gRPC's backoff grows to
                # 120 s): a healed network is used within seconds.
                ("grpc.max_reconnect_backoff_ms", 5000),
            ],
        )
        self._stub = pb_grpc.RecorderStub(self._channel)

    def call(
        self, method: str, request: Any, timeout: float | None = None, *, wait: bool = True
    ) -> Any:
        """A unary call; RecorderError subclasses on failure. A server that cannot be reached
        (one restarting) is waited for up to connect_timeout, then RecorderUnavailableError;
        ``wait=False`` fails at once."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=timeout or self.rpc_timeout)
            except grpc.RpcError as err:
                if not (wait and _waitable(err)):
                    raise from_rpc_error(err, self.target) from None
                if not self._reachable_by(deadline):
                    raise self._unreachable(err) from None

    def _reachable_by(self, deadline: float) -> bool:
        """Whether the server can be reached again before the deadline (the failed call is
        then made again: most often one the server never got)."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.FutureTimeoutError:
            ready.cancel()
            return False
        # Reachable, and refusing as unavailable (a server still starting or stopping):
        # a pause before the next try, which the deadline bounds.
        time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        return time.monotonic() < deadline

    def _unreachable(self, err: grpc.RpcError) -> RecorderUnavailableError:
        details = err.details() or ""
        return RecorderUnavailableError(
            f"recorder server at {self.target} unreachable within {self.connect_timeout}s "
            f"({details}){handshake_hint(details)}"
        )

    def call_async(
        self, method: str, request: Any, done: Callable[[Any], None], timeout: float | None = None
    ) -> None:
        """A unary call in the background; ``done(reply)`` runs on a gRPC thread, with None
        when the call failed."""
        future = getattr(self._stub, method).future(request, timeout=timeout or self.rpc_timeout)

        def finished(call: Any) -> None:
            try:
                reply = call.result()
            except Exception:  # an RpcError, or the channel closed under the call
                reply = None
            done(reply)

        future.add_done_callback(finished)

    def connect(self, method: str, request: Any) -> Any:
        """A unary call that waits for a server still starting, up to connect_timeout; a
        call the transport cancelled (this client cancels none) is made again until then.
        Only for calls that may be repeated (Join)."""
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.05
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(deadline - time.monotonic(), 0.001), wait_for_ready=True
                )
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.CANCELLED and time.monotonic() + delay < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise RecorderUnavailableError(
                        f"recorder server at {self.target} unreachable within "
                        f"{self.connect_timeout}s ({err.details()})"
                    ) from None
                raise from_rpc_error(err, self.target) from None

    def download(self, method: str, request: Any) -> Iterator[Any]:
        """The messages of a server-streaming call, read to the end; a server that cannot be
        reached before the first message is waited for as in call()."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            started = False
            try:
                for message in getattr(self._stub, method)(request, timeout=self.rpc_timeout):
                    started = True
                    yield message
                return
            except grpc.RpcError as err:
                if started or not _waitable(err):
                    raise from_rpc_error(err, self.target) from None
                if not self._reachable_by(deadline):
                    raise self._unreachable(err) from None

    def upload(self, method: str, requests: Iterable[Any]) -> Any:
        """A client-streaming call."""
        try:
            return getattr(self._stub, method)(iter(requests), timeout=self.rpc_timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.target) from None

    def record_stream(self, requests: Iterator[Any]) -> Any:
        """The Record stream (no deadline; raw gRPC errors: its sender decides what to retry)."""
        return self._stub.Record(requests)

    def close(self) -> None:
        self._channel.close()


def wire_options(joined: Any) -> tuple[bool, int]:
    """What the server of a JoinReply takes: packed codecs, and requests up to its gRPC cap."""
    cap = joined.max_message_bytes
    return joined.packed_codecs, min(cap, MESSAGE_CAP) if cap else MESSAGE_CAP


def _waitable(err: grpc.RpcError) -> bool:
    """Whether a failed call is one to make again once the server is back: unavailable, and
    not a server that closes the connection's set-up (TLS on one side only)."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = err.details() or ""
    return not (details.startswith("failed to connect") and handshake_hint(details))
