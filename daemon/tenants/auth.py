"""Who is calling: `await authenticate(request) -> TenantInfo`.

Open mode (the default on loopback) serves everyone as tenant "default" with
the daemon-wide limits and ignores any API key. Otherwise:

1. `Authenticator.tenant_for` takes the bearer key of the request (401
   `invalid_api_key` when it is missing) and hands it to the directory;
   without a directory a closed daemon refuses every key with 401.
2. `TenantDirectory.lookup` answers from its cache, keyed by the key's
   SHA-256 (the raw key is not kept), when the entry is younger than
   `ttl_s` — found and not-found answers alike, so a flood of bad keys does
   not reach the database.
3. Otherwise it verifies the key against the store's salted hashes
   (`store.tenants.find_tenant_by_key`) in a worker thread, never on the
   event loop; concurrent lookups of one key share that thread's answer.
   An unknown or revoked key is a 401; a failing database a 503.
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
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web
from sqlalchemy import Engine

from daemon.errors import ApiError
from daemon.settings import Settings
from daemon.tenants.limits import TenantInfo, TenantLimits, limits_for
from store.db import session_scope
from store.tenants import find_tenant_by_key

DEFAULT_TENANT = "default"
MAX_CACHED_KEYS = 10_000
"""Most cached lookups; the oldest are evicted first."""

log = logging.getLogger("crossover.auth")


class KeyDirectory(Protocol):
    """API key -> tenant; `TenantDirectory` in the daemon, a dict in some tests."""

    async def lookup(self, key: str) -> TenantInfo | None: ...


@dataclass
class Authenticator:
    open_mode: bool
    default_limits: TenantLimits = field(default_factory=TenantLimits)
    """Limits of the open-mode tenant "default"."""
    directory: KeyDirectory | None = None
    """Where tenant keys are looked up; None means no tenant keys exist."""

    async def tenant_for(self, request: web.Request) -> TenantInfo:
        if self.open_mode:
            return TenantInfo(DEFAULT_TENANT, self.default_limits)
        key = bearer_token(request)
        if key is None:
            raise ApiError(401, "missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        if not (key.isascii() and key.isprintable()):  # no issued key is (store/apikeys.py): no lookup
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        tenant = await self._lookup(key)
        if tenant is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return tenant

    async def _lookup(self, key: str) -> TenantInfo | None:
        if self.directory is None:
            return None
        try:
            return await self.directory.lookup(key)
        except Exception:
            log.exception("API key lookup failed")
            raise ApiError(503, "the tenant store is unavailable; retry later",
                           code="tenant_store_unavailable") from None


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


AUTH = web.AppKey("auth", Authenticator)


async def authenticate(request: web.Request) -> TenantInfo:
    """The calling tenant, or ApiError 401."""
    return await request.app[AUTH].tenant_for(request)


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
