"""Revision 0013: steps gain `cut_tokens`; old rows read 0 (through the tuner's read path too);
the writer fills it; down and up."""

from __future__ import annotations

from collections.abc import Callable

from engine.types import StepStats
from telemetry.writer import step_row
from tests.store.migration_helpers import read_all_steps, record_without, round_trip
from tests.store.test_migrate_plain_rows import OLD_STEP


def test_0013_adds_cut_tokens_old_rows_read_zero(db_url: str, run_sql: Callable[..., list]) -> None:
    stats = StepStats(step_id=2, time=1_700_000_010.0, batch_size=2, decode_tokens=5, technique="ngram",
                      depth=4, proposed=8, accepted=3, accepted_per_pos=(2, 1, 0, 0), step_ms=3.0,
                      tenants=("acme",), cut_tokens=4)

    def old_row_reads_zero() -> None:  # a row written before the column existed
        assert run_sql("SELECT step_id, decode_tokens, cut_tokens FROM xo_steps") == [(1, 3, 0)]

    def written_and_read_back() -> None:  # the writer and the reader (at head) follow the model
        rows = run_sql("SELECT step_id, decode_tokens, cut_tokens FROM xo_steps ORDER BY step_id")
        assert rows == [(1, 3, 0), (2, 5, 4)]
        old, new = read_all_steps(db_url)
        assert old.cut_tokens == 0 and new == stats

    round_trip(db_url, run_sql, previous="0012", revision="0013", added={"xo_steps.cut_tokens"},
               old_steps=[OLD_STEP], check_old=old_row_reads_zero, new_steps=[stats],
               check_new=written_and_read_back)


def test_step_row_defaults_cut_tokens_for_records_without_it() -> None:
    assert step_row(record_without("cut_tokens"))["cut_tokens"] == 0
    assert step_row(StepStats(cut_tokens=3))["cut_tokens"] == 3
