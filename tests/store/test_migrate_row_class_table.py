"""Revision 0010: row classes get their table (filled from the steps' `row_classes`, written with
each step) and the acceptance views count per row class; down restores 0009's views; up again."""

from __future__ import annotations

import doctest
import importlib
from collections.abc import Callable

from alembic import command

from engine.types import RowClass, StepStats
from store import migrate
from tests.store.migration_helpers import round_trip, schema_names

T = 1_700_000_041.0  # inside the minute starting at 1_700_000_040
COLUMNS = (
    "instance, step_id, time, batch_size, prefill_tokens, decode_tokens, technique, depth, proposed, "
    "accepted, accepted_per_pos, propose_ms, verify_ms, step_ms, kv_pages_used, kv_pages_free, "
    "queue_len, policy_version, preempted, sampled_rows, prefix_hit_tokens, prefix_query_tokens, "
    "tenants, row_classes"
)
MIXED_CLASSES = (
    '[{"tenant": "copy", "technique": "ngram", "depth": 4, "rows": 2, "proposed": 8, "accepted": 5, '
    '"accepted_per_pos": [2, 2, 1, 0]}, {"tenant": "chat", "technique": "mtp", "depth": 2, "rows": 1, '
    '"proposed": 2, "accepted": 1, "accepted_per_pos": [1, 0]}, {"tenant": "prose", "technique": "none", '
    '"depth": 0, "rows": 1, "proposed": 0, "accepted": 0, "accepted_per_pos": []}]'
)


def _old_step(step_id: int, technique: str, depth: int, proposed: int, accepted: int, per_pos: str,
              row_classes: str, instance: str = "") -> str:
    """An INSERT of a step as a daemon at revision 0009 wrote it (row_classes as SQL text)."""
    return (f"INSERT INTO xo_steps ({COLUMNS}) VALUES ('{instance}', {step_id}, {T + step_id}, 4, 0, 9, "
            f"'{technique}', {depth}, {proposed}, {accepted}, '{per_pos}', 0.1, 2.0, 2.5, 1, 9, 0, 0, 0, "
            f"0, 0, 0, '[\"copy\"]', {row_classes})")


OLD_STEPS = [
    # mixed: two copy rows n-gram 4 deep, one chat row MTP 2 deep, a prose row that did not draft
    _old_step(1, "ngram", 4, 10, 6, "[3, 2, 1, 0]", f"'{MIXED_CLASSES}'"),
    _old_step(2, "ngram", 2, 4, 1, "[1, 0]", "NULL"),  # from before 0009: no classes
    _old_step(3, "none", 0, 0, 0, "[]", "'[]'"),  # no decode rows
    _old_step(4, "ngram", 2, 4, 1, "[1, 0]", "'null'", instance="b"),  # JSON null: no classes
]
ADDED = {"xo_step_row_classes", "xo_step_row_classes.tenant", "xo_v_tenant_acceptance"}
ACCEPTANCE = ("SELECT technique, depth, steps, proposed, accepted FROM xo_v_acceptance "
              "ORDER BY technique, depth")


def test_0010_fills_the_table_and_splits_acceptance_per_class(
    db_url: str, run_sql: Callable[..., list]
) -> None:
    new = StepStats(step_id=5, time=T + 5, batch_size=2, decode_tokens=4, technique="mtp", depth=2,
                    proposed=4, accepted=3, accepted_per_pos=(2, 1), tenants=("chat", "copy"),
                    row_classes=(RowClass("chat", "mtp", 2, 1, 2, 2, (1, 1)),
                                 RowClass("copy", "ngram", 2, 1, 2, 1, (1, 0))))

    def backfilled() -> None:  # the classes of the stored steps, pointing at their steps
        assert run_sql(
            "SELECT s.step_id, c.instance, c.time, c.tenant, c.technique, c.depth, c.rows, c.proposed, "
            "c.accepted FROM xo_step_row_classes AS c JOIN xo_steps AS s ON s.id = c.step ORDER BY c.id"
        ) == [(1, "", T + 1, "copy", "ngram", 4, 2, 8, 5), (1, "", T + 1, "chat", "mtp", 2, 1, 2, 1),
              (1, "", T + 1, "prose", "none", 0, 1, 0, 0)]  # fmt: skip
        # the mixed step's drafts under each class's technique and depth; steps under their own
        assert run_sql(ACCEPTANCE) == [("mtp", 2, 0, 2, 1), ("ngram", 2, 2, 8, 2), ("ngram", 4, 1, 8, 5),
                                       ("none", 0, 1, 0, 0)]  # fmt: skip

    def written() -> None:  # the writer adds the new step's classes with it
        assert run_sql(
            "SELECT s.step_id, c.tenant, c.technique, c.accepted FROM xo_step_row_classes AS c "
            "JOIN xo_steps AS s ON s.id = c.step WHERE s.step_id = 5 ORDER BY c.id"
        ) == [(5, "chat", "mtp", 2), (5, "copy", "ngram", 1)]
        assert run_sql(ACCEPTANCE) == [("mtp", 2, 1, 4, 3), ("ngram", 2, 2, 10, 3), ("ngram", 4, 1, 8, 5),
                                       ("none", 0, 1, 0, 0)]  # fmt: skip

    def zero_nine_views() -> None:  # 0009's view: the steps' recorded technique and depth
        assert run_sql(ACCEPTANCE) == [("mtp", 2, 1, 4, 3), ("ngram", 2, 2, 8, 2), ("ngram", 4, 1, 10, 6),
                                       ("none", 0, 1, 0, 0)]  # fmt: skip

    round_trip(db_url, run_sql, previous="0009", revision="0010", added=ADDED, old_steps=OLD_STEPS,
               check_old=backfilled, new_steps=[new], check_new=written, check_down=zero_nine_views)
    # up again: the table is filled anew from row_classes, the new step's classes too
    assert run_sql("SELECT COUNT(*) FROM xo_step_row_classes") == [(5,)]
    assert run_sql(ACCEPTANCE) == [("mtp", 2, 1, 4, 3), ("ngram", 2, 2, 10, 3), ("ngram", 4, 1, 8, 5),
                                   ("none", 0, 1, 0, 0)]  # fmt: skip


def test_tenant_acceptance_view(db_url: str, run_sql: Callable[..., list]) -> None:
    command.downgrade(migrate.alembic_config(db_url), "0009")
    for statement in OLD_STEPS:
        run_sql(statement)
    migrate.upgrade(db_url)
    rows = run_sql("SELECT minute_start, tenant, technique, depth, rows, proposed, accepted, "
                   "acceptance_rate FROM xo_v_tenant_acceptance ORDER BY tenant")
    assert [tuple(r[:7]) for r in rows] == [
        (T - 1, "chat", "mtp", 2, 1, 2, 1), (T - 1, "copy", "ngram", 4, 2, 8, 5),
        (T - 1, "prose", "none", 0, 1, 0, 0)]  # fmt: skip
    assert [None if r[7] is None else float(r[7]) for r in rows] == [0.5, 0.625, None]


def test_downgrade_drops_the_table_and_the_view(db_url: str) -> None:
    assert ADDED <= schema_names(db_url)
    command.downgrade(migrate.alembic_config(db_url), "0009")
    names = schema_names(db_url)
    assert not ADDED & names and {"xo_v_acceptance", "xo_v_steps_minute"} <= names
    migrate.upgrade(db_url)
    assert ADDED <= schema_names(db_url)


def test_the_revisions_examples_run() -> None:
    """migrations/ is outside tests/test_doctests.py (env.py runs only inside Alembic)."""
    module = importlib.import_module("migrations.versions.0010_step_row_classes_table")
    results = doctest.testmod(module)
    assert results.attempted >= 1 and results.failed == 0
