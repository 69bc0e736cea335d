"""The tuner's reads of raw telemetry: steps (as the engine's StepStats) and requests.

Aggregates for dashboards are in telemetry/queries.py and the policy and
retune history in store/history.py. Every function takes the Session
explicitly (the caller's `session_scope` commits or rolls back).

Several daemons may share the database: every reader takes `instance` (the
`instance` column of the rows; None reads every instance's). The step-time
model reads its own instance's steps (replicas may run on different
hardware); `read_steps_by_instance` serves the acceptance fit, which may pool
every instance's steps (tuner/README.md, "Several instances").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from engine.types import StepStats, row_classes_from_json
from store.models import Request, Step


@dataclass(frozen=True, slots=True)
class RequestRow:
    """The columns of one `xo_requests` row the tuner uses."""

    tenant: str
    prompt_tokens: int
    output_tokens: int
    arrival_time: float
    finish_time: float
    proposed_tokens: int
    accepted_tokens: int


_STEP_COLUMNS = tuple(Step.__table__.c[f.name] for f in fields(StepStats))
"""The `xo_steps` columns that hold a StepStats, in its field order."""
_FIELD_NAMES = tuple(c.name for c in _STEP_COLUMNS)
_TUPLE_FIELDS = ("accepted_per_pos", "tenants")


def _stats(values: Sequence[Any]) -> StepStats:
    """One row of _STEP_COLUMNS as a StepStats (JSON lists become tuples, stored row classes
    RowClasses; a row from before they were recorded has none)."""
    row = dict(zip(_FIELD_NAMES, values))
    for name in _TUPLE_FIELDS:
        row[name] = tuple(row[name] or ())
    if "row_classes" in row:
        row["row_classes"] = row_classes_from_json(row["row_classes"])
    return StepStats(**row)


def read_steps(
    session: Session,
    since: float,
    until: float | None = None,
    *,
    version: int | None = None,
    limit: int | None = None,
    per_shape: int | None = None,
    instance: str | None = "",
) -> list[StepStats]:
    """Raw steps of `instance` (None: every instance) in [since, until), optionally of one
    policy version, and with `per_shape` only the newest that many of each (batch size,
    depth, technique): the newest `limit` of them, oldest first. The one typed accessor
    through which the tuner reads steps."""
    query = select(*_STEP_COLUMNS).where(Step.time >= since, Step.step_ms > 0)
    if instance is not None:
        query = query.where(Step.instance == instance)
    if until is not None:
        query = query.where(Step.time < until)
    if version is not None:
        query = query.where(Step.policy_version == version)
    if per_shape is not None:
        rank = func.row_number().over(partition_by=(Step.batch_size, Step.depth, Step.technique),
                                      order_by=Step.time.desc())
        ranked = query.add_columns(rank.label("rank")).subquery()
        query = select(*(ranked.c[c.key] for c in _STEP_COLUMNS)).where(ranked.c.rank <= per_shape)
        query = query.order_by(ranked.c.time.desc()).limit(limit)
    else:
        query = query.order_by(Step.time.desc()).limit(limit)
    rows = [_stats(values) for values in session.execute(query)]
    rows.reverse()
    return rows


def read_steps_by_instance(session: Session, since: float, until: float | None = None, *,
                           limit: int | None = None) -> dict[str, list[StepStats]]:
    """read_steps of every instance with steps in [since, until): instance -> its steps
    (each instance's newest `limit`, oldest first)."""
    query = select(Step.instance).where(Step.time >= since, Step.step_ms > 0)
    if until is not None:
        query = query.where(Step.time < until)
    names = sorted(str(n) for n in session.scalars(query.distinct()))
    return {name: read_steps(session, since, until, limit=limit, instance=name) for name in names}


def read_requests(session: Session, since: float, until: float | None = None, *,
                  instance: str | None = "") -> list[RequestRow]:
    """Finished requests (status ok) of `instance` (None: every instance) in [since, until)
    by finish time."""
    query = select(
        Request.tenant, Request.prompt_tokens, Request.output_tokens, Request.arrival_time,
        Request.finish_time, Request.proposed_tokens, Request.accepted_tokens,
    ).where(Request.finish_time >= since, Request.status == "ok")  # fmt: skip
    if instance is not None:
        query = query.where(Request.instance == instance)
    if until is not None:
        query = query.where(Request.finish_time < until)
    return [RequestRow(str(t), int(p), int(o), float(a), float(f), int(pt), int(at))
            for t, p, o, a, f, pt, at in session.execute(query)]  # fmt: skip


def count_step_rows(session: Session, since: float, *, instance: str | None = "") -> int:
    """Steps of `instance` since `since`, each counted once per sequence in its batch."""
    query = select(func.sum(Step.batch_size)).where(Step.time >= since)
    if instance is not None:
        query = query.where(Step.instance == instance)
    return int(session.scalar(query) or 0)


def coverage(session: Session, since: float, *,
             instance: str | None = None) -> dict[str, dict[int, int]]:
    """Technique -> depth -> raw steps since `since` (what exploration still has to measure),
    of `instance` (None: every instance)."""
    query = select(Step.technique, Step.depth, func.count()).where(Step.time >= since)
    if instance is not None:
        query = query.where(Step.instance == instance)
    query = query.group_by(Step.technique, Step.depth)
    out: dict[str, dict[int, int]] = {}
    for technique, depth, n in session.execute(query):
        out.setdefault(str(technique), {})[int(depth)] = int(n)
    return out
