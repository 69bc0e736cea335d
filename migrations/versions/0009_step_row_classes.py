"""Steps record their decode rows by class: tenant, technique and depth.

`xo_steps` gains `row_classes` (the engine StepStats field of the same name):
a JSON list of objects, one per (tenant, technique, depth) among the step's
decode rows, with its rows, proposed and accepted drafts and accepted drafts
per position. One step's rows may draft with several techniques and depths
(per-tenant policies); the step-level columns keep their sums. Rows recorded
before this revision read NULL (the tuner reads them as no classes). Raw
steps age into rollups, which do not keep the column.

The `xo_v_*` views read `xo_steps`; SQLite checks them when batch mode
copies the table, so they are dropped first and re-created after, in both
directions (revision 0002's helpers; the views do not read the new column).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa

from migrations import step_columns

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0002_rollups_and_views")


def upgrade() -> None:
    step_columns.add_columns(
        _views,
        sa.Column("row_classes", sa.JSON(), nullable=True),
    )


def downgrade() -> None:
    step_columns.drop_columns(_views, "row_classes")
