"""TenantGates: FIFO hand-over of slots, 429 past the queue, cancelled waiters leave no trace."""

from __future__ import annotations

import asyncio

import pytest

from daemon.errors import ApiError
from daemon.tenants.gate import TenantGates
from daemon.tenants.limits import TenantInfo, TenantLimits

SMALL = TenantInfo("small", TenantLimits(max_concurrent=1, max_queued=2))


async def hold(gates: TenantGates, release: asyncio.Event, order: list[str], name: str) -> None:
    async with gates.slot(SMALL):
        order.append(name)
        await release.wait()


def test_waiters_get_slots_in_order_and_the_queue_is_bounded() -> None:
    async def main() -> None:
        gates, order = TenantGates(), list[str]()
        events = {n: asyncio.Event() for n in "abc"}
        tasks: dict[str, asyncio.Task[None]] = {}
        for n in "abc":
            tasks[n] = asyncio.create_task(hold(gates, events[n], order, n))
            await asyncio.sleep(0)
        assert gates.in_flight() == {"small": (1, 2)}
        with pytest.raises(ApiError) as info:
            async with gates.slot(SMALL):
                pass
        assert info.value.status == 429 and info.value.code == "tenant_concurrency_limit"
        for n in "abc":
            events[n].set()
            await tasks[n]
        assert order == ["a", "b", "c"] and gates.in_flight() == {}

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def main() -> None:
        gates, order, release = TenantGates(), list[str](), asyncio.Event()
        first = asyncio.create_task(hold(gates, release, order, "a"))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold(gates, release, order, "b"))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert gates.in_flight() == {"small": (1, 0)}
        release.set()
        await first
        assert order == ["a"] and gates.in_flight() == {}

    asyncio.run(main())


def test_a_waiter_cancelled_just_after_the_hand_over_passes_the_slot_on() -> None:
    async def main() -> None:
        gates, order = TenantGates(), list[str]()
        release_a, release_c = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(hold(gates, release_a, order, "a"))
        await asyncio.sleep(0)
        b = asyncio.create_task(hold(gates, asyncio.Event(), order, "b"))
        await asyncio.sleep(0)
        c = asyncio.create_task(hold(gates, release_c, order, "c"))
        await asyncio.sleep(0)
        release_a.set()
        await asyncio.sleep(0)  # a leaves and hands its slot to b ...
        assert a.done() and order == ["a"]
        b.cancel()  # ... which is cancelled before it could run
        await asyncio.gather(b, return_exceptions=True)
        await asyncio.sleep(0)
        assert order == ["a", "c"] and gates.in_flight() == {"small": (1, 0)}
        release_c.set()
        await c
        assert gates.in_flight() == {}

    asyncio.run(main())


def test_unlimited_tenants_are_only_counted() -> None:
    async def main() -> None:
        gates = TenantGates()
        free = TenantInfo("free", TenantLimits())
        async with gates.slot(free), gates.slot(free), gates.slot(free):
            assert gates.in_flight() == {"free": (3, 0)}
        assert gates.in_flight() == {}

    asyncio.run(main())
