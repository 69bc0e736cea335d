"""Fixtures for store tests: a real SQLite file per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from store.migrate import upgrade

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A fresh database file at head."""
    url = f"sqlite:///{tmp_path / 'telemetry.db'}"
    upgrade(url)
    return url


@pytest.fixture
def rev1_url(tmp_path: Path) -> str:
    """A copy of the committed first-revision database."""
    path = tmp_path / "rev1.db"
    shutil.copyfile(FIXTURES / "telemetry_rev1.sqlite", path)
    return f"sqlite:///{path}"
