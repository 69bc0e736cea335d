"""Revision 0007: steps gain `sampled_rows`; old rows read 0; the writer fills it; down and up."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from alembic import command
from sqlalchemy import inspect

from engine.types import StepStats
from store import migrate
from store.db import make_engine
from telemetry.writer import step_row
from tests.store.migration_helpers import record_without, round_trip, step_columns

OLD_STEP = (
    "INSERT INTO xo_steps (instance, step_id, time, batch_size, prefill_tokens, decode_tokens, "
    "technique, depth, proposed, accepted, accepted_per_pos, propose_ms, verify_ms, step_ms, "
    "kv_pages_used, kv_pages_free, queue_len, policy_version, preempted, tenants) VALUES "
    "('', 1, 1700000005.0, 2, 0, 6, 'ngram', 3, 6, 4, '[3, 1, 0]', 0.1, 2.0, 2.5, 1, 9, 0, 0, 0, "
    "'[\"acme\"]')"
)


def test_0007_adds_sampled_rows_old_rows_read_zero(
    db_url: str, run_sql: Callable[..., list]
) -> None:
    def old_row_reads_zero() -> None:  # a row written before the column existed
        assert run_sql("SELECT step_id, sampled_rows FROM xo_steps") == [(1, 0)]

    def count_written() -> None:  # the writer reads the column off the model
        assert run_sql("SELECT step_id, sampled_rows FROM xo_steps ORDER BY step_id") == [(1, 0), (2, 3)]

    round_trip(db_url, run_sql, previous="0006", revision="0007", added={"xo_steps.sampled_rows"},
               old_steps=[OLD_STEP], check_old=old_row_reads_zero,
               new_steps=[StepStats(step_id=2, time=1_700_000_010.0, batch_size=4, decode_tokens=4,
                                    sampled_rows=3, tenants=("a",))],
               check_new=count_written)  # fmt: skip


def test_step_row_defaults_sampled_rows_for_records_without_it() -> None:
    assert step_row(record_without("sampled_rows"))["sampled_rows"] == 0
    assert step_row(StepStats(sampled_rows=5))["sampled_rows"] == 5


def test_a_downgrade_refused_below_0007_leaves_the_schema_whole(
    db_url: str, run_sql: Callable[..., list]
) -> None:
    """0006's downgrade refuses (two instances share a version) after 0007's batch copy of
    xo_steps ran in the same run: everything rolls back, on SQLite too (migrations/env.py
    opens the transaction before the first DDL), so no copy or dropped view is left."""
    run_sql("INSERT INTO xo_policies (instance, version, body, source, created_at) "
            "VALUES ('', 4, '{}', 'tuner', 1.0), ('a', 4, '{}', 'tuner', 1.0)")
    engine = make_engine(db_url)
    try:
        views = set(inspect(engine).get_view_names())
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    with pytest.raises(RuntimeError, match="several instances"):
        command.downgrade(migrate.alembic_config(db_url), "0005")
    assert migrate.current_revision(db_url) == migrate.head_revision()
    engine = make_engine(db_url)
    try:
        found = inspect(engine)
        assert set(found.get_view_names()) == views and len(views) == 6
        assert set(found.get_table_names()) == tables  # 0010's table too
        assert not [t for t in found.get_table_names() if t.startswith("_alembic_tmp")]
    finally:
        engine.dispose()
    assert "sampled_rows" in step_columns(db_url)
    run_sql("DELETE FROM xo_policies WHERE instance = 'a'")
    command.downgrade(migrate.alembic_config(db_url), "0005")  # and now it goes through
    assert "sampled_rows" not in step_columns(db_url)
