"""Initial telemetry schema: tenants, requests, steps, policies, retunes.

Revision ID: 0001
Revises:
Create Date: 2025-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "xo_tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("api_key_hash", sa.String(200), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_xo_tenants_name")),
    )
    op.create_table(
        "xo_requests",
        sa.Column("id", ROW_ID, nullable=False),
        sa.Column("instance", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("arrival_time", sa.Double(), nullable=False),
        sa.Column("first_token_time", sa.Double(), nullable=True),
        sa.Column("finish_time", sa.Double(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("proposed_tokens", sa.Integer(), nullable=False),
        sa.Column("accepted_tokens", sa.Integer(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_requests")),
    )
    op.create_index("ix_xo_requests_request_id", "xo_requests", ["request_id"])
    op.create_index("ix_xo_requests_finish_time", "xo_requests", ["finish_time"])
    op.create_index("ix_xo_requests_tenant_finish_time", "xo_requests", ["tenant", "finish_time"])
    op.create_table(
        "xo_steps",
        sa.Column("id", ROW_ID, nullable=False),
        sa.Column("instance", sa.String(64), nullable=False),
        sa.Column("step_id", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Double(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("prefill_tokens", sa.Integer(), nullable=False),
        sa.Column("decode_tokens", sa.Integer(), nullable=False),
        sa.Column("technique", sa.String(64), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("proposed", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("accepted_per_pos", sa.JSON(), nullable=False),
        sa.Column("propose_ms", sa.Double(), nullable=False),
        sa.Column("verify_ms", sa.Double(), nullable=False),
        sa.Column("step_ms", sa.Double(), nullable=False),
        sa.Column("kv_pages_used", sa.Integer(), nullable=False),
        sa.Column("kv_pages_free", sa.Integer(), nullable=False),
        sa.Column("queue_len", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("preempted", sa.Integer(), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_steps")),
    )
    op.create_index("ix_xo_steps_time", "xo_steps", ["time"])
    op.create_table(
        "xo_policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("applied_at", sa.Double(), nullable=True),
        sa.Column("rolled_back_at", sa.Double(), nullable=True),
        sa.Column("rollback_reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "source IN ('default', 'tuner', 'admin')", name=op.f("ck_xo_policies_source")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_policies")),
        sa.UniqueConstraint("version", name=op.f("uq_xo_policies_version")),
    )
    op.create_table(
        "xo_retunes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("triggered_by", sa.String(16), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("study_name", sa.String(255), nullable=True),
        sa.Column("trial_number", sa.Integer(), nullable=True),
        sa.Column("predicted_goodput", sa.Double(), nullable=True),
        sa.Column("measured_goodput", sa.Double(), nullable=True),
        sa.Column("chosen_policy_version", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.CheckConstraint(
            "triggered_by IN ('schedule', 'admin')", name=op.f("ck_xo_retunes_triggered_by")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_retunes")),
    )
    op.create_index("ix_xo_retunes_started_at", "xo_retunes", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_xo_retunes_started_at", table_name="xo_retunes")
    op.drop_table("xo_retunes")
    op.drop_table("xo_policies")
    op.drop_index("ix_xo_steps_time", table_name="xo_steps")
    op.drop_table("xo_steps")
    op.drop_index("ix_xo_requests_tenant_finish_time", table_name="xo_requests")
    op.drop_index("ix_xo_requests_finish_time", table_name="xo_requests")
    op.drop_index("ix_xo_requests_request_id", table_name="xo_requests")
    op.drop_table("xo_requests")
    op.drop_table("xo_tenants")
