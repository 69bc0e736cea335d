"""Steps record how many decode rows ran in a segmented verify's plain segment.

A segmented verify (engine/segments.py) runs the rows that draft nothing as a
plain segment [rows, 1] beside the drafting rows' verify segment [rows, 1 + depth]
in one forward, so such a step runs fewer rows than one padded verify of the
same batch; the tuner's step-time model needs the count to fit and price it.
`xo_steps` gains `plain_rows`; rows recorded before this revision read 0
(server default), which is what a step with one padded verify (or none) says.
Raw steps age into rollups, which keep no per-step column for it.

The `xo_v_*` views read `xo_steps`; SQLite checks them when batch mode copies
the table, so they are dropped first and re-created after, in both directions,
with 0010's helpers (0002's would re-create the old acceptance view); the views
do not read the new column.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa

from migrations import step_columns

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0010_step_row_classes_table")


def upgrade() -> None:
    step_columns.add_columns(
        _views,
        sa.Column("plain_rows", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    step_columns.drop_columns(_views, "plain_rows")
