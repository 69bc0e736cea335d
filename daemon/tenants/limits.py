"""Per-tenant limits: what they are, where they come from, and the one list of them.

Light on purpose (no SQLAlchemy): the CLI builds its flags from
`LIMIT_FIELDS` at `crossover --help` time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.settings import Settings

LIMIT_FIELDS: dict[str, str] = {
    "max_concurrent": "requests in flight at once; more wait (max_queued) or get 429 "
                      "(default: the daemon's tenant_max_concurrent_share of max_batch)",
    "max_queued": "requests that may wait for a slot once max_concurrent are in flight; "
                  "more get 429 (default: the daemon's tenant_max_queued)",
    "max_tokens": "most completion tokens one request may ask for; more is a 400 "
                  "(default: the daemon's max_tokens)",
}
"""Limit name -> help: the nullable integer columns of xo_tenants that `crossover tenants
add` and POST /admin/tenants may set (None = no limit of the tenant's own)."""

LIMIT_MINIMUMS: dict[str, int] = {"max_concurrent": 1, "max_queued": 0, "max_tokens": 1}
LIMIT_MAXIMUM = 2**31 - 1
"""Largest value of any limit: the columns are INTEGER, 32-bit on PostgreSQL."""
"""The smallest value each limit takes (max_queued=0: never wait, 429 at once)."""


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may do at once; None means no limit of the tenant's own."""

    max_concurrent: int | None = None
    """Requests in flight at once; past it (and past max_queued waiting) 429."""
    max_queued: int = 0
    """Requests that may wait in the daemon for a slot once max_concurrent are in flight."""
    max_tokens: int | None = None
    """Most completion tokens one request may ask for; more is a 400."""


@dataclass(frozen=True)
class TenantInfo:
    """An authenticated caller."""

    name: str
    limits: TenantLimits


def default_limits(settings: Settings) -> TenantLimits:
    """Limits of the open-mode tenant: no max_concurrent, since that tenant is every caller."""
    return TenantLimits(None, settings.tenant_max_queued, settings.max_tokens)


def limits_for(row: Any, settings: Settings) -> TenantLimits:
    """The limits of a `store.models.Tenant` row.

    The row's `max_concurrent`, `max_queued` and `max_tokens` (the last two
    since schema revision 0003) override the daemon-wide defaults
    (`tenant_max_concurrent_share` of `max_batch`, `tenant_max_queued`,
    `max_tokens`); NULL keeps them. The default share keeps one tenant from
    taking every slot of the batch.
    """
    return TenantLimits(
        max_concurrent=(settings.tenant_default_max_concurrent if row.max_concurrent is None
                        else row.max_concurrent),
        max_queued=settings.tenant_max_queued if row.max_queued is None else row.max_queued,
        max_tokens=settings.max_tokens if row.max_tokens is None else row.max_tokens,
    )
