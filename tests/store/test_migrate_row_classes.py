"""Revision 0009: steps gain `row_classes`; old rows read NULL (no classes, through the tuner's read
path); the writer fills it with one object per class; down and up."""

from __future__ import annotations

from collections.abc import Callable

from engine.types import RowClass, StepStats
from telemetry.writer import step_row
from tests.store.migration_helpers import read_all_steps, record_without, round_trip

OLD_STEP = (
    "INSERT INTO xo_steps (instance, step_id, time, batch_size, prefill_tokens, decode_tokens, "
    "technique, depth, proposed, accepted, accepted_per_pos, propose_ms, verify_ms, step_ms, "
    "kv_pages_used, kv_pages_free, queue_len, policy_version, preempted, sampled_rows, "
    "prefix_hit_tokens, prefix_query_tokens, tenants) VALUES "
    "('', 1, 1700000005.0, 2, 0, 3, 'ngram', 2, 4, 1, '[1, 0]', 0.1, 2.0, 2.5, 1, 9, 0, 0, 0, 0, 0, 0, "
    "'[\"acme\"]')"
)
CLASSES = (RowClass("acme", "ngram", 4, 2, 7, 3, (2, 1, 0, 0)), RowClass("globex", "mtp", 2, 1, 2, 2, (1, 1)),
           RowClass("initech", "none", 0, 1))


def test_0009_adds_row_classes_old_rows_read_none(db_url: str, run_sql: Callable[..., list]) -> None:
    stats = StepStats(step_id=2, time=1_700_000_010.0, batch_size=4, decode_tokens=9, technique="ngram",
                      depth=4, proposed=9, accepted=5, accepted_per_pos=(3, 2, 0, 0), step_ms=3.0,
                      tenants=("acme", "globex", "initech"), row_classes=CLASSES)

    def old_row_reads_none() -> None:  # a row written before the column existed
        assert run_sql("SELECT row_classes FROM xo_steps") == [(None,)]

    def classes_written() -> None:  # the writer reads the column off the model; the tuner reads
        old, new = read_all_steps(db_url)  # at head (its read path names later revisions' columns too)
        assert old.row_classes == () and old.accepted_per_pos == (1, 0)
        assert new == stats and new.row_classes == CLASSES

    round_trip(db_url, run_sql, previous="0008", revision="0009", added={"xo_steps.row_classes"},
               old_steps=[OLD_STEP], check_old=old_row_reads_none, new_steps=[stats],
               check_new=classes_written)


def test_step_row_writes_null_for_records_without_row_classes() -> None:
    assert step_row(record_without("row_classes"))["row_classes"] is None
    assert step_row(StepStats())["row_classes"] == []
    assert step_row(StepStats(row_classes=CLASSES[2:]))["row_classes"] == [
        {"tenant": "initech", "technique": "none", "depth": 0, "rows": 1, "proposed": 0, "accepted": 0,
         "accepted_per_pos": []}]
