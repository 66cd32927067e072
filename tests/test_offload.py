"""The ingest pool's batched calls (server/rpc/offload.py): the calls of one turn of the event
loop go to a pool thread together, each keeps its own result or error, and small calls take
their own slots beside the big ones."""

from __future__ import annotations

import asyncio
import threading

import pytest

from recorder_server.rpc.offload import Offload


def test_calls_of_one_turn_run_together_each_with_its_own_outcome() -> None:
    pool = Offload(2, 0, "test-offload", small_capacity=16)
    ran: list[tuple[int, int]] = []

    def work(i: int) -> int:
        ran.append((i, threading.get_ident()))
        if i == 3:
            raise ValueError(f"call {i} refused")
        return i * 10

    async def main() -> list:
        calls = [pool.run_batched(work, i, small=True) for i in range(8)]
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        pool.shutdown()
    assert [o for i, o in enumerate(outcomes) if i != 3] == [0, 10, 20, 40, 50, 60, 70]
    assert isinstance(outcomes[3], ValueError) and str(outcomes[3]) == "call 3 refused"
    # One trip: in the order they were made, on one thread.
    assert [i for i, _ in ran] == list(range(8))
    assert len({t for _, t in ran}) == 1
    assert pool.in_flight == 0


def test_small_calls_are_taken_while_the_big_slots_are_full() -> None:
    pool = Offload(1, 0, "test-offload", small_capacity=4)
    release = threading.Event()

    def blocked() -> str:
        release.wait(10)
        return "big"

    async def main() -> tuple[list, list[int]]:
        first = asyncio.ensure_future(pool.run_batched(blocked))
        await asyncio.sleep(0.05)
        seen = [pool.in_flight]  # the one big slot, taken
        second = asyncio.ensure_future(pool.run_batched(lambda: "big too"))
        small = [
            asyncio.ensure_future(pool.run_batched(lambda i=i: i, small=True)) for i in range(6)
        ]
        await asyncio.sleep(0.05)
        # The second big call waits for a slot; four small ones are taken, two wait.
        seen.append(pool.in_flight)
        release.set()
        return await asyncio.gather(first, second, *small), seen

    try:
        results, seen = asyncio.run(main())
    finally:
        pool.shutdown()
    assert seen == [1, 5]
    assert results == ["big", "big too", 0, 1, 2, 3, 4, 5]
    assert pool.in_flight == 0


def test_a_stopped_pool_refuses_a_batch_as_shutting_down() -> None:
    pool = Offload(1, 0, "test-offload")
    pool.shutdown()

    async def main() -> None:
        await pool.run_batched(lambda: None, small=True)

    with pytest.raises(Exception, match="the server is stopping"):
        asyncio.run(main())
    assert pool.in_flight == 0


def test_a_call_alone_in_its_turn_runs_on_the_loop_when_it_may() -> None:
    pool = Offload(2, 0, "test-offload", small_capacity=16)
    threads: dict[str, int] = {}

    def work(name: str) -> str:
        threads[name] = threading.get_ident()
        return name

    async def main() -> int:
        loop_thread = threading.get_ident()
        # Alone, the pool idle, and allowed: here.
        assert await pool.run_batched(work, "alone", small=True, inline=lambda: True) == "alone"
        # Alone but not allowed, or not alone: on the pool.
        await pool.run_batched(work, "refused", small=True, inline=lambda: False)
        await asyncio.gather(
            *(pool.run_batched(work, f"pair{i}", small=True, inline=lambda: True) for i in (0, 1))
        )
        return loop_thread

    try:
        loop_thread = asyncio.run(main())
    finally:
        pool.shutdown()
    assert threads["alone"] == loop_thread
    assert loop_thread not in (threads["refused"], threads["pair0"], threads["pair1"])
    assert pool.in_flight == 0
