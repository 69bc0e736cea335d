"""What the revisions that add columns to `xo_steps` share.

Alembic's batch mode copies the table on SQLite, and SQLite checks the views
that read it during the copy, so the views are dropped first and re-created
after, in both directions. `views` is the revision module whose
`drop_views` / `create_views` match the views at that point of the history
(0002's before revision 0010, 0010's from it on).
"""

from __future__ import annotations

from types import ModuleType

import sqlalchemy as sa
from alembic import op


def add_columns(views: ModuleType, *columns: sa.Column) -> None:
    """Add `columns` to `xo_steps`."""
    views.drop_views()
    with op.batch_alter_table("xo_steps") as batch:
        for column in columns:
            batch.add_column(column)
    views.create_views()


def drop_columns(views: ModuleType, *names: str) -> None:
    """Drop the columns `names` from `xo_steps`, in that order."""
    views.drop_views()
    with op.batch_alter_table("xo_steps") as batch:
        for name in names:
            batch.drop_column(name)
    views.create_views()
