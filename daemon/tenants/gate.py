"""Per-tenant admission: at most `max_concurrent` requests in flight per tenant.

A request over the limit waits in the daemon (FIFO, before reaching the
engine) while fewer than `max_queued` of the tenant's requests already wait;
otherwise it gets 429 `tenant_concurrency_limit` with Retry-After. A
finishing request hands its slot straight to the oldest waiter; a waiter
whose client goes away leaves the queue (or passes on a slot it was just
handed). Tenants without a limit are only counted. Runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from daemon.errors import ApiError
from daemon.tenants.limits import TenantInfo

RETRY_AFTER_S = "1"


@dataclass
class _Gate:
    running: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


class TenantGates:
    """One gate per tenant with requests in the daemon."""

    def __init__(self) -> None:
        self._gates: dict[str, _Gate] = {}

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """tenant -> (running, waiting) for tenants with requests in the daemon."""
        return {name: (g.running, len(g.waiters)) for name, g in self._gates.items()}

    @asynccontextmanager
    async def slot(self, tenant: TenantInfo) -> AsyncIterator[None]:
        """Hold one of the tenant's slots for the body of the `async with`."""
        await self.acquire(tenant)
        try:
            yield
        finally:
            self.release(tenant)

    async def acquire(self, tenant: TenantInfo) -> None:
        """Take one of the tenant's slots (waiting, or 429, as the module docstring says); give
        it back with `release`."""
        gate = self._gates.setdefault(tenant.name, _Gate())
        try:
            await self._acquire(gate, tenant)
        except BaseException:
            self._forget_if_idle(tenant.name, gate)
            raise

    def release(self, tenant: TenantInfo) -> None:
        """Give back a slot `acquire` took (synchronous: safe in a handler's cleanup)."""
        self._release(tenant.name, self._gates[tenant.name])

    async def _acquire(self, gate: _Gate, tenant: TenantInfo) -> None:
        limit = tenant.limits.max_concurrent
        if limit is None or (gate.running < limit and not gate.waiters):
            gate.running += 1
            return
        if len(gate.waiters) >= tenant.limits.max_queued:
            raise ApiError(
                429, f"tenant {tenant.name!r} has {gate.running} requests in flight "
                f"(its limit is {limit}) and {len(gate.waiters)} waiting; retry later",
                code="tenant_concurrency_limit", headers={"Retry-After": RETRY_AFTER_S})
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gate.waiters.append(waiter)
        try:
            await waiter  # resolved by _release, which hands over its slot
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(tenant.name, gate)  # handed a slot just now: pass it on
            elif waiter in gate.waiters:
                gate.waiters.remove(waiter)
            raise

    def _release(self, name: str, gate: _Gate) -> None:
        while gate.waiters:
            waiter = gate.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands: running stays
                return
        gate.running -= 1
        self._forget_if_idle(name, gate)

    def _forget_if_idle(self, name: str, gate: _Gate) -> None:
        if gate.running == 0 and not gate.waiters and self._gates.get(name) is gate:
            del self._gates[name]
