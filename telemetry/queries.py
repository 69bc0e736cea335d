"""Aggregate queries shared by the tuner, /metrics and dashboards.

Every function takes the Session explicitly (the caller owns it, see
`store.db.session_scope`) and a window start `since` (unix seconds). Step
queries read the raw rows and, where the window reaches past the raw
retention, the per-minute rollups — a rollup counts when its minute overlaps
the window. `step_time_by` needs per-step detail that rollups do not keep, so
it covers the raw window only. Acceptance by tenant comes from requests,
which carry exact per-request proposed/accepted totals.

Steps whose rows drafted with several techniques or depths (per-tenant
rules) record each row class (`xo_steps.row_classes`, telemetry.rowclasses):
acceptance by technique and by draft position counts every class under its
own technique and depth, as the rollups do. Step time and goodput per
technique count such a step once, under "mixed" when its classes used
several techniques (its verify depth as its depth): its time is that of
every proposer it ran and the deepest row's verify, no one technique's.

Several daemons may share the database: every function takes `instance`, the
daemon whose rows to read (the rows' `instance` column), or None (the
default) for every instance's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from store.models import Request, Step, StepRollup
from telemetry.retention import add_positions
from telemetry.rowclasses import MIXED, classes_of, drafts, step_technique
from telemetry.sql import bucket_start


@dataclass(frozen=True)
class Acceptance:
    """Accepted / proposed drafts for one key (a technique or a tenant)."""

    key: str
    count: int
    """Steps (by technique: those recorded under it, a step counting once under the technique of
    its most drafting rows) or requests (by tenant)."""
    proposed: int
    accepted: int

    @property
    def rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


@dataclass(frozen=True)
class PositionAcceptance:
    """Acceptance at one draft position of one technique."""

    technique: str
    position: int
    proposed: int
    """Drafts offered at this position (proposed / depth per step)."""
    accepted: int
    reached: int
    """Drafts that could be accepted here: those accepted at the previous position."""

    @property
    def rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def conditional_rate(self) -> float | None:
        """P(accept here | every earlier draft accepted)."""
        return self.accepted / self.reached if self.reached else None


@dataclass(frozen=True)
class StepTime:
    """Step time for one (technique, batch size, depth) over the raw window."""

    technique: str
    batch_size: int
    depth: int
    steps: int
    mean_ms: float
    max_ms: float


@dataclass(frozen=True)
class BatchGoodput:
    """Output tokens per second of step time for one (technique, batch size), raw window."""

    technique: str
    batch_size: int
    steps: int
    tokens_per_s: float


@dataclass(frozen=True)
class GoodputPoint:
    """Output tokens/s over one time bucket."""

    bucket_start: int
    steps: int
    output_tokens: int
    tokens_per_s: float
    mean_batch_size: float


def _window(column, since: float, until: float | None, instance: str | None = None) -> list:
    """`column` in [since, until), and the row of `instance` (of the column's table)."""
    own = [column.class_.instance == instance] if instance is not None else []
    return [column >= since] + ([column < until] if until is not None else []) + own


def _rollup_window(since: float, until: float | None, instance: str | None = None) -> list:
    return [StepRollup.minute_start > since - 60] + (
        [StepRollup.minute_start < until] if until is not None else []
    ) + ([StepRollup.instance == instance] if instance is not None else [])


def acceptance_by_technique(
    session: Session, since: float, until: float | None = None, *, instance: str | None = None
) -> list[Acceptance]:
    """Per technique: steps, proposed and accepted drafts (raw steps + rollups); a step's drafts
    count per row class where it records them (module doc)."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    raw = select(Step.technique, func.count(), func.sum(Step.proposed), func.sum(Step.accepted))
    rolled = select(
        StepRollup.technique, func.sum(StepRollup.steps),
        func.sum(StepRollup.proposed), func.sum(StepRollup.accepted),
    )  # fmt: skip
    for query in (
        raw.where(*_window(Step.time, since, until, instance)).group_by(Step.technique),
        rolled.where(*_rollup_window(since, until, instance)).group_by(StepRollup.technique),
    ):
        for technique, n, proposed, accepted in session.execute(query):
            row = totals[technique]
            row[0], row[1], row[2] = row[0] + n, row[1] + (proposed or 0), row[2] + (accepted or 0)
    for name, depth, proposed, accepted, per_pos, classes in session.execute(
            _drafting(since, until, instance)):
        if classes_of(classes):  # move the step's drafts from its technique to its classes'
            row = totals[name]
            row[1], row[2] = row[1] - proposed, row[2] - accepted
            for d in drafts(name, depth, proposed, accepted, per_pos, classes):
                row = totals[d.technique]
                row[1], row[2] = row[1] + d.proposed, row[2] + d.accepted
    return [Acceptance(k, *v) for k, v in sorted(totals.items())]


def _drafting(since: float, until: float | None, instance: str | None) -> Select:
    """The raw steps of the window that drafted, with what `rowclasses.drafts` reads."""
    return select(
        Step.technique, Step.depth, Step.proposed, Step.accepted, Step.accepted_per_pos,
        Step.row_classes,
    ).where(*_window(Step.time, since, until, instance), Step.depth > 0)  # fmt: skip


def acceptance_by_position(
    session: Session, since: float, until: float | None = None, technique: str | None = None,
    *, instance: str | None = None,
) -> list[PositionAcceptance]:
    """Per technique and draft position: proposed, accepted, and the conditional rate (a step's
    row classes each at their own technique and depth, module doc)."""
    offered: dict[str, list[float]] = defaultdict(list)
    accepted: dict[str, list[int]] = defaultdict(list)
    rolled = select(
        StepRollup.technique, StepRollup.depth, StepRollup.proposed, StepRollup.accepted_per_pos
    ).where(*_rollup_window(since, until, instance), StepRollup.depth > 0)
    if technique is not None:  # raw steps are filtered per class: a step may hold several
        rolled = rolled.where(StepRollup.technique == technique)
    for row in session.execute(_drafting(since, until, instance)):
        for d in drafts(*row):
            if technique is None or d.technique == technique:
                add_positions(accepted[d.technique], d.accepted_per_pos)
                _add_offered(offered[d.technique], d.depth, d.proposed)
    for name, depth, proposed, per_pos in session.execute(rolled):
        add_positions(accepted[name], per_pos)
        _add_offered(offered[name], depth, proposed)
    return [row for name in sorted(offered) for row in _positions(name, offered, accepted)]


def _add_offered(offered: list[float], depth: int, proposed: int) -> None:
    """Each speculating sequence offers one draft at each of `depth` positions."""
    while len(offered) < depth:
        offered.append(0.0)
    for i in range(depth):
        offered[i] += proposed / depth


def _positions(name: str, offered: dict, accepted: dict) -> list[PositionAcceptance]:
    out, previous = [], None
    for pos, n_offered in enumerate(offered[name]):
        n_accepted = accepted[name][pos] if pos < len(accepted[name]) else 0
        reached = round(n_offered) if previous is None else previous
        out.append(PositionAcceptance(name, pos, round(n_offered), n_accepted, reached))
        previous = n_accepted
    return out


def acceptance_by_tenant(
    session: Session, since: float, until: float | None = None, *, instance: str | None = None
) -> list[Acceptance]:
    """Per tenant, from finished requests: requests, proposed and accepted drafts."""
    query = (
        select(
            Request.tenant,
            func.count(),
            func.sum(Request.proposed_tokens),
            func.sum(Request.accepted_tokens),
        )
        .where(*_window(Request.finish_time, since, until, instance))
        .group_by(Request.tenant)
        .order_by(Request.tenant)
    )
    return [Acceptance(t, n, p or 0, a or 0) for t, n, p, a in session.execute(query)]


def acceptance_by(
    session: Session,
    by: Literal["technique", "position", "tenant"],
    since: float,
    until: float | None = None,
    *,
    instance: str | None = None,
) -> Sequence[Acceptance | PositionAcceptance]:
    """Acceptance grouped by technique, draft position or tenant."""
    readers = {
        "technique": acceptance_by_technique,
        "position": acceptance_by_position,
        "tenant": acceptance_by_tenant,
    }
    if by not in readers:
        raise ValueError(f"by must be one of {sorted(readers)}, got {by!r}")
    return readers[by](session, since, until, instance=instance)


def batch_size_histogram(
    session: Session, since: float, until: float | None = None, *, instance: str | None = None
) -> dict[int, int]:
    """Batch size -> number of steps (raw steps + rollups' histograms)."""
    hist: dict[int, int] = defaultdict(int)
    raw = (
        select(Step.batch_size, func.count())
        .where(*_window(Step.time, since, until, instance))
        .group_by(Step.batch_size)
    )
    for size, n in session.execute(raw):
        hist[int(size)] += n
    for (rollup_hist,) in session.execute(
        select(StepRollup.batch_hist).where(*_rollup_window(since, until, instance))
    ):
        for size, n in rollup_hist.items():
            hist[int(size)] += int(n)
    return dict(sorted(hist.items()))


def step_time_by(
    session: Session, since: float, until: float | None = None, technique: str | None = None,
    *, instance: str | None = None,
) -> list[StepTime]:
    """Mean and max step time per (technique, batch size, depth); raw window only. A step whose
    rows drafted with several techniques counts once, under "mixed" (module doc)."""
    query = select(Step.technique, Step.batch_size, Step.depth, Step.step_ms, Step.row_classes).where(
        *_window(Step.time, since, until, instance))
    if technique == MIXED:
        query = query.where(Step.depth > 0)
    elif technique is not None:  # its steps, less those that count as mixed
        query = query.where(Step.technique == technique)
    sums: dict[tuple[str, int, int], list[float]] = {}
    for name, batch, depth, ms, classes in session.execute(query):
        key = (step_technique(name, classes), int(batch), int(depth))
        if technique is None or key[0] == technique:
            row = sums.setdefault(key, [0, 0.0, float(ms)])
            row[0], row[1], row[2] = row[0] + 1, row[1] + ms, max(row[2], ms)
    return [StepTime(t, b, d, int(n), total / n, mx)
            for (t, b, d), (n, total, mx) in sorted(sums.items())]


def goodput_by_batch(session: Session, since: float, until: float | None = None, *,
                     instance: str | None = None) -> list[BatchGoodput]:
    """Output tokens/s of step time per (technique, batch size); steps of zero time are left out.
    A step whose rows drafted with several techniques counts once, under "mixed" (module doc)."""
    keys = (Step.technique, Step.batch_size)
    window = _window(Step.time, since, until, instance)
    query = select(*keys, func.count(), func.sum(Step.decode_tokens), func.sum(Step.step_ms)).where(
        *window).group_by(*keys)
    sums = {(str(t), int(b)): [n, tokens or 0, ms or 0.0] for t, b, n, tokens, ms in session.execute(query)}
    drafting = select(*keys, Step.decode_tokens, Step.step_ms, Step.row_classes).where(
        *window, Step.depth > 0)
    for name, batch, tokens, ms, classes in session.execute(drafting):
        if step_technique(name, classes) == MIXED:  # move the step from its technique to "mixed"
            row, into = sums[(name, batch)], sums.setdefault((MIXED, batch), [0, 0, 0.0])
            row[0], row[1], row[2] = row[0] - 1, row[1] - tokens, row[2] - ms
            into[0], into[1], into[2] = into[0] + 1, into[1] + tokens, into[2] + ms
    return [BatchGoodput(t, b, int(n), float(tokens) / (float(ms) / 1000.0))
            for (t, b), (n, tokens, ms) in sorted(sums.items()) if n and ms > 1e-9]


def goodput_over_time(
    session: Session, bucket_s: int, since: float, until: float | None = None, *,
    instance: str | None = None,
) -> list[GoodputPoint]:
    """Output tokens/s per `bucket_s` bucket (a rollup's minute lands in one bucket)."""
    sums: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    raw_bucket = bucket_start(Step.time, bucket_s)
    rolled_bucket = bucket_start(StepRollup.minute_start, bucket_s)
    raw = select(
        raw_bucket, func.count(), func.sum(Step.decode_tokens), func.sum(Step.batch_size)
    ).where(*_window(Step.time, since, until, instance)).group_by(raw_bucket)  # fmt: skip
    rolled = select(
        rolled_bucket, func.sum(StepRollup.steps), func.sum(StepRollup.decode_tokens),
        func.sum(StepRollup.batch_size_sum),
    ).where(*_rollup_window(since, until, instance)).group_by(rolled_bucket)  # fmt: skip
    for query in (raw, rolled):
        for start, steps, tokens, batch in session.execute(query):
            row = sums[int(start)]
            row[0], row[1], row[2] = row[0] + steps, row[1] + (tokens or 0), row[2] + (batch or 0)
    return [
        GoodputPoint(start, s, tok, tok / bucket_s, b / s if s else 0.0)
        for start, (s, tok, b) in sorted(sums.items())
    ]
