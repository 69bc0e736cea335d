"""Policies and retunes belong to an instance (one daemon of several sharing a database).

Several daemons can share one database, and each keeps its own policy history,
so `xo_policies` and `xo_retunes` gain the `instance` column that the telemetry
tables already have. Rows that exist get "" (the single daemon's instance).
Policy versions are now unique per instance: the global UNIQUE(version)
becomes UNIQUE(instance, version), so two daemons can both have a version 1
and a daemon cannot record the same version twice. No xo_v_* view reads
either table, so SQLite can rebuild both (batch mode).

A downgrade drops the columns again. It refuses (with a message) when two
instances have the same version, because the global constraint would fail.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("xo_policies") as batch:
        batch.add_column(sa.Column("instance", sa.String(64), nullable=False, server_default=""))
        batch.drop_constraint(op.f("uq_xo_policies_version"), type_="unique")
        batch.create_unique_constraint(op.f("uq_xo_policies_instance"), ["instance", "version"])
    with op.batch_alter_table("xo_retunes") as batch:
        batch.add_column(sa.Column("instance", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    shared = op.get_bind().execute(sa.text(
        "SELECT version FROM xo_policies GROUP BY version HAVING COUNT(*) > 1")).first()
    if shared is not None:
        raise RuntimeError(
            f"cannot downgrade below 0006: several instances have policy version {shared[0]}; "
            "delete the policies of all instances but one first")
    with op.batch_alter_table("xo_retunes") as batch:
        batch.drop_column("instance")
    with op.batch_alter_table("xo_policies") as batch:
        batch.drop_constraint(op.f("uq_xo_policies_instance"), type_="unique")
        batch.create_unique_constraint(op.f("uq_xo_policies_version"), ["version"])
        batch.drop_column("instance")
