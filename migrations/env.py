"""Alembic environment for crossover's telemetry schema.

store.migrate builds the Config in code and passes either an open connection
(`attributes["connection"]`) or a URL (`attributes["url"]`).
"""

from __future__ import annotations

from alembic import context

from store.db import make_engine
from store.migrate import VERSION_TABLE, include_object
from store.models import Base

config = context.config

OPTIONS = dict(
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=True,  # SQLite ALTER goes through table copies
    include_object=include_object,  # never touch Optuna's tables
    compare_type=True,
)


def run_offline() -> None:
    context.configure(url=config.attributes["url"], literal_binds=True, **OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, **OPTIONS)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(config.attributes["url"])
    try:
        with engine.begin() as conn:
            context.configure(connection=conn, **OPTIONS)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
