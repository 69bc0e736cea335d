"""Row classes get a table, and the acceptance views count per row class.

`xo_step_row_classes` holds one row per row class of a raw step: the objects
of `xo_steps.row_classes` (revision 0009) as columns — `step` (the step's
`xo_steps.id`), `instance`, `time` (the step's), `tenant`, `technique`,
`depth`, `rows`, `proposed`, `accepted`, `accepted_per_pos` (JSON) — so that
plain SQL reads them without JSON functions. The telemetry writer inserts
them with their step, in the same transaction; retention deletes them with
their step (rollups keep no tenant, so the table covers the raw window).
The upgrade fills it from the `row_classes` of the steps already stored
(steps without classes get no rows; an offline `--sql` script does not
fill it); `xo_steps.row_classes` stays.

Indexes: `step` (the views' per-step lookup, deletes by step) and `time`
(time-window reads, as `xo_steps.time`).

Views:
- `xo_v_acceptance` keeps its columns and counts a step with row classes the
  way the rollups and telemetry.rowclasses do: the step once (`steps`) under
  its recorded technique and depth, its drafts (`proposed`, `accepted`)
  under each drafting class's own technique and depth. A step without
  classes (written before 0009, or one with no decode rows) and the rollups
  count as before, so old data reads the same; a raw minute reads the same
  before and after it is rolled up.
- `xo_v_tenant_acceptance` (new): per minute, tenant, technique and depth,
  the classes' `rows` (decode rows summed over the minute's steps),
  `proposed`, `accepted` and `acceptance_rate`; raw steps with classes only.
- The other views are 0002's, unchanged.

Later revisions that batch-alter `xo_steps` or `xo_step_rollups` on SQLite
must drop the views first and re-create them after with `drop_views()` and
`create_views()` from here (0002's would re-create the old acceptance view).
The table's foreign key to `xo_steps` survives such a copy (SQLite keeps
foreign keys off; the copy is renamed to `xo_steps`).

The downgrade drops the new view and the table and restores 0009's views.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_views = importlib.import_module("migrations.versions.0002_rollups_and_views")

TABLE = "xo_step_row_classes"
INDEXES = (("ix_xo_step_row_classes_step", "step"), ("ix_xo_step_row_classes_time", "time"))
VIEWS = ("xo_v_tenant_acceptance", *_views.VIEWS)  # dependents first: the drop order
BACKFILL_CHUNK = 2000
"""Steps read per query while filling the table."""


def upgrade() -> None:
    _views.drop_views()
    op.create_table(
        TABLE,
        sa.Column("id", _views.ROW_ID, nullable=False),
        sa.Column("step", _views.ROW_ID, nullable=False),
        sa.Column("instance", sa.String(64), nullable=False),
        sa.Column("time", sa.Double(), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("technique", sa.String(64), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("proposed", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("accepted_per_pos", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["step"], ["xo_steps.id"], ondelete="CASCADE",
                                name=op.f("fk_xo_step_row_classes_step_xo_steps")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xo_step_row_classes")),
    )
    for name, column in INDEXES:
        op.create_index(name, TABLE, [column])
    if not op.get_context().as_sql:  # an offline script (--sql) has no rows to read
        backfill(op.get_bind())
    create_views()


def downgrade() -> None:
    drop_views()
    for name, _ in reversed(INDEXES):
        op.drop_index(name, table_name=TABLE)
    op.drop_table(TABLE)
    _views.create_views()


def drop_views() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {name}")


def create_views() -> None:
    dialect = op.get_context().dialect
    q = dialect.identifier_preparer.quote
    minute = _views._minute_sql(dialect.name, q("time"))
    finish_minute = _views._minute_sql(dialect.name, "finish_time")
    for name, body in view_bodies(q, minute, finish_minute):
        op.execute(f"CREATE VIEW {name} AS {body}")


def view_bodies(q, minute: str, finish_minute: str) -> list[tuple[str, str]]:
    """0002's views with this revision's acceptance view, then the tenant acceptance view."""
    bodies = dict(_views._view_bodies(q, minute, finish_minute))
    bodies["xo_v_acceptance"] = _acceptance(q, minute)
    return [*bodies.items(), ("xo_v_tenant_acceptance", _tenant_acceptance(q, minute))]


def _acceptance(q, minute: str) -> str:
    # A step with classes: its count under its own (technique, depth), its drafts under its
    # drafting classes' (technique "none" / depth 0 classes did not draft). Rollups already
    # hold drafts per class (telemetry/retention.py).
    has_classes = f"EXISTS (SELECT 1 FROM {TABLE} AS c WHERE c.{q('step')} = s.id)"
    return f"""
SELECT minute_start, technique, depth, SUM(steps) AS steps,
       SUM(proposed) AS proposed, SUM(accepted) AS accepted,
       CASE WHEN SUM(proposed) > 0 THEN 1.0 * SUM(accepted) / SUM(proposed) END AS acceptance_rate
FROM (
    SELECT {minute} AS minute_start, technique, depth, COUNT(*) AS steps,
           SUM(CASE WHEN has_classes THEN 0 ELSE proposed END) AS proposed,
           SUM(CASE WHEN has_classes THEN 0 ELSE accepted END) AS accepted
    FROM (SELECT {q("time")}, technique, depth, proposed, accepted, {has_classes} AS has_classes
          FROM xo_steps AS s) AS s
    GROUP BY {minute}, technique, depth
    UNION ALL
    SELECT {minute} AS minute_start, technique, depth, 0 AS steps,
           SUM(proposed) AS proposed, SUM(accepted) AS accepted
    FROM {TABLE}
    WHERE depth > 0 AND technique <> 'none'
    GROUP BY {minute}, technique, depth
    UNION ALL
    SELECT minute_start, technique, depth, steps, proposed, accepted
    FROM xo_step_rollups
) AS u
GROUP BY minute_start, technique, depth"""


def _tenant_acceptance(q, minute: str) -> str:
    rows = q("rows")
    return f"""
SELECT {minute} AS minute_start, tenant, technique, depth, SUM({rows}) AS {rows},
       SUM(proposed) AS proposed, SUM(accepted) AS accepted,
       CASE WHEN SUM(proposed) > 0 THEN 1.0 * SUM(accepted) / SUM(proposed) END AS acceptance_rate
FROM {TABLE}
GROUP BY {minute}, tenant, technique, depth"""


def backfill(conn: sa.Connection) -> int:
    """Insert the classes of every stored step that has some, in chunks of steps; the rows made.

    Plain table definitions (not store.models): the revision keeps meaning what it meant
    when the models change later.
    """
    steps = sa.table("xo_steps", sa.column("id"), sa.column("instance"), sa.column("time"),
                     sa.column("row_classes", sa.JSON()))
    target = sa.table(TABLE, *(sa.column(c) for c in (
        "step", "instance", "time", "tenant", "technique", "depth", "rows", "proposed", "accepted")),
        sa.column("accepted_per_pos", sa.JSON()))  # fmt: skip
    last, made = None, 0
    while True:
        query = sa.select(steps).where(steps.c.row_classes.is_not(None)).order_by(steps.c.id)
        if last is not None:
            query = query.where(steps.c.id > last)
        chunk = conn.execute(query.limit(BACKFILL_CHUNK)).all()
        if not chunk:
            return made
        rows = [row for step in chunk for row in class_rows(step)]
        if rows:
            conn.execute(sa.insert(target), rows)
        made, last = made + len(rows), chunk[-1].id


def class_rows(step: Any) -> list[dict[str, Any]]:
    """The table's rows for one stored step (id, instance, time, row_classes).

    >>> from types import SimpleNamespace as S
    >>> class_rows(S(id=7, instance="a", time=5.0, row_classes='[{"tenant": "t", "technique": '
    ...            '"ngram", "depth": 2, "rows": 1, "proposed": 2, "accepted": 1, '
    ...            '"accepted_per_pos": [1, 0]}]'))  # doctest: +NORMALIZE_WHITESPACE
    [{'step': 7, 'instance': 'a', 'time': 5.0, 'tenant': 't', 'technique': 'ngram', 'depth': 2, 'rows': 1,
      'proposed': 2, 'accepted': 1, 'accepted_per_pos': [1, 0]}]
    """
    classes = step.row_classes
    if isinstance(classes, (str, bytes)):  # a driver that hands JSON back as text
        classes = json.loads(classes)
    return [{
        "step": step.id, "instance": step.instance, "time": step.time,
        "tenant": str(c["tenant"]), "technique": str(c["technique"]), "depth": int(c["depth"]),
        "rows": int(c.get("rows", 0)), "proposed": int(c.get("proposed", 0)),
        "accepted": int(c.get("accepted", 0)),
        "accepted_per_pos": [int(n) for n in c.get("accepted_per_pos") or ()],
    } for c in classes or ()]  # fmt: skip
