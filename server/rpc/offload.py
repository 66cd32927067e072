"""Work off the event loop: thread pools with a bounded number of calls in flight.

The event loop only moves messages; decoding, splitting, the log, the store and every
session lock are taken on these threads (zstd, numpy and the compiled store loops release
the GIL). A pool takes at most ``threads + queue`` calls at once; further callers wait on the
loop (a coroutine each, no thread), so their streams stop being read and gRPC's flow control
holds the clients back.

`run_batched` coalesces the calls made in one turn of the loop (small chunks of many streams
arriving together) into one trip to a pool thread and one wake-up of the loop back: for a
chunk of a few KB, the two thread crossings cost more server CPU than the chunk's own work.
Calls marked small (a few KB of request each) take their own `small_capacity` slots, so
that hundreds of small actors fill batches without letting more big chunks in at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import ErrorKind, RequestError

T = TypeVar("T")


def default_threads() -> int:
    """Ingest threads for this machine: one per core (at least 2). More threads than cores
    only contend for the GIL (measured: on 2 cores, 4 threads cost 14% more server CPU per
    byte than 2); a log that fsyncs every chunk may want more (`--threads`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(32, cores or 1))


class Offload:
    def __init__(self, threads: int, queue: int, name: str, small_capacity: int = 64) -> None:
        if threads < 1 or queue < 0 or small_capacity < 1:
            raise ValueError(
                f"threads, queue, small_capacity: expected >= 1, >= 0 and >= 1, got {threads}, "
                f"{queue}, {small_capacity}"
            )
        self.threads = threads
        self.capacity = threads + queue
        self.small_capacity = small_capacity
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._slots: asyncio.Semaphore | None = None
        self._small_slots: asyncio.Semaphore | None = None
        self.in_flight = 0
        """Calls taken (running or queued for a thread); at most `capacity` plus
        `small_capacity` small ones."""
        # Calls of this turn of the loop, not yet handed to a thread (run_batched), each with
        # the slots it holds.
        self._batch: list[
            tuple[Callable[..., Any], tuple, asyncio.Future, asyncio.Semaphore, Any]
        ] = []
        self.max_batch = small_capacity

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a pool thread, once a slot is free."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        slots = self._slots
        await slots.acquire()
        self.in_flight += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def work() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as exc:
                result, error = None, exc

            def done() -> None:
                # The slot is free once the call is done, even when its caller was cancelled.
                self.in_flight -= 1
                slots.release()
                if future.cancelled():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            try:
                loop.call_soon_threadsafe(done)  # one wake-up of the loop per call
            except RuntimeError:  # the loop is closed: the server has stopped
                pass

        try:
            self._pool.submit(work)
        except BaseException as exc:
            self.in_flight -= 1
            slots.release()
            if isinstance(exc, RuntimeError):  # the pool was shut down: the server is stopping
                raise RequestError(ErrorKind.SHUTTING_DOWN, "the server is stopping") from None
            raise
        return await future

    async def run_batched(
        self,
        fn: Callable[..., T],
        *args: Any,
        small: bool = False,
        inline: Callable[[], bool] | None = None,
    ) -> T:
        """``fn(*args)`` on a pool thread, with the other calls made in this turn of the loop
        (up to `max_batch`): one after the other on one thread, each its own result or error.
        `small`: the call holds one of the `small_capacity` slots, not a `capacity` one.
        `inline`: asked when the call is alone in its turn and the pool idle; true runs it
        here, on the loop (a thread's wake-up and the loop's cost more than a small call)."""
        # Made on the loop that uses them (the pool is built before it runs).
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        if self._small_slots is None:
            self._small_slots = asyncio.Semaphore(self.small_capacity)
        slots = self._small_slots if small else self._slots
        await slots.acquire()
        self.in_flight += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._batch:
            loop.call_soon(self._hand_over, loop)
        self._batch.append((fn, args, future, slots, inline))
        if len(self._batch) >= self.max_batch:
            self._hand_over(loop)
        return await future

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        if len(batch) == 1 and self.in_flight == 1:
            fn, args, future, slots, inline = batch[0]
            if inline is not None and inline():
                self.in_flight -= 1
                slots.release()
                if not future.cancelled():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:
                        future.set_exception(exc)
                return

        def work() -> None:
            outcomes = []
            for fn, args, _, _, _ in batch:
                try:
                    outcomes.append((fn(*args), None))
                except BaseException as exc:
                    outcomes.append((None, exc))

            def done() -> None:
                for (_, _, future, slots, _), (result, error) in zip(batch, outcomes, strict=True):
                    self.in_flight -= 1
                    slots.release()
                    if future.cancelled():
                        continue
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(result)

            try:
                loop.call_soon_threadsafe(done)
            except RuntimeError:  # the loop is closed: the server has stopped
                pass

        try:
            self._pool.submit(work)
        except BaseException as exc:
            error: BaseException = exc
            if isinstance(exc, RuntimeError):  # the pool was shut down: the server is stopping
                error = RequestError(ErrorKind.SHUTTING_DOWN, "the server is stopping")
            for _, _, future, slots, _ in batch:
                self.in_flight -= 1
                slots.release()
                if not future.cancelled():
                    future.set_exception(error)

    def shutdown(self) -> None:
        """Stop taking work; threads finish what they run (no wait here)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
