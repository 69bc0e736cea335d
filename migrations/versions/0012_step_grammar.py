"""Steps record their constrained rows and the host time spent on those rows' grammars.

Structured outputs (engine/grammar.py) cut a constrained row's drafts at the first token its
grammar refuses and compute the allowed tokens at each of its output positions on the host,
before the step's device calls. `xo_steps` gains `constrained_rows` (rows of the batch whose
output follows a grammar) and `grammar_ms` (the host time that took); rows recorded before
this revision read 0 (server defaults), which is what a step without constraints says.
Raw steps age into rollups, which keep no column for either.

The `xo_v_*` views read `xo_steps`; SQLite checks them when batch mode copies the table, so
they are dropped first and re-created after, in both directions, with 0010's helpers.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa

from migrations import step_columns

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0010_step_row_classes_table")


def upgrade() -> None:
    step_columns.add_columns(
        _views,
        sa.Column("grammar_ms", sa.Double(), nullable=False, server_default="0"),
        sa.Column("constrained_rows", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    step_columns.drop_columns(_views, "constrained_rows", "grammar_ms")
