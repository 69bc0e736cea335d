"""Revision 0008: steps gain the prefix-cache counts; old rows read 0; the writer fills them; down
and up."""

from __future__ import annotations

from collections.abc import Callable

from engine.types import StepStats
from telemetry.writer import step_row
from tests.store.migration_helpers import record_without, round_trip

OLD_STEP = (
    "INSERT INTO xo_steps (instance, step_id, time, batch_size, prefill_tokens, decode_tokens, "
    "technique, depth, proposed, accepted, accepted_per_pos, propose_ms, verify_ms, step_ms, "
    "kv_pages_used, kv_pages_free, queue_len, policy_version, preempted, sampled_rows, tenants) VALUES "
    "('', 1, 1700000005.0, 2, 40, 6, 'none', 0, 0, 0, '[]', 0.0, 2.0, 2.5, 1, 9, 0, 0, 0, 0, "
    "'[\"acme\"]')"
)
NEW = {"prefix_hit_tokens", "prefix_query_tokens"}


def test_0008_adds_prefix_counts_old_rows_read_zero(db_url: str, run_sql: Callable[..., list]) -> None:
    def old_row_reads_zero() -> None:  # a row written before the columns existed
        assert run_sql("SELECT prefix_hit_tokens, prefix_query_tokens FROM xo_steps") == [(0, 0)]

    def counts_written() -> None:  # the writer reads the columns off the model
        [(hits, queries)] = run_sql("SELECT SUM(prefix_hit_tokens), SUM(prefix_query_tokens) FROM xo_steps")
        assert (hits, queries) == (48, 57)

    round_trip(db_url, run_sql, previous="0007", revision="0008", added={f"xo_steps.{n}" for n in NEW},
               old_steps=[OLD_STEP], check_old=old_row_reads_zero,
               new_steps=[StepStats(step_id=2, time=1_700_000_010.0, batch_size=1, prefill_tokens=9,
                                    prefix_hit_tokens=48, prefix_query_tokens=57, tenants=("a",))],
               check_new=counts_written)  # fmt: skip


def test_step_row_defaults_prefix_counts_for_records_without_them() -> None:
    old = record_without(*NEW)
    assert step_row(old)["prefix_hit_tokens"] == step_row(old)["prefix_query_tokens"] == 0
    assert step_row(StepStats(prefix_hit_tokens=5))["prefix_hit_tokens"] == 5
