"""The wire limit: a minimal gRPC server with one generic stream-stream method.

    python bench/raw_server.py 127.0.0.1:0 [--aio]

`/bench.Raw/Stream` takes raw bytes messages (identity (de)serialisation: no
protobuf, no compression, no validation) and acks each with the stream's
running byte count as ASCII. `--aio`: a grpc.aio server (a coroutine per stream, as the
recorder server), for hundreds of streams at once; else a pool of 16 threads, each holding
one stream. Prints "raw-grpc listening on ADDR" when ready;
stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures

import grpc


def stream(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    total = 0
    for message in request_iterator:
        total += len(message)
        yield str(total).encode()


async def astream(request_iterator, context) -> AsyncIterator[bytes]:
    total = 0
    async for message in request_iterator:
        total += len(message)
        yield str(total).encode()


OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]


async def serve_aio(listen: str) -> None:
    server = grpc.aio.server(options=OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {
            "Stream": grpc.stream_stream_rpc_method_handler(
                astream, request_deserializer=None, response_serializer=None
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(listen)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"raw-grpc listening on {listen.rsplit(':', 1)[0]}:{port}", flush=True)
    await stop.wait()
    await server.stop(2)


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--aio"]
    listen = args[0] if args else "127.0.0.1:0"
    if "--aio" in sys.argv[1:]:
        asyncio.run(serve_aio(listen))
        return 0
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=OPTIONS)
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
