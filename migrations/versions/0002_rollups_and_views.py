"""Per-minute step rollups and the dashboard views (xo_v_*).

Views read both raw steps and rollups, so a dashboard sees one continuous
per-minute series whatever the retention window. The minute bucket is
`CAST(time / 60 AS INTEGER) * 60` on SQLite (exact for positive times) and
`FLOOR(time / 60) * 60` elsewhere.

Later revisions that batch-alter `xo_steps`, `xo_step_rollups` or
`xo_requests` on SQLite must drop these views first and re-create them after
(SQLite checks views when a table is renamed). Revisions 0003 to 0009 use
`drop_views()` and `create_views()` from here; from 0010 on, use those of
revision 0010, whose `xo_v_acceptance` counts per row class and which adds
`xo_v_tenant_acceptance` (this module's would bring back the old views).

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
VIEWS = (
    "xo_v_tenant_minute",
    "xo_v_requests",
    "xo_v_goodput_minute",
    "xo_v_acceptance",
    "xo_v_steps_minute",
)  # dependents first: the drop order


def upgrade() -> None:
    op.create_table(
        "xo_step_rollups",
        sa.Column("id", ROW_ID, nullable=False),
        sa.Column("minute_start", sa.BigInteger(), nullable=False),
        sa.Column("instance", sa.String(64), nullable=False),
        sa.Column("technique", sa.String(64), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("batch_size_sum", sa.Integer(), nullable=False),
        sa.Column("batch_size_max", sa.Integer(), nullable=False),
        sa.Column("prefill_tokens", sa.Integer(), nullable=False),
        sa.Column("decode_tokens", sa.Integer(), nullable=False),
        sa.Column("proposed", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("accepted_per_pos", sa.JSON(), nullable=False),
        sa.Column("step_ms_sum", sa.Double(), nullable=False),
        sa.Column("step_ms_max", sa.Double(), nullable=False),
        sa.Column("propose_ms_sum", sa.Double(), nullable=False),
        sa.Column("verify_ms_sum", sa.Double(), nullable=False),
        sa.Column("preempted", sa.Integer(), nullable=False),
        sa.Column("batch_hist", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_step_rollups")),
        sa.UniqueConstraint(
            "minute_start",
            "instance",
            "technique",
            "depth",
            name=op.f("uq_xo_step_rollups_minute_start"),
        ),
    )
    op.create_index("ix_xo_step_rollups_minute_start", "xo_step_rollups", ["minute_start"])
    create_views()


def downgrade() -> None:
    drop_views()
    op.drop_index("ix_xo_step_rollups_minute_start", table_name="xo_step_rollups")
    op.drop_table("xo_step_rollups")


def drop_views() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {name}")


def create_views() -> None:
    dialect = op.get_context().dialect
    q = dialect.identifier_preparer.quote
    minute = _minute_sql(dialect.name, q("time"))
    finish_minute = _minute_sql(dialect.name, "finish_time")
    for name, body in _view_bodies(q, minute, finish_minute):
        op.execute(f"CREATE VIEW {name} AS {body}")


def _minute_sql(dialect_name: str, column: str) -> str:
    if dialect_name == "sqlite":
        return f"(CAST({column} / 60 AS INTEGER) * 60)"
    return f"(FLOOR({column} / 60) * 60)"


def _view_bodies(q, minute: str, finish_minute: str) -> list[tuple[str, str]]:
    steps_minute = f"""
SELECT {minute} AS minute_start, instance, technique, depth,
       COUNT(*) AS steps, SUM(batch_size) AS batch_size_sum, MAX(batch_size) AS batch_size_max,
       SUM(prefill_tokens) AS prefill_tokens, SUM(decode_tokens) AS decode_tokens,
       SUM(proposed) AS proposed, SUM(accepted) AS accepted,
       SUM(step_ms) AS step_ms_sum, MAX(step_ms) AS step_ms_max, SUM(preempted) AS preempted
FROM xo_steps
GROUP BY {minute}, instance, technique, depth
UNION ALL
SELECT minute_start, instance, technique, depth,
       steps, batch_size_sum, batch_size_max, prefill_tokens, decode_tokens,
       proposed, accepted, step_ms_sum, step_ms_max, preempted
FROM xo_step_rollups"""
    acceptance = """
SELECT minute_start, technique, depth, SUM(steps) AS steps,
       SUM(proposed) AS proposed, SUM(accepted) AS accepted,
       CASE WHEN SUM(proposed) > 0 THEN 1.0 * SUM(accepted) / SUM(proposed) END AS acceptance_rate
FROM xo_v_steps_minute
GROUP BY minute_start, technique, depth"""
    goodput = """
SELECT minute_start, SUM(steps) AS steps, SUM(decode_tokens) AS output_tokens,
       SUM(decode_tokens) / 60.0 AS tokens_per_s, SUM(prefill_tokens) AS prefill_tokens,
       1.0 * SUM(batch_size_sum) / SUM(steps) AS mean_batch_size,
       SUM(step_ms_sum) / SUM(steps) AS mean_step_ms,
       SUM(proposed) AS proposed, SUM(accepted) AS accepted
FROM xo_v_steps_minute
GROUP BY minute_start"""
    requests = f"""
SELECT id, instance, request_id, tenant, status, finish_reason, prompt_tokens, output_tokens,
       arrival_time, finish_time, {finish_minute} AS finish_minute,
       (first_token_time - arrival_time) * 1000.0 AS ttft_ms,
       (finish_time - arrival_time) * 1000.0 AS latency_ms,
       proposed_tokens, accepted_tokens,
       CASE WHEN proposed_tokens > 0 THEN 1.0 * accepted_tokens / proposed_tokens END
           AS acceptance_rate,
       preemptions
FROM xo_requests"""
    tenant_minute = """
SELECT finish_minute AS minute_start, tenant, COUNT(*) AS requests,
       SUM(CASE WHEN status = 'ok' THEN 0 ELSE 1 END) AS failed,
       SUM(prompt_tokens) AS prompt_tokens, SUM(output_tokens) AS output_tokens,
       SUM(proposed_tokens) AS proposed, SUM(accepted_tokens) AS accepted,
       AVG(ttft_ms) AS mean_ttft_ms, AVG(latency_ms) AS mean_latency_ms
FROM xo_v_requests
GROUP BY finish_minute, tenant"""
    return [
        ("xo_v_steps_minute", steps_minute),
        ("xo_v_acceptance", acceptance),
        ("xo_v_goodput_minute", goodput),
        ("xo_v_requests", requests),
        ("xo_v_tenant_minute", tenant_minute),
    ]
