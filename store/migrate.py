"""Schema versioning through Alembic, configured in code (no alembic.ini).

The scripts live in the `migrations` package, found next to its
`__init__.py`, so this works from any working directory and from an installed
wheel. The project's Alembic keeps its own version table, `xo_alembic_version`,
because Optuna's RDB storage uses `alembic_version` in the same file
(store/versioning.py, which migrations/env.py reads too).

    upgrade(url)          bring a database to head (what `crossover db upgrade` runs)
    check_schema(url)     raise SchemaOutOfDate unless the database is at head
    ensure_schema(url)    create the schema in an empty database, else check_schema
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from store.db import make_engine, resolve_url, shown_url
from store.models import TABLE_PREFIX
from store.versioning import VERSION_TABLE


class SchemaError(RuntimeError):
    """The database's schema does not match this version of crossover."""


class SchemaOutOfDate(SchemaError):
    """The database is older than head (or has no schema); the message says how to upgrade."""


class SchemaTooNew(SchemaError):
    """The database was migrated by a newer crossover than this one."""


def script_location() -> Path:
    """The folder holding env.py and versions/: the `migrations` package's.

    It is located, not imported: Alembic loads env.py from the folder, and
    env.py imports the store, so the store importing `migrations` would close a
    circle. The search locations (rather than a file) also cover an editable
    install made before the package had its __init__.py (a namespace package).
    """
    spec = importlib.util.find_spec("migrations")
    entries = list(spec.submodule_search_locations or []) if spec else []
    for entry in entries:
        if (Path(entry) / "env.py").is_file():
            return Path(entry).resolve()
    raise RuntimeError(f"no env.py in the migrations package ({entries})")


def alembic_config(url: str | None = None) -> Config:
    """An Alembic Config built in code; the URL (if any) travels in `attributes`."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    if url is not None:
        cfg.attributes["url"] = resolve_url(url)
    return cfg


def head_revision() -> str:
    """The newest revision in migrations/versions."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


def known_revisions() -> set[str]:
    script = ScriptDirectory.from_config(alembic_config())
    return {rev.revision for rev in script.walk_revisions()}


def current_revision(url: str) -> str | None:
    """The revision stamped in the database, None when it has no crossover schema."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return ctx.get_current_revision()
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` to `revision` (default: head)."""
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


def upgrade_command(url: str) -> str:
    """The shell command that upgrades `url` (password hidden)."""
    return f"crossover db upgrade --db {shlex.quote(shown_url(url))}"


def check_schema(url: str) -> str:
    """Return the revision when the database is at head, else raise SchemaError."""
    current, head = current_revision(url), head_revision()
    if current == head:
        return current
    shown = shown_url(url)
    if current is None:
        raise SchemaOutOfDate(
            f"database {shown} has no crossover schema; create it with: {upgrade_command(url)}"
        )
    if current not in known_revisions():
        raise SchemaTooNew(
            f"database {shown} is at schema revision {current}, unknown to this crossover "
            f"(head {head}): it was migrated by a newer version; run that version instead"
        )
    raise SchemaOutOfDate(
        f"database {shown} is at schema revision {current} but this crossover needs {head}; "
        f"upgrade it with: {upgrade_command(url)}"
    )


def is_empty(url: str) -> bool:
    """True when the database holds no crossover table (Optuna's tables don't count)."""
    engine = make_engine(url)
    try:
        names = inspect(engine).get_table_names()
    finally:
        engine.dispose()
    return not any(n.startswith(TABLE_PREFIX) for n in names)


def ensure_schema(url: str, create_if_empty: bool = True) -> str:
    """Create the schema in a database without one, else insist it is at head."""
    if create_if_empty and is_empty(url):
        upgrade(url)
    return check_schema(url)


def new_revision(url: str, message: str, autogenerate: bool = True) -> None:
    """Write a new revision file into migrations/versions (developers only)."""
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.revision(cfg, message=message, autogenerate=autogenerate)
    finally:
        engine.dispose()
