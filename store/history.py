"""Writers for policy and retune history (the tuner and /admin call these).

Readers live in telemetry/queries.py. Every function takes the Session
explicitly; the caller commits (`store.db.session_scope`).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.models import POLICY_SOURCES, RETUNE_STATUSES, RETUNE_TRIGGERS, Policy, Retune


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
    """Close a retune with its outcome ("applied", "rejected", "failed" or "skipped")."""
    if status not in RETUNE_STATUSES or status == "running":
        raise ValueError(f"status must be one of {RETUNE_STATUSES[1:]}, got {status!r}")
    retune = session.get(Retune, retune_id)
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


def _now(at: float | None) -> float:
    return time.time() if at is None else at
