"""Fixtures for the daemon tests (helpers live in helpers.py). The persistent compilation cache is
on for them as for the engine tests: the tiny-model daemons load their shapes from it instead of
compiling them, whichever tests ran before in the process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.fake import FakeEngine
from tests.daemon.helpers import LiveServer
from tests.engine.conftest import _compile_cache  # noqa: F401  (pytest fixture)


@pytest.fixture
def live() -> Iterator[Callable[..., LiveServer]]:
    """Factory: `live(engine=..., **settings)` -> a started LiveServer, closed after the test."""
    servers: list[LiveServer] = []

    def start(engine: FakeEngine | None = None, **settings: Any) -> LiveServer:
        server = LiveServer(engine, **settings).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A new, empty SQLite file (the daemon creates the schema)."""
    return f"sqlite:///{tmp_path / 'telemetry.db'}"
