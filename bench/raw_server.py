"""The wire limit: a minimal gRPC server with one generic stream-stream method.

    python bench/raw_server.py 127.0.0.1:0

`/bench.Raw/Stream` takes raw bytes messages (identity (de)serialisation: no
protobuf, no compression, no validation) and acks each with the stream's
running byte count as ASCII. Prints "raw-grpc listening on ADDR" when ready;
stops on SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc


def stream(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    total = 0
    for message in request_iterator:
        total += len(message)
        yield str(total).encode()


def main() -> int:
    listen = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:0"
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ],
    )
    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {
            "Stream": grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=None, response_serializer=None
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(listen)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"raw-grpc listening on {listen.rsplit(':', 1)[0]}:{port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop(2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
