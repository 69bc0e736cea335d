"""The telemetry database as the daemon holds it: one SQLAlchemy engine for
reads (tenants, dashboard, /metrics) and one Recorder for writes.

    db = open_database(url)     # creates the schema in an empty database,
                                # raises SchemaOutOfDate / SchemaTooNew otherwise
    app = make_app(settings, engine, database=db)   # the app starts and closes it

The app's cleanup context (daemon.app, an aiohttp `cleanup_ctx`) calls `start()` with the
app and, at shutdown (after the engine thread has stopped and flushed),
`close()`: the recorder writes everything still buffered, the engine is
disposed.

Several daemons may share one database; each is an instance (`crossover
serve --instance NAME`, default `default_instance()`: host name and port).
The recorder stamps it on every telemetry row, and the tuner, /metrics, the
admin API and the dashboard read it from `Database.instance`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
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
    instance: str = ""
    """This daemon's name among those sharing the database ("" for a single daemon)."""

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


def default_instance(port: int) -> str:
    """The instance name a daemon gets unless told one: "<host name>:<port>"."""
    return f"{socket.gethostname()}:{port}"


def open_database(
    url: str, *, create_if_empty: bool = True, recorder_config: RecorderConfig | None = None,
    instance: str = "",
) -> Database:
    """Check (or create) the schema, then build the read engine and the recorder, which
    stamps `instance` (else `recorder_config.instance`) on every row.

    Raises `store.migrate.SchemaError` when the database is not at head; its
    message names the `crossover db upgrade` command.
    """
    url = resolve_url(url)
    ensure_schema(url, create_if_empty=create_if_empty)
    config = recorder_config or RecorderConfig(retention=RetentionConfig())
    if instance:
        config = dataclasses.replace(config, instance=instance)
    return Database(url, make_engine(url), Recorder(url, config), config.instance)
