"""Engine and session factory for the telemetry database.

Any SQLAlchemy URL works; SQLite and PostgreSQL are tested. For SQLite, every
new connection is switched to WAL (readers never block the recorder, the
recorder never blocks readers) with a busy timeout, through a `connect` event
listener. A database server (PostgreSQL: `postgresql+psycopg://user:pw@host/db`,
driver in the `postgres` extra) gets no pragmas; its pooled connections are
checked before use, so a daemon outlives a server restart.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

DEFAULT_PATH = "crossover.db"
ENV_VAR = "CROSSOVER_DB"
DEFAULT_BUSY_TIMEOUT_MS = 5000


def default_url() -> str:
    """`sqlite:///<path>` from $CROSSOVER_DB (a path or a URL), else ./crossover.db."""
    return resolve_url(os.environ.get(ENV_VAR) or DEFAULT_PATH)


def shown_url(url_or_path: str) -> str:
    """The database as `resolve_url` gives it, with any password hidden: for logs and messages.

    >>> shown_url("postgresql+psycopg://u:secret@db/telemetry")
    'postgresql+psycopg://u:***@db/telemetry'
    """
    return make_url(resolve_url(url_or_path)).render_as_string(hide_password=True)


def resolve_url(url_or_path: str) -> str:
    """A SQLAlchemy URL as given, or a bare file path turned into a SQLite URL.

    >>> resolve_url("sqlite:///x.db")
    'sqlite:///x.db'
    >>> resolve_url("/tmp/t.db")
    'sqlite:////tmp/t.db'
    """
    if "://" in url_or_path:
        return url_or_path
    return "sqlite:///" + str(Path(url_or_path).expanduser())


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(
    url: str, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS, **kwargs: Any
) -> Engine:
    """An Engine for `url` (a URL or a SQLite file path); SQLite gets WAL + busy timeout,
    a server's pool pings a connection before handing it out."""
    url = resolve_url(url)
    if not is_sqlite(url):
        kwargs.setdefault("pool_pre_ping", True)
    engine = create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        install_sqlite_pragmas(engine, busy_timeout_ms)
    return engine


def install_sqlite_pragmas(engine: Engine, busy_timeout_ms: int) -> None:
    """WAL, busy timeout and synchronous=NORMAL on every new SQLite connection
    (shared by the store's engine and the tuner's Optuna storage)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            # With WAL, NORMAL is safe against a crashed or killed process;
            # only an OS crash can lose the last commits.
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()


@contextmanager
def session_scope(bind: Engine) -> Iterator[Session]:
    """A Session that commits on success, rolls back on error and always closes."""
    session = Session(bind, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
