"""Revisions 0011-0013, each adding counters to `xo_steps`: old rows read 0 (through the tuner's
read path too); the writer fills the new columns; down and up; a record type from before the
columns is written with the defaults."""

from __future__ import annotations

from collections.abc import Callable

import pytest

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
"""A step as a daemon at 0010 wrote it."""
CLASSES = (RowClass("acme", "ngram", 4, 2, 7, 3, (2, 1, 0, 0)), RowClass("initech", "none", 0, 3))
SPEC = {"technique": "ngram", "depth": 4, "proposed": 7, "accepted": 3, "accepted_per_pos": (2, 1, 0, 0)}

# (previous, revision, the columns added with the value the new step writes, the new step's other fields)
REVISIONS = [
    ("0010", "0011", {"plain_rows": 3}, {"batch_size": 5, "tenants": ("acme", "initech"),
                                         "row_classes": CLASSES, **SPEC}),
    ("0011", "0012", {"grammar_ms": 0.75, "constrained_rows": 2}, {"batch_size": 5, "tenants": ("acme",)}),
    ("0012", "0013", {"cut_tokens": 4}, {"batch_size": 2, "tenants": ("acme",), **SPEC}),
]


@pytest.mark.parametrize(("previous", "revision", "added", "fields"), REVISIONS,
                         ids=[r[1] for r in REVISIONS])
def test_added_step_columns_old_rows_read_zero(db_url: str, run_sql: Callable[..., list], previous: str,
                                               revision: str, added: dict, fields: dict) -> None:
    stats = StepStats(step_id=2, time=1_700_000_010.0, decode_tokens=8, step_ms=3.0, **fields, **added)
    columns = ", ".join(added)
    zeros = tuple(0 for _ in added)

    def old_row_reads_zero() -> None:  # a row written before the columns existed
        assert run_sql(f"SELECT step_id, {columns} FROM xo_steps") == [(1, *zeros)]

    def written_and_read_back() -> None:  # the writer and the reader (at head) follow the model
        rows = run_sql(f"SELECT step_id, {columns} FROM xo_steps ORDER BY step_id")
        assert rows == [(1, *zeros), (2, *added.values())]
        old, new = read_all_steps(db_url)
        assert all(getattr(old, name) == 0 for name in added) and new == stats

    round_trip(db_url, run_sql, previous=previous, revision=revision,
               added={f"xo_steps.{name}" for name in added}, old_steps=[OLD_STEP],
               check_old=old_row_reads_zero, new_steps=[stats], check_new=written_and_read_back)


@pytest.mark.parametrize("added", [r[2] for r in REVISIONS], ids=[r[1] for r in REVISIONS])
def test_step_row_defaults_the_added_columns_for_records_without_them(added: dict) -> None:
    old = step_row(record_without(*added))
    assert all(old[name] == 0 for name in added)
    new = step_row(StepStats(**added))
    assert all(new[name] == value for name, value in added.items())
