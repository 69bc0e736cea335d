"""Fixtures for telemetry tests: a real SQLite file per test, at head."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine

from store.db import make_engine
from store.migrate import upgrade


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'telemetry.db'}"
    upgrade(url)
    return url


@pytest.fixture
def engine(db_url: str) -> Engine:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()
