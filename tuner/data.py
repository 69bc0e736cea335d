"""The tuner's reads of the telemetry database (raw `xo_steps`, `xo_requests`, history).

These complement telemetry/queries.py with the per-row detail the model
needs. Every function takes the Session explicitly (STYLE 12).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.models import Policy, Request, Retune, Step


@dataclass(frozen=True, slots=True)
class StepRow:
    """The columns of one `xo_steps` row the tuner uses."""

    time: float
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    """Tokens the step emitted, accepted drafts included."""
    technique: str
    depth: int
    proposed: int
    accepted_per_pos: tuple[int, ...]
    propose_ms: float
    step_ms: float
    queue_len: int
    policy_version: int
    tenants: tuple[str, ...] = ()

    @property
    def speculating(self) -> float:
        """Sequences that drafted: each offers one draft per position (proposed / depth)."""
        return self.proposed / self.depth if self.depth else 0.0

    @property
    def goodput(self) -> float:
        """Output tokens per second of this step."""
        return self.decode_tokens * 1000.0 / self.step_ms if self.step_ms > 0 else 0.0


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


_STEP_COLUMNS = (
    Step.time, Step.batch_size, Step.prefill_tokens, Step.decode_tokens, Step.technique,
    Step.depth, Step.proposed, Step.accepted_per_pos, Step.propose_ms, Step.step_ms,
    Step.queue_len, Step.policy_version, Step.tenants,
)  # fmt: skip


def read_steps(
    session: Session,
    since: float,
    until: float | None = None,
    *,
    version: int | None = None,
    limit: int | None = None,
    per_shape: int | None = None,
) -> list[StepRow]:
    """Raw steps in [since, until), optionally of one policy version, and with `per_shape`
    only the newest that many of each (batch size, depth): the newest `limit` of them,
    oldest first."""
    query = select(*_STEP_COLUMNS).where(Step.time >= since, Step.step_ms > 0)
    if until is not None:
        query = query.where(Step.time < until)
    if version is not None:
        query = query.where(Step.policy_version == version)
    if per_shape is not None:
        rank = func.row_number().over(partition_by=(Step.batch_size, Step.depth),
                                      order_by=Step.time.desc())
        ranked = query.add_columns(rank.label("rank")).subquery()
        query = select(*(ranked.c[c.key] for c in _STEP_COLUMNS)).where(ranked.c.rank <= per_shape)
        query = query.order_by(ranked.c.time.desc()).limit(limit)
    else:
        query = query.order_by(Step.time.desc()).limit(limit)
    rows = [
        StepRow(float(t), int(b), int(pf), int(dt), str(tech), int(d), int(p),
                tuple(int(a) for a in (app or ())), float(pm), float(sm), int(q), int(v),
                tuple(str(x) for x in (tenants or ())))
        for t, b, pf, dt, tech, d, p, app, pm, sm, q, v, tenants in session.execute(query)
    ]  # fmt: skip
    rows.reverse()
    return rows


def read_requests(session: Session, since: float, until: float | None = None) -> list[RequestRow]:
    """Finished requests (status ok) in [since, until) by finish time."""
    query = select(
        Request.tenant, Request.prompt_tokens, Request.output_tokens, Request.arrival_time,
        Request.finish_time, Request.proposed_tokens, Request.accepted_tokens,
    ).where(Request.finish_time >= since, Request.status == "ok")  # fmt: skip
    if until is not None:
        query = query.where(Request.finish_time < until)
    return [RequestRow(str(t), int(p), int(o), float(a), float(f), int(pt), int(at))
            for t, p, o, a, f, pt, at in session.execute(query)]  # fmt: skip


def count_step_rows(session: Session, since: float) -> int:
    """Steps since `since`, each counted once per sequence in its batch."""
    query = select(func.sum(Step.batch_size)).where(Step.time >= since)
    return int(session.scalar(query) or 0)


def coverage(session: Session, since: float) -> dict[str, dict[int, int]]:
    """Technique -> depth -> raw steps since `since` (what exploration still has to measure)."""
    query = (select(Step.technique, Step.depth, func.count()).where(Step.time >= since)
             .group_by(Step.technique, Step.depth))
    out: dict[str, dict[int, int]] = {}
    for technique, depth, n in session.execute(query):
        out.setdefault(str(technique), {})[int(depth)] = int(n)
    return out


def last_real_retune_start(session: Session) -> float | None:
    """Start of the newest retune that was not a recorded skip (None if there is none)."""
    query = select(func.max(Retune.started_at)).where(Retune.status != "skipped")
    started_at = session.execute(query).scalar()
    return None if started_at is None else float(started_at)


def draft_vocab_by_version(session: Session) -> dict[int, int]:
    """Policy version -> its draft vocabulary (0: full), for keying MTP measurements."""
    return {int(v): int((body or {}).get("draft_vocab", 0) or 0)
            for v, body in session.execute(select(Policy.version, Policy.body))}


def max_policy_version(session: Session) -> int | None:
    value = session.scalar(select(func.max(Policy.version)))
    return None if value is None else int(value)
