"""Steps record prefix-cache hits: tokens looked up and tokens found at admission.

`xo_steps` gains `prefix_hit_tokens` and `prefix_query_tokens` (engine
StepStats fields of the same names): the hit rate over any window is
SUM(prefix_hit_tokens) / SUM(prefix_query_tokens). Rows recorded before this
revision read 0 for both (server default), as a daemon without the cache
would have recorded. Raw steps age into rollups, which keep neither column.

The `xo_v_*` views read `xo_steps`; SQLite checks them when batch mode
copies the table, so they are dropped first and re-created after, in both
directions (revision 0002's helpers; the views do not read the new columns).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa

from migrations import step_columns

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0002_rollups_and_views")
COLUMNS = ("prefix_hit_tokens", "prefix_query_tokens")


def upgrade() -> None:
    step_columns.add_columns(
        _views,
        *(sa.Column(name, sa.Integer(), nullable=False, server_default="0") for name in COLUMNS),
    )


def downgrade() -> None:
    step_columns.drop_columns(_views, *reversed(COLUMNS))
