"""Tenants as the daemon sees them: limits, and the cached API-key directory.

1. `Authenticator` (daemon.auth) hands a bearer key to `TenantDirectory.lookup`.
2. The directory answers from its cache, keyed by the key's SHA-256 (the raw
   key is not kept), when the entry is younger than `ttl_s` — found and
   not-found answers alike, so a flood of bad keys does not reach the database.
3. Otherwise it verifies the key against the store's salted hashes
   (`store.tenants.find_tenant_by_key`) in a worker thread, never on the
   event loop; concurrent lookups of one key share that thread's answer.
4. Revoking or adding through the admin API calls `invalidate()`, so it
   takes effect at once; a change made from another process (the
   `crossover tenants` CLI) takes effect within `ttl_s`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from sqlalchemy import Engine

from daemon.settings import Settings
from daemon.tenant_limits import TenantInfo, limits_for
from store.db import session_scope
from store.tenants import find_tenant_by_key

log = logging.getLogger("crossover.tenants")

MAX_CACHED_KEYS = 10_000
"""Most cached lookups; the oldest are evicted first."""


class TenantDirectory:
    """API key -> TenantInfo, verified off the loop and cached briefly."""

    def __init__(
        self, engine: Engine, settings: Settings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._ttl_s = settings.tenant_cache_s
        self._clock = clock
        self._cache: OrderedDict[bytes, tuple[float, TenantInfo | None]] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[TenantInfo | None]] = {}
        self._generation = 0
        self.db_lookups = 0
        """Lookups that went to the database (the rest came from the cache)."""

    async def lookup(self, key: str) -> TenantInfo | None:
        """The tenant owning `key`, or None when it is unknown or revoked."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > self._clock():
            return hit[1]
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._find, key))
            self._pending[digest] = pending
            pending.add_done_callback(self._settler(digest, self._generation))
        return await asyncio.shield(pending)

    def invalidate(self) -> None:
        """Forget every cached answer (after adding or revoking a tenant)."""
        self._cache.clear()
        self._generation += 1  # answers still in flight may predate the change

    def _find(self, key: str) -> TenantInfo | None:
        self.db_lookups += 1
        with session_scope(self._engine) as session:
            row = find_tenant_by_key(session, key)
            return None if row is None else TenantInfo(row.name, limits_for(row, self._settings))

    def _settler(
        self, digest: bytes, generation: int
    ) -> Callable[[asyncio.Future[TenantInfo | None]], None]:
        def settle(future: asyncio.Future[TenantInfo | None]) -> None:
            self._pending.pop(digest, None)
            if future.cancelled() or future.exception() is not None:
                return
            if generation == self._generation and self._ttl_s > 0:
                self._cache[digest] = (self._clock() + self._ttl_s, future.result())
                self._cache.move_to_end(digest)
                while len(self._cache) > MAX_CACHED_KEYS:
                    self._cache.popitem(last=False)

        return settle
