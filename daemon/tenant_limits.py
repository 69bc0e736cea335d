"""Per-tenant limits: what they are, where they come from, and the one list of them.

Light on purpose (no SQLAlchemy): the CLI builds its flags from
`LIMIT_FIELDS` at `crossover --help` time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.settings import Settings

LIMIT_FIELDS: dict[str, str] = {
    "max_concurrent": "requests in flight at once; more wait (tenant_max_queued) or get 429",
}
"""Limit name -> help: the nullable integer columns of xo_tenants that `crossover tenants
add` and POST /admin/tenants may set (None = no limit)."""


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
    """Limits of the open-mode tenant and the fallback for tenants without their own."""
    return TenantLimits(None, settings.tenant_max_queued, settings.max_tokens)


def limits_for(row: Any, settings: Settings) -> TenantLimits:
    """The limits of a `store.models.Tenant` row.

    Schema revision 0002 stores only max_concurrent; `max_queued` and
    `max_tokens` columns, once a migration adds them, override the
    daemon-wide defaults (`tenant_max_queued`, `max_tokens`).
    """
    queued = getattr(row, "max_queued", None)
    tokens = getattr(row, "max_tokens", None)
    return TenantLimits(
        max_concurrent=row.max_concurrent,
        max_queued=settings.tenant_max_queued if queued is None else queued,
        max_tokens=settings.max_tokens if tokens is None else tokens,
    )
