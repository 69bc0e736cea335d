"""What the tests of one revision share: the schema's names, writing steps, and the
down / old row / up / write / down / up story every revision that touches `xo_steps` tells."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from alembic import command
from sqlalchemy import inspect

from engine.types import StepStats
from store import migrate
from store.db import make_engine, session_scope
from telemetry.writer import step_row, write_rows

RunSql = Callable[..., list]


def read_all_steps(url: str) -> list[StepStats]:
    """Every step of the database, through the tuner's read path (tuner.data.read_steps)."""
    from tuner.data import read_steps

    engine = make_engine(url)
    try:
        with session_scope(engine) as session:
            return read_steps(session, 0.0)
    finally:
        engine.dispose()


def schema_names(url: str) -> set[str]:
    """Every table and view of the database, and every column as "table.column"."""
    engine = make_engine(url)
    try:
        found = inspect(engine)
        tables = set(found.get_table_names())
        columns = {f"{t}.{c['name']}" for t in tables for c in found.get_columns(t)}
        return tables | set(found.get_view_names()) | columns
    finally:
        engine.dispose()


def step_columns(url: str) -> set[str]:
    """The columns of `xo_steps`."""
    return {n.removeprefix("xo_steps.") for n in schema_names(url) if n.startswith("xo_steps.")}


def write_steps(url: str, steps: Sequence[StepStats]) -> None:
    """Write step records through the telemetry writer, in one transaction."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            write_rows(conn, [step_row(s) for s in steps], [])
    finally:
        engine.dispose()


def record_without(*names: str) -> object:
    """A step record of a type from before the named fields: StepStats' attributes but those."""

    class Old:
        def __getattr__(self, name: str) -> object:
            if name in names:
                raise AttributeError(name)
            return getattr(StepStats(), name)

    return Old()


def round_trip(url: str, run_sql: RunSql, *, previous: str, revision: str, added: set[str],
               old_steps: Sequence[str], check_old: Callable[[], None],
               new_steps: Sequence[StepStats], check_new: Callable[[], None],
               check_down: Callable[[], None] = lambda: None) -> None:
    """One revision's story on `url` (at head), asserting each step:

    1. down to `previous`: none of `added` (names as `schema_names` gives them) is there;
    2. `old_steps` (INSERT statements) write rows as a daemon at `previous` would;
    3. up to `revision`: `added` is there, `check_old()` reads the old rows;
    4. up to head, `new_steps` through the telemetry writer, `check_new()`; the views count
       every step;
    5. down to `previous` again: `added` gone, every step kept and in the views, `check_down()`;
    6. up to head: the schema is at head.
    """
    cfg = migrate.alembic_config(url)
    command.downgrade(cfg, previous)
    assert not added & schema_names(url)
    for statement in old_steps:
        run_sql(statement)
    ids = sorted(run_sql("SELECT step_id FROM xo_steps") + [(s.step_id,) for s in new_steps])
    command.upgrade(cfg, revision)
    assert added <= schema_names(url)
    check_old()
    migrate.upgrade(url)  # the writer writes every column of the models (later revisions' too)
    write_steps(url, new_steps)
    check_new()
    assert run_sql("SELECT SUM(steps) FROM xo_v_steps_minute") == [(len(ids),
                                                                    )]  # the views read the table still
    command.downgrade(cfg, previous)
    assert not added & schema_names(url)
    assert run_sql("SELECT step_id FROM xo_steps ORDER BY step_id") == ids
    assert run_sql("SELECT SUM(steps) FROM xo_v_steps_minute") == [(len(ids),)]
    check_down()
    migrate.upgrade(url)
    assert migrate.check_schema(url) == migrate.head_revision()
