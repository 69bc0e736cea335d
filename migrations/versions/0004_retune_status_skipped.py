"""Retunes that did not run get their own status, "skipped".

Until now a skip (thin telemetry, a pinned policy, too few steps to fit) was
stored as status "failed" with `details.skipped` and an error starting
"skipped:", so a dashboard counting failures counted every skip. The column
is a plain string (no CHECK constraint), so only the rows change.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE xo_retunes SET status = 'skipped' "
               "WHERE status = 'failed' AND error LIKE 'skipped:%'")


def downgrade() -> None:
    op.execute("UPDATE xo_retunes SET status = 'failed' WHERE status = 'skipped'")
