"""The telemetry database as the daemon holds it: one SQLAlchemy engine for
reads (tenants, dashboard, /metrics) and one Recorder for writes.

    db = open_database(url)     # creates the schema in an empty database,
                                # raises SchemaOutOfDate / SchemaTooNew otherwise
    app = make_app(settings, engine, database=db)   # the app starts and closes it

The app's cleanup context (daemon.app, STYLE 11) calls `start()` with the
app and, at shutdown (after the engine thread has stopped and flushed),
`close()`: the recorder writes everything still buffered, the engine is
disposed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import Engine

from daemon.jsonlog import log_event
from store.db import make_engine, resolve_url
from store.migrate import ensure_schema
from telemetry.recorder import Recorder, RecorderConfig
from telemetry.retention import RetentionConfig

log = logging.getLogger("crossover.db")

CLOSE_TIMEOUT_S = 10.0
"""How long shutdown waits for the recorder to write what it holds."""


@dataclass
class Database:
    url: str
    engine: Engine
    """For reads and tenant changes (SQLite: WAL, so readers never block the recorder)."""
    recorder: Recorder

    def start(self) -> None:
        self.recorder.start()

    def close(self) -> None:
        """Write what the recorder holds (bounded), log the outcome, dispose (blocking)."""
        # flush first: close() alone can drop records queued during a write in progress
        self.recorder.flush(CLOSE_TIMEOUT_S)
        clean = self.recorder.close(CLOSE_TIMEOUT_S)
        stats = self.recorder.stats()
        log_event(log, "telemetry recorder closed", level=logging.INFO if clean else logging.ERROR,
                  written_steps=stats["written_steps"], written_requests=stats["written_requests"],
                  dropped=stats["dropped"])
        self.engine.dispose()


def open_database(
    url: str, *, create_if_empty: bool = True, recorder_config: RecorderConfig | None = None
) -> Database:
    """Check (or create) the schema, then build the read engine and the recorder.

    Raises `store.migrate.SchemaError` when the database is not at head; its
    message names the `crossover db upgrade` command.
    """
    url = resolve_url(url)
    ensure_schema(url, create_if_empty=create_if_empty)
    config = recorder_config or RecorderConfig(retention=RetentionConfig())
    return Database(url, make_engine(url), Recorder(url, config))
