"""Suite-wide fixtures.

XLA:CPU maps a few memory regions for the machine code of every executable it
compiles (about six per executable), and keeps them while the executable is
cached. The suite builds hundreds of engines and compiles tens of thousands of
executables in one process; left alone their mappings pass Linux's
`vm.max_map_count` (65530 by default), and the next compile then dies inside
LLVM with SIGSEGV or SIGABRT. So after each test module, once the process
holds many mappings, the in-memory compilation caches are dropped (engines
still in use recompile, from the persistent cache, on their next call).
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from store.db import make_engine
from store.migrate import upgrade

FIXTURES = Path(__file__).resolve().parent / "fixtures"
"""Committed data files the tests read (old databases, golden outputs)."""

MAPS_BEFORE_CLEARING = 20_000
"""Clear the compilation caches after a module once the process has this many mappings."""


def _mappings() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count, and no such limit
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    yield
    if _mappings() > MAPS_BEFORE_CLEARING:
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A fresh SQLite database file, migrated to head."""
    url = f"sqlite:///{tmp_path / 'telemetry.db'}"
    upgrade(url)
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    """A SQLAlchemy engine on `db_url`, disposed after the test."""
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def rev1_url(tmp_path: Path) -> str:
    """A copy of the committed database at schema revision 0001 (older than head)."""
    path = tmp_path / "rev1.db"
    shutil.copyfile(FIXTURES / "telemetry_rev1.sqlite", path)
    return f"sqlite:///{path}"
