"""Revision 0012: steps gain `grammar_ms` and `constrained_rows`; old rows read 0 (through the
tuner's read path too); the writer fills them; down and up."""

from __future__ import annotations

from collections.abc import Callable

from engine.types import StepStats
from telemetry.writer import step_row
from tests.store.migration_helpers import read_all_steps, record_without, round_trip
from tests.store.test_migrate_plain_rows import OLD_STEP


def test_0012_adds_grammar_time_and_rows_old_rows_read_zero(db_url: str,
                                                            run_sql: Callable[..., list]) -> None:
    stats = StepStats(step_id=2, time=1_700_000_010.0, batch_size=5, decode_tokens=8, step_ms=3.0,
                      tenants=("acme",), grammar_ms=0.75, constrained_rows=2)

    def old_row_reads_zero() -> None:  # a row written before the columns existed
        assert run_sql("SELECT step_id, grammar_ms, constrained_rows FROM xo_steps") == [(1, 0.0, 0)]

    def written_and_read_back() -> None:  # the writer and the reader (at head) follow the model
        rows = run_sql("SELECT step_id, grammar_ms, constrained_rows FROM xo_steps ORDER BY step_id")
        assert rows == [(1, 0.0, 0), (2, 0.75, 2)]
        old, new = read_all_steps(db_url)
        assert (old.grammar_ms, old.constrained_rows) == (0.0, 0) and new == stats

    round_trip(db_url, run_sql, previous="0011", revision="0012",
               added={"xo_steps.grammar_ms", "xo_steps.constrained_rows"}, old_steps=[OLD_STEP],
               check_old=old_row_reads_zero, new_steps=[stats], check_new=written_and_read_back)


def test_step_row_defaults_the_grammar_columns_for_records_without_them() -> None:
    assert step_row(record_without("grammar_ms"))["grammar_ms"] == 0.0
    assert step_row(record_without("constrained_rows"))["constrained_rows"] == 0
    assert step_row(StepStats(grammar_ms=2.5, constrained_rows=1))["constrained_rows"] == 1
