"""Revision 0008: steps gain the prefix-cache counts; old rows read 0; the writer fills them; down
and up."""

from __future__ import annotations

from collections.abc import Callable

from alembic import command
from sqlalchemy import inspect

from engine.types import StepStats
from store import migrate
from store.db import make_engine
from telemetry.writer import step_row, write_rows

OLD_STEP = (
    "INSERT INTO xo_steps (instance, step_id, time, batch_size, prefill_tokens, decode_tokens, "
    "technique, depth, proposed, accepted, accepted_per_pos, propose_ms, verify_ms, step_ms, "
    "kv_pages_used, kv_pages_free, queue_len, policy_version, preempted, sampled_rows, tenants) VALUES "
    "('', 1, 1700000005.0, 2, 40, 6, 'none', 0, 0, 0, '[]', 0.0, 2.0, 2.5, 1, 9, 0, 0, 0, 0, "
    "'[\"acme\"]')"
)
NEW = {"prefix_hit_tokens", "prefix_query_tokens"}


def _step_columns(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("xo_steps")}
    finally:
        engine.dispose()


def test_0008_adds_prefix_counts_old_rows_read_zero(db_url: str, run_sql: Callable[..., list]) -> None:
    cfg = migrate.alembic_config(db_url)
    command.downgrade(cfg, "0007")
    assert not NEW & _step_columns(db_url)
    run_sql(OLD_STEP)  # a row written before the columns existed
    command.upgrade(cfg, "0008")
    assert NEW <= _step_columns(db_url)
    assert run_sql("SELECT prefix_hit_tokens, prefix_query_tokens FROM xo_steps") == [(0, 0)]
    migrate.upgrade(db_url)  # the writer writes every column of the model (later revisions' too)
    engine = make_engine(db_url)
    with engine.begin() as conn:  # the writer reads the columns off the model
        write_rows(conn, [step_row(StepStats(step_id=2, time=1_700_000_010.0, batch_size=1, prefill_tokens=9,
                                             prefix_hit_tokens=48, prefix_query_tokens=57, tenants=("a",)))],
                   [])  # fmt: skip
    engine.dispose()
    [(hits, queries)] = run_sql("SELECT SUM(prefix_hit_tokens), SUM(prefix_query_tokens) FROM xo_steps")
    assert (hits, queries) == (48, 57)
    assert run_sql("SELECT SUM(steps) FROM xo_v_steps_minute") == [(2,)]  # the views read the table still
    command.downgrade(cfg, "0007")
    assert not NEW & _step_columns(db_url)
    assert run_sql("SELECT step_id FROM xo_steps ORDER BY step_id") == [(1,), (2,)]
    assert run_sql("SELECT SUM(steps) FROM xo_v_steps_minute") == [(2,)]
    migrate.upgrade(db_url)
    assert migrate.check_schema(db_url) == migrate.head_revision()


def test_step_row_defaults_prefix_counts_for_records_without_them() -> None:
    class Old:  # a record type from before the fields
        def __getattr__(self, name: str) -> object:
            if name in NEW:
                raise AttributeError(name)
            return getattr(StepStats(), name)

    assert step_row(Old())["prefix_hit_tokens"] == step_row(Old())["prefix_query_tokens"] == 0
    assert step_row(StepStats(prefix_hit_tokens=5))["prefix_hit_tokens"] == 5
