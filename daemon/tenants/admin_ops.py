"""Adding, listing and revoking tenants: shared by `crossover tenants` and /admin/tenants.

Every function takes the Session (the caller commits: `store.db.session_scope`).
A new tenant's API key is generated here and returned once; only its salted
hash is stored. `LIMIT_FIELDS` is the one list of per-tenant limits that the
CLI flags, the admin API's body and the listings are built from.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.tenants.limits import LIMIT_FIELDS, LIMIT_MAXIMUM, LIMIT_MINIMUMS
from store.apikeys import generate_api_key
from store.models import Tenant
from store.tenants import add_tenant, revoke_tenant

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RESERVED_NAMES = frozenset({"default"})
""""default" is the open-mode tenant."""


class TenantExists(ValueError):
    """A tenant of that name exists (revoked ones too: names are never reused)."""


def check_name(name: str) -> None:
    """Raise ValueError unless `name` is 1-128 of [A-Za-z0-9._-] and not reserved."""
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(f"tenant name must be 1-128 letters, digits, '.', '_' or '-' "
                         f"(not starting with '.', '_' or '-'), got {name!r}")
    if name in RESERVED_NAMES:
        raise ValueError(f"tenant name {name!r} is reserved")


def check_limits(limits: dict[str, Any]) -> None:
    """Raise ValueError naming the field unless every limit is known and an int (from its
    LIMIT_MINIMUMS entry to LIMIT_MAXIMUM) or None."""
    for key, value in limits.items():
        if key not in LIMIT_FIELDS:
            raise ValueError(f"unknown tenant limit {key!r} (known: {', '.join(LIMIT_FIELDS)})")
        low = LIMIT_MINIMUMS[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not low <= value <= LIMIT_MAXIMUM):
            raise ValueError(f"{key} must be an integer in [{low}, {LIMIT_MAXIMUM}] or null, "
                             f"got {value!r}"[:300])


def create_tenant(session: Session, name: str, limits: dict[str, Any]) -> tuple[Tenant, str]:
    """Add a tenant; return its row and its new API key (shown once, never stored)."""
    check_name(name)
    check_limits(limits)
    if find(session, name) is not None:
        raise TenantExists(f"a tenant named {name!r} already exists")
    key = generate_api_key()
    return add_tenant(session, name, key, **limits), key


def find(session: Session, name: str) -> Tenant | None:
    return session.scalars(select(Tenant).where(Tenant.name == name)).first()


def list_tenants(session: Session, include_revoked: bool = True) -> list[Tenant]:
    query = select(Tenant).order_by(Tenant.name)
    if not include_revoked:
        query = query.where(Tenant.revoked_at.is_(None))
    return list(session.scalars(query))


def revoke(session: Session, name: str) -> Tenant:
    """Revoke `name` (LookupError when unknown); revoking twice keeps the first time."""
    tenant = find(session, name)
    if tenant is None:
        raise LookupError(f"no tenant named {name!r}")
    if tenant.revoked_at is not None:
        return tenant
    return revoke_tenant(session, name)


def describe(tenant: Tenant) -> dict[str, Any]:
    """The JSON view of a tenant (never its key hash)."""
    view: dict[str, Any] = {"name": tenant.name, "active": tenant.revoked_at is None,
                            "created_at": tenant.created_at, "revoked_at": tenant.revoked_at}
    view.update({key: getattr(tenant, key) for key in LIMIT_FIELDS})
    return view
