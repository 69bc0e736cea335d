"""Steps record how many of their rows sample (temperature > 0).

Sampling a row costs more than a greedy argmax (top-k / top-p sort, the
rejection test in verification), so the tuner's step-time model needs the
count. `xo_steps` gains `sampled_rows`; rows recorded before this revision
read 0 (server default), which is what a greedy-only step would have said.
Raw steps age into rollups, which keep no per-step column for it.

The `xo_v_*` views read `xo_steps`; SQLite checks them when batch mode
copies the table, so they are dropped first and re-created after, in both
directions (revision 0002's helpers; the views do not read the new column).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa

from migrations import step_columns

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0002_rollups_and_views")


def upgrade() -> None:
    step_columns.add_columns(
        _views,
        sa.Column("sampled_rows", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    step_columns.drop_columns(_views, "sampled_rows")
