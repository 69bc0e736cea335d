"""`xo_step_row_classes` (revision 0010): written with its step, read by the acceptance views,
aged out with its step.

One step drafts n-gram for one tenant and MTP for another; its step-level
columns say "ngram". The views, read with plain SQL as a dashboard would,
count each class's drafts under its own technique and depth, as the Python
queries and the rollups do, before and after roll-up."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from bench.telemetry import sample_step
from engine.types import RowClass
from store.db import make_engine, session_scope
from store.models import StepRowClass
from telemetry import queries
from telemetry.recorder import Recorder
from telemetry.retention import RetentionConfig, apply_retention
from telemetry.writer import step_row, write_rows

T0 = 1_700_000_040.0  # a minute boundary
COPY_NGRAM = RowClass("copy", "ngram", 4, 2, 8, 5, (2, 2, 1, 0))
CHAT_MTP = RowClass("chat", "mtp", 2, 1, 2, 1, (1, 0))
PROSE_NONE = RowClass("prose", "none", 0, 1)


def _step(t: float, classes: tuple[RowClass, ...] = (), instance: str = "", **fields) -> dict:
    rec = dataclasses.replace(sample_step(0, t), row_classes=classes, **fields)
    if classes:  # step-level sums over the classes, as the engine records them
        rec = dataclasses.replace(rec, proposed=sum(c.proposed for c in classes),
                                  accepted=sum(c.accepted for c in classes))
    return step_row(rec, instance)


STEPS = [
    _step(T0 + 1, (COPY_NGRAM, CHAT_MTP, PROSE_NONE)),  # mixed, recorded as n-gram 4 deep
    _step(T0 + 2),  # no classes (before 0009): n-gram 4 deep, 32 proposed, 11 accepted
    _step(T0 + 61, (COPY_NGRAM,), accepted_per_pos=(2, 2, 1, 0)),  # the next minute, one class
]
ACCEPTANCE = ("SELECT minute_start, technique, depth, steps, proposed, accepted FROM xo_v_acceptance "
              "ORDER BY minute_start, technique, depth")
BY_CLASS = [(T0, "mtp", 2, 0, 2, 1), (T0, "ngram", 4, 2, 8 + 32, 5 + 11), (T0 + 60, "ngram", 4, 1, 8, 5)]
"""xo_v_acceptance of STEPS: each step once under its technique, drafts under each class's."""


def _write(db: Engine, steps: list[dict]) -> None:
    with db.begin() as conn:
        write_rows(conn, steps, [])


def _orphans(run_sql: Callable[..., list]) -> int:
    [(n,)] = run_sql("SELECT COUNT(*) FROM xo_step_row_classes AS c LEFT JOIN xo_steps AS s "
                     "ON s.id = c.step WHERE s.id IS NULL")
    return int(n)


def test_table_mirrors_row_class() -> None:
    """Its columns are RowClass' fields after the step's id, instance and time."""
    columns = [c.name for c in StepRowClass.__table__.columns]
    assert columns == ["id", "step", "instance", "time"] + [f.name for f in dataclasses.fields(RowClass)]


def test_classes_point_at_their_steps(db: Engine, run_sql: Callable[..., list]) -> None:
    """A batch mixing steps with and without classes, after ids with gaps: each class row names
    its own step (SQLite reads the batch's ids back, a server returns them)."""
    _write(db, [_step(T0 - 10.0 - i) for i in range(3)])
    run_sql("DELETE FROM xo_steps WHERE time = :t", t=T0 - 11.0)  # ids with a gap
    batch = [dict(row, step_id=i + 1) for i, row in enumerate(STEPS)]
    batch.insert(1, dict(_step(T0 + 3, (CHAT_MTP,), instance="b"), step_id=9))
    _write(db, batch)
    got = run_sql("SELECT s.step_id, s.instance, s.time, c.instance, c.time, c.tenant, c.technique, "
                  "c.depth, c.rows, c.proposed, c.accepted, c.accepted_per_pos "
                  "FROM xo_step_row_classes AS c JOIN xo_steps AS s ON s.id = c.step ORDER BY c.id")
    classes = [(r[0], r[5:11]) for r in got]
    assert classes == [(1, ("copy", "ngram", 4, 2, 8, 5)), (1, ("chat", "mtp", 2, 1, 2, 1)),
                       (1, ("prose", "none", 0, 1, 0, 0)), (9, ("chat", "mtp", 2, 1, 2, 1)),
                       (3, ("copy", "ngram", 4, 2, 8, 5))]  # fmt: skip
    assert all(r[1:3] == r[3:5] for r in got)  # the step's instance and time
    per_pos = [json.loads(r[11]) if isinstance(r[11], str) else r[11] for r in got]  # SQLite: JSON text
    assert per_pos == [[2, 2, 1, 0], [1, 0], [], [1, 0], [2, 2, 1, 0]]


def test_a_step_and_its_classes_commit_together(db: Engine, run_sql: Callable[..., list]) -> None:
    bad = _step(T0 + 1, (COPY_NGRAM,))
    bad["row_classes"] = [dict(bad["row_classes"][0], tenant=None)]  # refused: tenant is NOT NULL
    with pytest.raises(IntegrityError):
        _write(db, [STEPS[1], bad])
    assert run_sql("SELECT COUNT(*) FROM xo_steps") == [(0,)]
    assert run_sql("SELECT COUNT(*) FROM xo_step_row_classes") == [(0,)]


def test_the_recorder_writes_the_classes(db_url: str, run_sql: Callable[..., list]) -> None:
    stats = dataclasses.replace(sample_step(4, T0 + 1), row_classes=(COPY_NGRAM, PROSE_NONE))
    with Recorder(db_url, instance="host-a") as rec:
        assert rec.record_step(stats)
        assert rec.record_step(sample_step(5, T0 + 2))  # no classes: no rows
    assert run_sql("SELECT s.step_id, c.instance, c.tenant, c.technique FROM xo_step_row_classes AS c "
                   "JOIN xo_steps AS s ON s.id = c.step ORDER BY c.id") == [
        (4, "host-a", "copy", "ngram"), (4, "host-a", "prose", "none")]


def test_acceptance_view_counts_per_class_before_and_after_roll_up(
    db: Engine, run_sql: Callable[..., list]
) -> None:
    """Fails on revision 0009's view, which puts the mixed step's MTP drafts under n-gram."""
    _write(db, STEPS)
    assert run_sql(ACCEPTANCE) == BY_CLASS
    with session_scope(db) as s:
        python = {a.key: (a.count, a.proposed, a.accepted) for a in queries.acceptance_by_technique(s, T0)}
    assert python == {"ngram": (3, 48, 21), "mtp": (0, 2, 1)}  # the Python queries agree
    apply_retention(db, RetentionConfig(raw_steps_s=60.0), now=T0 + 125.0)  # rolls the first minute
    assert run_sql("SELECT COUNT(*) FROM xo_steps") == [(1,)]
    assert run_sql(ACCEPTANCE) == BY_CLASS  # a minute reads the same raw and rolled up


def test_tenant_acceptance_view(db: Engine, run_sql: Callable[..., list]) -> None:
    _write(db, STEPS + [_step(T0 + 5, (dataclasses.replace(COPY_NGRAM, rows=1, proposed=4, accepted=1),),
                              instance="b")])  # fmt: skip
    rows = run_sql("SELECT minute_start, tenant, technique, depth, rows, proposed, accepted, acceptance_rate "
                   "FROM xo_v_tenant_acceptance ORDER BY minute_start, tenant")
    assert [r[:7] for r in rows] == [
        (T0, "chat", "mtp", 2, 1, 2, 1), (T0, "copy", "ngram", 4, 3, 12, 6),  # both instances
        (T0, "prose", "none", 0, 1, 0, 0), (T0 + 60, "copy", "ngram", 4, 2, 8, 5)]  # fmt: skip
    assert [None if r[7] is None else float(r[7]) for r in rows] == [0.5, 0.5, None, 0.625]


def test_classes_age_out_with_their_steps(db: Engine, run_sql: Callable[..., list]) -> None:
    """Roll-up, the too-old path and one instance's retention each take the classes of the steps
    they delete, and only those: no class row outlives its step."""
    old = [_step(T0 - 100 * 86400.0, (CHAT_MTP,))]  # past the rollups window: deleted outright
    other = [_step(T0 + 1, (CHAT_MTP,), instance="b")]  # another daemon's, rolled up by it alone
    _write(db, old + STEPS + other)
    assert run_sql("SELECT COUNT(*) FROM xo_step_row_classes") == [(6,)]
    result = apply_retention(db, RetentionConfig(raw_steps_s=60.0), now=T0 + 125.0, instance="")
    assert (result.deleted_steps, result.rolled_steps) == (1, 2)
    assert run_sql("SELECT c.instance, c.tenant, c.time FROM xo_step_row_classes AS c ORDER BY c.id") == [
        ("", "copy", T0 + 61), ("b", "chat", T0 + 1)]
    assert _orphans(run_sql) == 0
    apply_retention(db, RetentionConfig(raw_steps_s=60.0), now=T0 + 245.0)  # every instance
    assert run_sql("SELECT COUNT(*) FROM xo_steps") == [(0,)]
    assert run_sql("SELECT COUNT(*) FROM xo_step_row_classes") == [(0,)]


def test_deleting_a_step_on_a_server_cascades(pg_url: str) -> None:
    """PostgreSQL enforces the foreign key: a step deleted by hand takes its classes along."""
    engine = make_engine(pg_url)
    try:
        _write(engine, STEPS)
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM xo_steps WHERE time = :t"), {"t": T0 + 1})
            left = conn.execute(text("SELECT tenant FROM xo_step_row_classes")).scalars().all()
    finally:
        engine.dispose()
    assert left == ["copy"]  # the third step's
