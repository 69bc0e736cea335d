"""What Alembic versions in the database: its version table and crossover's tables.

Shared by `store.migrate` (which runs Alembic) and `migrations/env.py` (which
Alembic runs), so that neither imports the other.
"""

from __future__ import annotations

from typing import Any

from store.models import TABLE_PREFIX, VIEW_PREFIX

VERSION_TABLE = "xo_alembic_version"
"""crossover's own version table: Optuna's RDB storage uses `alembic_version` in the same file."""


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic filter: only crossover's `xo_` tables (never Optuna's, never views).

    >>> include_object(None, "xo_steps", "table", True, None)
    True
    >>> [include_object(None, n, "table", True, None)
    ...  for n in ("trials", "xo_v_acceptance", VERSION_TABLE)]
    [False, False, False]
    """
    if type_ != "table":
        return True
    name = name or ""
    return (
        name.startswith(TABLE_PREFIX) and not name.startswith(VIEW_PREFIX) and name != VERSION_TABLE
    )
