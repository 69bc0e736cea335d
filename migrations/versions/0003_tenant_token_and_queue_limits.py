"""Per-tenant max_tokens and max_queued on xo_tenants.

Both nullable: NULL keeps the daemon-wide default (`max_tokens`,
`tenant_max_queued` settings), so existing tenants behave as before the
upgrade. No xo_v_* view reads xo_tenants, so the views stay as they are.

Revision ID: 0003
Revises: 0002
Create Date: 2025-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("xo_tenants") as batch:
        batch.add_column(sa.Column("max_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_queued", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("xo_tenants") as batch:
        batch.drop_column("max_queued")
        batch.drop_column("max_tokens")
