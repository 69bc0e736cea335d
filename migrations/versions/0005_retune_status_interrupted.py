"""Retunes a stopped daemon left running get their own status, "interrupted".

A daemon that stops mid-retune (a crash, a kill, a stop during the
validation window) used to leave its row "running" forever. The next start
now closes such rows as "interrupted" (tuner.service.Tuner.restore). The
status column gains a CHECK constraint listing every status, as the
`triggered_by` column has, so a dashboard can rely on the set. No xo_v_* view
reads xo_retunes, so the table can be rebuilt (SQLite batch mode) freely.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

STATUSES = "('running', 'applied', 'rejected', 'failed', 'skipped', 'interrupted')"


def upgrade() -> None:
    with op.batch_alter_table("xo_retunes") as batch:
        batch.create_check_constraint(op.f("ck_xo_retunes_status"), f"status IN {STATUSES}")


def downgrade() -> None:
    # the status before this revision closest to "left unfinished" is "failed"
    op.execute("UPDATE xo_retunes SET status = 'failed' WHERE status = 'interrupted'")
    with op.batch_alter_table("xo_retunes") as batch:
        batch.drop_constraint(op.f("ck_xo_retunes_status"), type_="check")
