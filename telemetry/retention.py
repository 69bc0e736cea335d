"""Retention: raw steps age into per-minute rollups; old rollups and requests go.

    0. raw steps already older than the rollup window are simply deleted
       (a step's `xo_step_row_classes` rows always go with it);
    1. cutoff = start of the minute holding (now - raw_steps_s)
    2. steps older than cutoff are aggregated per (minute, instance, technique,
       depth) — counts, sums, maxima, per-position sums, batch-size histogram —
       merged into `xo_step_rollups` (adding to a row already there, so late
       steps are never counted twice) and deleted, in one transaction per chunk
       of at most `max_minutes_per_chunk` minutes. A step that records row
       classes (telemetry.rowclasses) counts once under its recorded technique
       and depth, but its drafts (proposed, accepted, per position) go to each
       drafting class's own (technique, depth) row — created with zero steps if
       the minute has none — as the raw-step queries count them;
    3. rollups older than `rollups_s` and requests older than `requests_s` are
       deleted. Policies and retunes are kept (a handful of rows a day).

So raw rows never exceed rate x (raw_steps_s + 60 s + the run interval), and
rollups never exceed (rollups_s / 60 + 1) x the (instance, technique, depth)
combinations in use.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, func, select
from sqlalchemy.orm import Session

from store.db import session_scope
from store.models import Request, Step, StepRollup, StepRowClass
from telemetry.rowclasses import classes_of, drafts
from telemetry.sql import bucket_start, minute_of

Key = tuple[int, str, str, int]  # (minute_start, instance, technique, depth)


@dataclass(frozen=True)
class RetentionConfig:
    """How long each kind of row is kept (seconds)."""

    raw_steps_s: float = 6 * 3600.0
    """Raw step rows younger than this are kept as they are."""
    rollups_s: float = 90 * 86400.0
    """Per-minute rollups younger than this are kept."""
    requests_s: float = 30 * 86400.0
    """Request rows (by finish time) younger than this are kept."""
    max_minutes_per_chunk: int = 60
    """Most minutes of raw steps rolled up in one transaction."""

    def validate(self) -> None:
        if self.raw_steps_s < 0 or self.requests_s < 0:
            raise ValueError(
                f"raw_steps_s ({self.raw_steps_s}) and requests_s ({self.requests_s}) must be >= 0"
            )
        if self.rollups_s < self.raw_steps_s:
            raise ValueError(
                f"rollups_s ({self.rollups_s}) must be >= raw_steps_s ({self.raw_steps_s})"
            )
        if self.max_minutes_per_chunk < 1:
            raise ValueError(
                f"max_minutes_per_chunk must be >= 1, got {self.max_minutes_per_chunk}"
            )


@dataclass(frozen=True)
class RetentionResult:
    """What one retention run did."""

    rolled_steps: int = 0
    rollup_rows: int = 0
    deleted_steps: int = 0
    """Raw steps older than the rollup window: deleted without a roll-up."""
    deleted_rollups: int = 0
    deleted_requests: int = 0


def apply_retention(
    engine: Engine, config: RetentionConfig, now: float, instance: str | None = None
) -> RetentionResult:
    """Roll up, then prune; `instance` limits step roll-up to one daemon's rows."""
    config.validate()
    cutoff = minute_of(now - config.raw_steps_s)
    with session_scope(engine) as session:  # too old to be worth a rollup
        expired = [Step.time < now - config.rollups_s]
        expired += [Step.instance == instance] if instance is not None else []
        gone_steps = _delete_steps(session, *expired)
    rolled = rows = 0
    while True:
        with session_scope(engine) as session:
            oldest = _oldest_step(session, cutoff, instance)
            if oldest is None:
                break
            hi = min(cutoff, minute_of(oldest) + 60 * config.max_minutes_per_chunk)
            n_steps, n_rows = roll_up(session, hi, instance)
        rolled, rows = rolled + n_steps, rows + n_rows
    with session_scope(engine) as session:
        gone_rollups = _delete(
            session, StepRollup, StepRollup.minute_start < now - config.rollups_s
        )
        gone_requests = _delete(session, Request, Request.finish_time < now - config.requests_s)
    return RetentionResult(rolled, rows, gone_steps, gone_rollups, gone_requests)


def roll_up(session: Session, before: float, instance: str | None = None) -> tuple[int, int]:
    """Fold steps older than `before` (a minute start) into rollups; return (steps, rollup rows)."""
    where = [Step.time < before] + ([Step.instance == instance] if instance is not None else [])
    aggregates = _aggregate(session, where)
    if not aggregates:
        return 0, 0
    _add_histograms(session, where, aggregates)
    _add_positions(session, where, aggregates)
    _merge(session, aggregates)
    deleted = _delete_steps(session, *where)
    return deleted, len(aggregates)


def _oldest_step(session: Session, cutoff: float, instance: str | None) -> float | None:
    query = select(func.min(Step.time)).where(Step.time < cutoff)
    if instance is not None:
        query = query.where(Step.instance == instance)
    return session.scalar(query)


def _key_columns() -> tuple[Any, ...]:
    return (bucket_start(Step.time, 60), Step.instance, Step.technique, Step.depth)


def _key(row: Any) -> Key:
    return (int(row[0]), row[1], row[2], int(row[3]))


_AGGREGATE_NAMES = (
    "steps", "batch_size_sum", "batch_size_max", "prefill_tokens", "decode_tokens",
    "proposed", "accepted", "step_ms_sum", "step_ms_max", "propose_ms_sum",
    "verify_ms_sum", "preempted",
)  # fmt: skip
"""The rollup columns `_aggregate` sums (or maximises), in its query's order."""


def _aggregate(session: Session, where: list[Any]) -> dict[Key, dict[str, Any]]:
    keys = _key_columns()
    query = select(
        *keys,
        func.count(), func.sum(Step.batch_size), func.max(Step.batch_size),
        func.sum(Step.prefill_tokens), func.sum(Step.decode_tokens),
        func.sum(Step.proposed), func.sum(Step.accepted),
        func.sum(Step.step_ms), func.max(Step.step_ms),
        func.sum(Step.propose_ms), func.sum(Step.verify_ms), func.sum(Step.preempted),
    ).where(*where).group_by(*keys)  # fmt: skip
    out = {}
    for row in session.execute(query):
        values = dict(zip(_AGGREGATE_NAMES, row[4:], strict=True))
        values.update(accepted_per_pos=[], batch_hist={})
        out[_key(row)] = values
    return out


def _add_histograms(session: Session, where: list[Any], aggregates: dict[Key, dict]) -> None:
    keys = _key_columns()
    query = (
        select(*keys, Step.batch_size, func.count()).where(*where).group_by(*keys, Step.batch_size)
    )
    for row in session.execute(query):
        aggregates[_key(row)]["batch_hist"][str(int(row[4]))] = int(row[5])


def _add_positions(session: Session, where: list[Any], aggregates: dict[Key, dict]) -> None:
    """Per-position sums; a step with row classes moves its drafts to its classes' keys."""
    query = select(
        *_key_columns(), Step.proposed, Step.accepted, Step.accepted_per_pos, Step.row_classes
    ).where(*where, Step.depth > 0)  # fmt: skip
    for row in session.execute(query):
        key = _key(row)
        proposed, accepted, per_pos, classes = row[4:]
        if not classes_of(classes):
            add_positions(aggregates[key]["accepted_per_pos"], per_pos)
            continue
        own = aggregates[key]
        own["proposed"], own["accepted"] = own["proposed"] - proposed, own["accepted"] - accepted
        for d in drafts(key[2], key[3], proposed, accepted, per_pos, classes):
            into = aggregates.setdefault((key[0], key[1], d.technique, d.depth), _empty())
            into["proposed"], into["accepted"] = into["proposed"] + d.proposed, into["accepted"] + d.accepted
            add_positions(into["accepted_per_pos"], d.accepted_per_pos)


def _empty() -> dict[str, Any]:
    """A rollup's values for a key no step of the minute was recorded under (module doc, 2)."""
    zeros = dict.fromkeys(_AGGREGATE_NAMES, 0)
    return {**zeros, "accepted_per_pos": [], "batch_hist": {}}


def add_positions(sums: list[int], counts: Iterable[int]) -> None:
    """Add per-position counts into `sums` in place, growing it as needed.

    >>> s = [1, 2]; add_positions(s, [1, 1, 1]); s
    [2, 3, 1]
    """
    for i, n in enumerate(counts):
        if i < len(sums):
            sums[i] += int(n)
        else:
            sums.append(int(n))


def _merge(session: Session, aggregates: dict[Key, dict[str, Any]]) -> None:
    minutes = [k[0] for k in aggregates]
    existing = session.scalars(
        select(StepRollup).where(StepRollup.minute_start.between(min(minutes), max(minutes)))
    )
    for rollup in existing:
        key = (rollup.minute_start, rollup.instance, rollup.technique, rollup.depth)
        if key in aggregates:
            _fold_into(rollup, aggregates.pop(key))
    for (minute, instance, technique, depth), values in aggregates.items():
        session.add(
            StepRollup(minute_start=minute, instance=instance, technique=technique, depth=depth,
                       **values)
        )  # fmt: skip
    session.flush()


def _fold_into(rollup: StepRollup, values: dict[str, Any]) -> None:
    for name in ("batch_size_max", "step_ms_max"):
        setattr(rollup, name, max(getattr(rollup, name), values.pop(name)))
    positions = list(rollup.accepted_per_pos)
    add_positions(positions, values.pop("accepted_per_pos"))
    rollup.accepted_per_pos = positions
    hist: dict[str, int] = defaultdict(int, rollup.batch_hist)
    for size, count in values.pop("batch_hist").items():
        hist[size] += count
    rollup.batch_hist = dict(hist)
    for name, value in values.items():
        setattr(rollup, name, getattr(rollup, name) + value)


def _delete_steps(session: Session, *where: Any) -> int:
    """Delete the steps matching `where`, their row classes first (they point at the steps)."""
    _delete(session, StepRowClass, StepRowClass.step.in_(select(Step.id).where(*where)))
    return _delete(session, Step, *where)


def _delete(session: Session, model: type, *where: Any) -> int:
    statement = delete(model).where(*where).execution_options(synchronize_session=False)
    return int(session.execute(statement).rowcount or 0)
