"""Who is calling: `await authenticate(request) -> TenantInfo`.

Open mode (the default on loopback) serves everyone as tenant "default" with
the daemon-wide limits and ignores any API key. Otherwise the bearer key must
belong to an active tenant of the directory (`daemon.tenancy.TenantDirectory`,
installed when the daemon has a database); without a directory a closed
daemon refuses every request with 401. Errors are OpenAI-style:
401 `invalid_api_key` for a missing, unknown or revoked key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from daemon.errors import ApiError
from daemon.tenant_limits import TenantInfo, TenantLimits

DEFAULT_TENANT = "default"
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
