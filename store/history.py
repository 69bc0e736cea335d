"""Every read and write of the policy and retune history (`xo_policies`, `xo_retunes`).

The tuner, /admin, /metrics and the dashboard all come here; nothing else
queries these two tables. Every function takes the Session explicitly; the
caller commits (`store.db.session_scope`).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.models import (
    POLICY_SOURCES,
    RETUNE_STATUSES,
    RETUNE_TRIGGERS,
    Policy,
    Retune,
)


def save_policy(
    session: Session, version: int, body: dict[str, Any], source: str, at: float | None = None
) -> Policy:
    """Record a new policy version (not yet applied)."""
    if source not in POLICY_SOURCES:
        raise ValueError(f"source must be one of {POLICY_SOURCES}, got {source!r}")
    policy = Policy(version=version, body=body, source=source, created_at=_now(at))
    session.add(policy)
    session.flush()
    return policy


def get_policy(session: Session, version: int) -> Policy:
    """The policy with this version (raises LookupError when there is none)."""
    policy = session.scalars(select(Policy).where(Policy.version == version)).first()
    if policy is None:
        raise LookupError(f"no policy version {version}")
    return policy


def mark_applied(session: Session, version: int, at: float | None = None) -> Policy:
    policy = get_policy(session, version)
    policy.applied_at = _now(at)
    return policy


def mark_rolled_back(
    session: Session, version: int, reason: str, at: float | None = None
) -> Policy:
    policy = get_policy(session, version)
    policy.rolled_back_at = _now(at)
    policy.rollback_reason = reason
    return policy


def start_retune(
    session: Session,
    triggered_by: str,
    study_name: str | None = None,
    trial_number: int | None = None,
    at: float | None = None,
) -> Retune:
    """Record a retune that has just started (status "running")."""
    if triggered_by not in RETUNE_TRIGGERS:
        raise ValueError(f"triggered_by must be one of {RETUNE_TRIGGERS}, got {triggered_by!r}")
    retune = Retune(
        triggered_by=triggered_by, started_at=_now(at), status="running",
        study_name=study_name, trial_number=trial_number,
    )  # fmt: skip
    session.add(retune)
    session.flush()
    return retune


def finish_retune(
    session: Session,
    retune_id: int,
    status: str,
    *,
    predicted_goodput: float | None = None,
    measured_goodput: float | None = None,
    chosen_policy_version: int | None = None,
    trial_number: int | None = None,
    error: str | None = None,
    details: dict[str, Any] | None = None,
    at: float | None = None,
) -> Retune:
    """Close a retune with its outcome ("applied", "rejected", "failed", "skipped", or
    "interrupted": a stopped daemon left it running)."""
    if status not in RETUNE_STATUSES or status == "running":
        raise ValueError(f"status must be one of {RETUNE_STATUSES[1:]}, got {status!r}")
    retune = get_retune(session, retune_id)
    if retune is None:
        raise LookupError(f"no retune {retune_id}")
    retune.finished_at = _now(at)
    retune.status = status
    retune.predicted_goodput = predicted_goodput
    retune.measured_goodput = measured_goodput
    retune.chosen_policy_version = chosen_policy_version
    if trial_number is not None:
        retune.trial_number = trial_number
    retune.error = error
    retune.details = details
    return retune


def policy_history(session: Session, limit: int = 50) -> list[Policy]:
    """The newest policies first."""
    return list(session.scalars(select(Policy).order_by(Policy.version.desc()).limit(limit)))


def active_policy(session: Session) -> Policy | None:
    """The most recently applied policy that was not rolled back."""
    query = (
        select(Policy)
        .where(Policy.applied_at.is_not(None), Policy.rolled_back_at.is_(None))
        .order_by(Policy.applied_at.desc(), Policy.version.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def max_policy_version(session: Session) -> int | None:
    """The highest policy version recorded (None before the first)."""
    value = session.scalar(select(func.max(Policy.version)))
    return None if value is None else int(value)


def draft_vocab_by_version(session: Session) -> dict[int, int]:
    """Policy version -> its draft vocabulary (0: full), for keying MTP measurements."""
    return {int(v): int((body or {}).get("draft_vocab", 0) or 0)
            for v, body in session.execute(select(Policy.version, Policy.body))}


def get_retune(session: Session, retune_id: int) -> Retune | None:
    """One retune by id (None when there is none)."""
    return session.get(Retune, retune_id)


def running_retunes(session: Session) -> list[Retune]:
    """Retunes still marked "running", oldest first."""
    query = select(Retune).where(Retune.status == "running").order_by(Retune.id)
    return list(session.scalars(query))


def retune_history(session: Session, limit: int = 50, since: float | None = None) -> list[Retune]:
    """The newest retunes first."""
    query = select(Retune).order_by(Retune.started_at.desc(), Retune.id.desc()).limit(limit)
    if since is not None:
        query = query.where(Retune.started_at >= since)
    return list(session.scalars(query))


def retune_counts(session: Session) -> dict[str, int]:
    """Retunes recorded, by status."""
    rows = session.execute(select(Retune.status, func.count()).group_by(Retune.status))
    return {str(status): int(n) for status, n in rows}


def last_real_retune_start(session: Session) -> float | None:
    """Start of the newest retune that was not a recorded skip (None if there is none)."""
    query = select(func.max(Retune.started_at)).where(Retune.status != "skipped")
    started_at = session.execute(query).scalar()
    return None if started_at is None else float(started_at)


def _now(at: float | None) -> float:
    return time.time() if at is None else at
