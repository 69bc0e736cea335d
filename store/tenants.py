"""Tenant rows: create, find by API key, revoke. The daemon caches the result."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.apikeys import hash_api_key, verify_api_key
from store.models import Tenant


def add_tenant(
    session: Session,
    name: str,
    api_key: str,
    *,
    max_concurrent: int | None = None,
    max_tokens: int | None = None,
    max_queued: int | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    at: float | None = None,
) -> Tenant:
    """Create a tenant; only the salted hash of `api_key` is stored."""
    tenant = Tenant(
        name=name, api_key_hash=hash_api_key(api_key), max_concurrent=max_concurrent,
        max_tokens=max_tokens, max_queued=max_queued,
        requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
        created_at=_now(at),
    )  # fmt: skip
    session.add(tenant)
    session.flush()
    return tenant


def active_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).where(Tenant.revoked_at.is_(None))))


def find_tenant_by_key(session: Session, api_key: str) -> Tenant | None:
    """The active tenant whose key this is, or None (checks every active tenant)."""
    for tenant in active_tenants(session):
        if verify_api_key(api_key, tenant.api_key_hash):
            return tenant
    return None


def revoke_tenant(session: Session, name: str, at: float | None = None) -> Tenant:
    tenant = session.scalars(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise LookupError(f"no tenant named {name!r}")
    tenant.revoked_at = _now(at)
    return tenant


def _now(at: float | None) -> float:
    return time.time() if at is None else at
