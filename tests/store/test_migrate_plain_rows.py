"""Revision 0011: steps gain `plain_rows`; old rows read 0 (through the tuner's read path too);
the writer fills it; down and up."""

from __future__ import annotations

from collections.abc import Callable

from engine.types import RowClass, StepStats
from telemetry.writer import step_row
from tests.store.migration_helpers import read_all_steps, record_without, round_trip

OLD_STEP = (
    "INSERT INTO xo_steps (instance, step_id, time, batch_size, prefill_tokens, decode_tokens, "
    "technique, depth, proposed, accepted, accepted_per_pos, propose_ms, verify_ms, step_ms, "
    "kv_pages_used, kv_pages_free, queue_len, policy_version, preempted, sampled_rows, "
    "prefix_hit_tokens, prefix_query_tokens, tenants, row_classes) VALUES "
    "('', 1, 1700000005.0, 2, 0, 3, 'ngram', 2, 4, 1, '[1, 0]', 0.1, 2.0, 2.5, 1, 9, 0, 0, 0, 0, 0, 0, "
    "'[\"acme\"]', NULL)"
)
CLASSES = (RowClass("acme", "ngram", 4, 2, 7, 3, (2, 1, 0, 0)), RowClass("initech", "none", 0, 3))


def test_0011_adds_plain_rows_old_rows_read_zero(db_url: str, run_sql: Callable[..., list]) -> None:
    stats = StepStats(step_id=2, time=1_700_000_010.0, batch_size=5, decode_tokens=8, technique="ngram",
                      depth=4, proposed=7, accepted=3, accepted_per_pos=(2, 1, 0, 0), step_ms=3.0,
                      tenants=("acme", "initech"), row_classes=CLASSES, plain_rows=3)

    def old_row_reads_zero() -> None:  # a row written before the column existed
        assert run_sql("SELECT step_id, plain_rows FROM xo_steps") == [(1, 0)]

    def count_written_and_read_back() -> None:  # the writer and the reader (at head) follow the model
        assert run_sql("SELECT step_id, plain_rows FROM xo_steps ORDER BY step_id") == [(1, 0), (2, 3)]
        old, new = read_all_steps(db_url)
        assert old.plain_rows == 0 and new == stats and new.plain_rows == 3

    round_trip(db_url, run_sql, previous="0010", revision="0011", added={"xo_steps.plain_rows"},
               old_steps=[OLD_STEP], check_old=old_row_reads_zero, new_steps=[stats],
               check_new=count_written_and_read_back)


def test_step_row_defaults_plain_rows_for_records_without_it() -> None:
    assert step_row(record_without("plain_rows"))["plain_rows"] == 0
    assert step_row(StepStats(plain_rows=3))["plain_rows"] == 3
