"""`crossover tenants add|list|revoke`: API keys and limits of the daemon's tenants.

    crossover tenants add team-a --max-concurrent 8 --max-queued 4 --max-tokens 512
                                                      # prints the new key, once
    crossover tenants list
    crossover tenants revoke team-a

They work on the database directly (`--db`, else $CROSSOVER_DB or
./crossover.db), which must be at the newest schema; a running daemon sees
a change within its `tenant_cache_s` (the admin API applies it at once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cli.commands import database_actions, database_url

ACTIONS = {
    "add": "add a tenant and print its new API key (shown only this once)",
    "list": "list tenants with their limits (revoked ones too)",
    "revoke": "revoke a tenant's API key",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from daemon.tenants.limits import LIMIT_FIELDS

    for name, p in database_actions(parser, "tenants_action", ACTIONS).items():
        if name in ("add", "revoke"):
            p.add_argument("name", help="tenant name: letters, digits, '.', '_', '-'")
        if name == "add":
            for field, field_help in LIMIT_FIELDS.items():
                p.add_argument("--" + field.replace("_", "-"), dest=field, type=int,
                               metavar="N", default=None, help=field_help)
        if name == "list":
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from daemon.user_error import UserError, first_line
    from store.db import make_engine, session_scope
    from store.migrate import SchemaError, check_schema

    url = database_url(args)
    try:
        check_schema(url)
        engine = make_engine(url)
        try:
            with session_scope(engine) as session:
                return _ACTIONS[args.tenants_action](session, args)
        finally:
            engine.dispose()
    except (SchemaError, ValueError, LookupError) as exc:
        raise UserError(str(exc)) from exc
    except SQLAlchemyError as exc:
        raise UserError(f"database error: {first_line(exc)}") from exc


def _add(session: Any, args: argparse.Namespace) -> int:
    from daemon.tenants.admin_ops import create_tenant
    from daemon.tenants.limits import LIMIT_FIELDS

    limits = {field: getattr(args, field) for field in LIMIT_FIELDS}
    tenant, key = create_tenant(session, args.name, limits)
    print(f"added tenant {tenant.name}; its API key (shown only now):", file=sys.stderr)
    print(key)
    return 0


def _list(session: Any, args: argparse.Namespace) -> int:
    from daemon.tenants.admin_ops import describe, list_tenants
    from daemon.tenants.limits import LIMIT_FIELDS

    views = [describe(t) for t in list_tenants(session)]
    if args.json:
        print(json.dumps(views, indent=2))
        return 0
    columns = ["name", "active", *LIMIT_FIELDS, "created", "revoked"]
    rows = [[v["name"], "yes" if v["active"] else "no", *(_cell(v[f]) for f in LIMIT_FIELDS),
             _when(v["created_at"]), _when(v["revoked_at"])] for v in views]
    _print_table(columns, rows)
    return 0


def _revoke(session: Any, args: argparse.Namespace) -> int:
    from daemon.tenants.admin_ops import revoke

    tenant = revoke(session, args.name)
    print(f"revoked tenant {tenant.name} at {_when(tenant.revoked_at)}")
    return 0


_ACTIONS = {"add": _add, "list": _list, "revoke": _revoke}


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _print_table(columns: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(columns)]
    for line in [columns, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
