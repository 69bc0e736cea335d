"""Alembic environment for crossover's telemetry schema.

store.migrate builds the Config in code and passes either an open connection
(`attributes["connection"]`) or a URL (`attributes["url"]`). This module reads
only the store's models and version-table names, never store.migrate, which
runs it.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from store.models import Base
from store.versioning import VERSION_TABLE, include_object

config = context.config

OPTIONS = dict(
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    # SQLite ALTER goes through table copies; on PostgreSQL a batch is plain ALTER TABLE,
    # so the same revisions run on both (tests/store/test_migrate.py runs them on both).
    render_as_batch=True,
    include_object=include_object,  # never touch Optuna's tables
    compare_type=True,
)


def run_offline() -> None:
    context.configure(url=config.attributes["url"], literal_binds=True, **OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


def _transactional_ddl(conn) -> None:
    """On SQLite, open the transaction now. Its driver begins one only at the first
    INSERT/UPDATE/DELETE, so DDL before that commits at once: a run refused midway (0006's
    downgrade) would keep the batch copies and dropped views of the revisions before it."""
    if conn.dialect.name == "sqlite" and not conn.connection.dbapi_connection.in_transaction:
        conn.exec_driver_sql("BEGIN")


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _transactional_ddl(connection)
        context.configure(connection=connection, **OPTIONS)
        with context.begin_transaction():
            context.run_migrations()
        return
    # Only a URL (e.g. a downgrade run through alembic.command): one connection,
    # no pool. SQLite's WAL mode is a property of the file, set when it was created.
    engine = create_engine(config.attributes["url"], poolclass=NullPool)
    try:
        with engine.begin() as conn:
            _transactional_ddl(conn)
            context.configure(connection=conn, **OPTIONS)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
