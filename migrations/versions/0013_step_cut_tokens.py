"""Steps count goodput as delivered tokens and record the tokens their requests' ends cut off.

A verify row produces its accepted drafts and one token after them; a stop (id, string or
grammar end), max_tokens or the context may end its request inside them, and the request keeps
only the tokens before that end (engine.execute.sequence.append_tokens). From this revision
`decode_tokens`, `accepted` and `accepted_per_pos` count only what requests kept, and
`xo_steps` gains `cut_tokens`, the tokens the decode rows computed past their requests' ends.
Rows recorded before this revision read 0 (server default); their `decode_tokens` and
`accepted` counted those tokens as output, which no column can tell apart now. Raw steps age
into rollups, which keep no column for it.

The `xo_v_*` views read `xo_steps`; SQLite checks them when batch mode copies the table, so
they are dropped first and re-created after, in both directions, with 0010's helpers.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-10
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa

from migrations import step_columns

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0010_step_row_classes_table")


def upgrade() -> None:
    step_columns.add_columns(
        _views,
        sa.Column("cut_tokens", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    step_columns.drop_columns(_views, "cut_tokens")
