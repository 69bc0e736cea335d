"""Suite-wide fixtures.

XLA:CPU maps a few memory regions for the machine code of every executable it
compiles (about six per executable), and keeps them while the executable is
cached. The suite builds hundreds of engines and compiles tens of thousands of
executables in one process; left alone their mappings pass Linux's
`vm.max_map_count` (65530 by default), and the next compile then dies inside
LLVM with SIGSEGV or SIGABRT. So after each test module, once the process
holds many mappings or much memory, the in-memory compilation caches are
dropped (engines still in use recompile, from the persistent cache, on their
next call).

Two workers (`make test` runs `pytest -n 2 --dist loadgroup`, pytest-xdist):
the tests marked `slow` (the real model: several GiB each while compiled) all
go to one worker, one after another, so two real engines never share the
machine's memory; every other file goes whole to one worker (its module
fixtures build once) and runs beside them. Each worker clears its compiled
code at a lower memory mark than a lone process does.

Databases: `db_url` / `db` are a fresh database at head. In tests/store,
tests/telemetry and tests/tuner they are parametrized over SQLite and
PostgreSQL (`[sqlite]`, `[postgresql]` in the test id); elsewhere they are
SQLite. PostgreSQL comes from the server at $CROSSOVER_TEST_PG_URL (else the
local defaults in PG_CANDIDATES): a migrated template database is made once
per session and each test gets `CREATE DATABASE ... TEMPLATE` of it, dropped
after. Without a reachable server the `[postgresql]` tests are skipped, with
the reason. `@pytest.mark.sqlite_only(reason)` keeps a test on SQLite;
`pg_url` asks for PostgreSQL alone.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from store.db import make_engine
from store.migrate import upgrade

FIXTURES = Path(__file__).resolve().parent / "fixtures"
"""Committed data files the tests read (old databases, golden outputs)."""

MAPS_BEFORE_CLEARING = 20_000
"""Clear the compilation caches after a module once the process has this many mappings."""
RSS_BEFORE_CLEARING = (4 << 30) if os.environ.get("PYTEST_XDIST_WORKER") else (6 << 30)
"""... or once it holds this much memory: each compiled real-model forward keeps tens of MiB of
host memory while cached, and the suite's one process reached 17 GB of the machine's 24 (two
workers share those 24, hence the lower mark there)."""

REAL_MODEL_GROUP = "real-model"
"""The pytest-xdist group of every `slow` test: one worker runs them all."""


def _mappings() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count, and no such limit
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    yield
    if _mappings() > MAPS_BEFORE_CLEARING or psutil.Process().memory_info().rss > RSS_BEFORE_CLEARING:
        import jax

        from engine.runtime.compiles import trim_heap

        jax.clear_caches()
        gc.collect()
        trim_heap()  # hand the freed executables' memory back to the system


PG_ENV = "CROSSOVER_TEST_PG_URL"
"""A PostgreSQL server URL (any database on it; the tests create and drop their own)."""

PG_CANDIDATES = (
    "postgresql+psycopg://postgres@/postgres?host=/var/run/postgresql",
    "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres",  # what .ci/run sets up
)
"""Tried in order when $CROSSOVER_TEST_PG_URL is unset."""

BOTH_BACKENDS = ("store", "telemetry", "tuner")
"""Test folders whose `db_url`/`db` tests run on SQLite and on PostgreSQL."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sqlite_only(reason): the test checks something only SQLite has; "
        "it does not run on PostgreSQL")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's loadgroup: `slow` tests in one group, every other file a group of its own."""
    for item in items:
        group = REAL_MODEL_GROUP if item.get_closest_marker("slow") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a loadgroup worker, stop unless pytest-xdist took the groups (it appends each to the node
    id): pytest 9.2 keeps node ids where xdist 3.8 cannot, and the real-model tests then ran on
    both workers at once and module fixtures were built on each (pyproject.toml pins pytest)."""
    if not getattr(session.config.option, "loadgroup", False):  # set on xdist workers only
        return
    lost = [i.nodeid for i in session.items if "@" not in i.nodeid.rpartition("::")[2]]
    if lost:
        pytest.exit(f"pytest-xdist's loadgroup did not group {len(lost)} tests (e.g. {lost[0]}); "
                    f"pytest {pytest.__version__} may not work with this pytest-xdist", returncode=3)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run `db_backend` (hence `db_url`, `db`) tests in BOTH_BACKENDS on both databases."""
    if "db_backend" not in metafunc.fixturenames:
        return
    parts = metafunc.definition.path.relative_to(Path(__file__).parent).parts
    if parts[0] not in BOTH_BACKENDS:
        return  # the fixture's default: SQLite, no parameter in the test id
    only = metafunc.definition.get_closest_marker("sqlite_only")
    metafunc.parametrize("db_backend", ["sqlite"] if only else ["sqlite", "postgresql"],
                         indirect=True)


class PgServer:
    """A reachable PostgreSQL server: a migrated template database, and fresh copies of it.

    CREATE DATABASE ... TEMPLATE copies the migrated schema in a few tens of
    milliseconds, far less than running the migrations for every test.
    """

    def __init__(self, url: str) -> None:
        self.url = make_url(url)
        self.admin = make_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        self.prefix = f"xo_test_{os.getpid()}_"
        self.count = 0
        self.template = self.prefix + "template"
        self._drop_leftovers()
        self._execute(f'CREATE DATABASE "{self.template}"')
        upgrade(self.url_of(self.template))

    def url_of(self, name: str) -> str:
        return self.url.set(database=name).render_as_string(hide_password=False)

    def _execute(self, statement: str) -> list:
        with self.admin.connect() as conn:
            result = conn.execute(text(statement))
            return result.fetchall() if result.returns_rows else []

    def _drop_leftovers(self) -> None:
        """Databases of earlier test runs that died before dropping them."""
        for (name,) in self._execute("SELECT datname FROM pg_database WHERE datname LIKE 'xo_test_%'"):
            pid = name.split("_")[2]
            if pid.isdigit() and not _alive(int(pid)):
                self.drop(name)

    def create(self, migrated: bool = True) -> str:
        """A fresh database, at head or empty; its URL."""
        self.count += 1
        name = f"{self.prefix}{self.count}"
        template = self.template if migrated else "template0"
        self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return self.url_of(name)

    def drop(self, name: str) -> None:
        self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        self.drop(self.template)
        self.admin.dispose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _connect_pg() -> tuple[PgServer | None, str]:
    """The first reachable server (None and why, when there is none)."""
    given = os.environ.get(PG_ENV)
    candidates = (given,) if given else PG_CANDIDATES
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "psycopg is not installed (pip install '.[postgres]')"
    errors = []
    for url in candidates:
        probe = make_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 3})
        try:
            with probe.connect():
                pass
        except Exception as exc:  # any failure means "not reachable"
            shown = make_url(url).render_as_string(hide_password=True)
            errors.append(f"{shown}: {str(exc).splitlines()[0]}")
            continue
        finally:
            probe.dispose()
        return PgServer(url), ""
    where = f"${PG_ENV}" if given else f"${PG_ENV} unset, tried"
    return None, f"no PostgreSQL server reachable ({where} {'; '.join(errors)})"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's PostgreSQL server; skips the test when none is reachable."""
    server, why = _connect_pg()
    if server is None:
        pytest.skip(why)
    yield server
    server.close()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh PostgreSQL database at head, dropped after the test (skips without a server)."""
    url = pg_server.create()
    yield url
    pg_server.drop(make_url(url).database)


@pytest.fixture
def db_backend(request: pytest.FixtureRequest) -> str:
    """"sqlite" or "postgresql" (parametrized in BOTH_BACKENDS folders, else SQLite)."""
    return getattr(request, "param", "sqlite")


@pytest.fixture
def db_url(db_backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A fresh database migrated to head: a SQLite file, or a PostgreSQL database."""
    if db_backend == "postgresql":
        return request.getfixturevalue("pg_url")
    url = f"sqlite:///{tmp_path / 'telemetry.db'}"
    upgrade(url)
    return url


@pytest.fixture
def empty_db_url(db_backend: str, tmp_path: Path,
                 request: pytest.FixtureRequest) -> Iterator[str]:
    """A database without any table (no schema yet), on the same backends as `db_url`."""
    if db_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    server: PgServer = request.getfixturevalue("pg_server")
    url = server.create(migrated=False)
    yield url
    server.drop(make_url(url).database)


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    """A SQLAlchemy engine on `db_url`, disposed after the test."""
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def run_sql(db_url: str) -> Callable[..., list[tuple]]:
    """`run_sql(query, **params)`: the rows of one statement on `db_url`, committed
    (plain SQL through SQLAlchemy, so one test reads both databases)."""

    def run(query: str, **params: object) -> list[tuple]:
        engine = make_engine(db_url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                result = conn.execute(text(query), params)
                return [tuple(r) for r in result] if result.returns_rows else []
        finally:
            engine.dispose()

    return run


@pytest.fixture
def rev1_url(tmp_path: Path) -> str:
    """A copy of the committed database at schema revision 0001 (older than head)."""
    path = tmp_path / "rev1.db"
    shutil.copyfile(FIXTURES / "telemetry_rev1.sqlite", path)
    return f"sqlite:///{path}"

