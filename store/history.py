"""Every read and write of the policy and retune history (`xo_policies`, `xo_retunes`).

The tuner, /admin, /metrics and the dashboard all come here; nothing else
queries these two tables. Every function takes the Session explicitly; the
caller commits (`store.db.session_scope`).

Each daemon sharing a database is an instance (`xo_*.instance`; "" for a
single daemon): every function takes `instance`, and policy versions count
per instance (UNIQUE(instance, version)). The listings and counts also take
`instance=None`, every instance (a dashboard's "all").
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from store.models import (
    POLICY_SOURCES,
    RETUNE_STATUSES,
    RETUNE_TRIGGERS,
    Policy,
    Retune,
)


def save_policy(
    session: Session, version: int, body: dict[str, Any], source: str, at: float | None = None,
    *, instance: str = "",
) -> Policy:
    """Record a new policy version of `instance` (not yet applied); a version the instance
    already has raises sqlalchemy.exc.IntegrityError (at this flush)."""
    if source not in POLICY_SOURCES:
        raise ValueError(f"source must be one of {POLICY_SOURCES}, got {source!r}")
    policy = Policy(instance=instance, version=version, body=body, source=source,
                    created_at=_now(at))
    session.add(policy)
    session.flush()
    return policy


def get_policy(session: Session, version: int, *, instance: str = "") -> Policy:
    """The instance's policy with this version (raises LookupError when there is none)."""
    query = select(Policy).where(Policy.instance == instance, Policy.version == version)
    policy = session.scalars(query).first()
    if policy is None:
        raise LookupError(f"no policy version {version} of instance {instance!r}")
    return policy


def mark_applied(session: Session, version: int, at: float | None = None, *,
                 instance: str = "") -> Policy:
    policy = get_policy(session, version, instance=instance)
    policy.applied_at = _now(at)
    return policy


def mark_rolled_back(
    session: Session, version: int, reason: str, at: float | None = None, *, instance: str = ""
) -> Policy:
    policy = get_policy(session, version, instance=instance)
    policy.rolled_back_at = _now(at)
    policy.rollback_reason = reason
    return policy


def start_retune(
    session: Session,
    triggered_by: str,
    study_name: str | None = None,
    trial_number: int | None = None,
    at: float | None = None,
    *,
    instance: str = "",
) -> Retune:
    """Record a retune of `instance` that has just started (status "running")."""
    if triggered_by not in RETUNE_TRIGGERS:
        raise ValueError(f"triggered_by must be one of {RETUNE_TRIGGERS}, got {triggered_by!r}")
    retune = Retune(
        instance=instance, triggered_by=triggered_by, started_at=_now(at), status="running",
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


def policy_history(session: Session, limit: int = 50, *,
                   instance: str | None = "") -> list[Policy]:
    """The newest policies first (of every instance with None: newest created first)."""
    order = (Policy.version.desc(),) if instance is not None else (
        Policy.created_at.desc(), Policy.id.desc())
    query = _of(select(Policy), Policy, instance).order_by(*order).limit(limit)
    return list(session.scalars(query))


def active_policy(session: Session, *, instance: str = "") -> Policy | None:
    """The instance's most recently applied policy that was not rolled back."""
    query = (
        select(Policy)
        .where(Policy.instance == instance, Policy.applied_at.is_not(None),
               Policy.rolled_back_at.is_(None))
        .order_by(Policy.applied_at.desc(), Policy.version.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def max_policy_version(session: Session, *, instance: str = "") -> int | None:
    """The instance's highest policy version recorded (None before its first)."""
    value = session.scalar(select(func.max(Policy.version)).where(Policy.instance == instance))
    return None if value is None else int(value)


def draft_vocab_by_version(session: Session, *, instance: str = "") -> dict[int, int]:
    """The instance's policy version -> its draft vocabulary (0: full), for keying MTP
    measurements."""
    query = select(Policy.version, Policy.body).where(Policy.instance == instance)
    return {int(v): int((body or {}).get("draft_vocab", 0) or 0)
            for v, body in session.execute(query)}


def draft_vocab_by_instance(session: Session) -> dict[str, dict[int, int]]:
    """draft_vocab_by_version of every instance: instance -> version -> draft vocabulary."""
    out: dict[str, dict[int, int]] = {}
    for instance, v, body in session.execute(select(Policy.instance, Policy.version, Policy.body)):
        out.setdefault(str(instance), {})[int(v)] = int((body or {}).get("draft_vocab", 0) or 0)
    return out


def get_retune(session: Session, retune_id: int, *, instance: str | None = None) -> Retune | None:
    """One retune by id (None when there is none, or when it is not `instance`'s)."""
    retune = session.get(Retune, retune_id)
    if retune is None or (instance is not None and retune.instance != instance):
        return None
    return retune


def running_retunes(session: Session, *, instance: str = "") -> list[Retune]:
    """The instance's retunes still marked "running", oldest first."""
    query = (select(Retune).where(Retune.instance == instance, Retune.status == "running")
             .order_by(Retune.id))
    return list(session.scalars(query))


def retune_history(session: Session, limit: int = 50, since: float | None = None, *,
                   instance: str | None = "") -> list[Retune]:
    """The newest retunes first (of every instance with None)."""
    query = (_of(select(Retune), Retune, instance)
             .order_by(Retune.started_at.desc(), Retune.id.desc()).limit(limit))
    if since is not None:
        query = query.where(Retune.started_at >= since)
    return list(session.scalars(query))


def retune_counts(session: Session, *, instance: str | None = "") -> dict[str, int]:
    """Retunes recorded, by status (of every instance with None)."""
    query = _of(select(Retune.status, func.count()), Retune, instance).group_by(Retune.status)
    return {str(status): int(n) for status, n in session.execute(query)}


def last_real_retune_start(session: Session, *, instance: str = "") -> float | None:
    """Start of the instance's newest retune that was not a recorded skip (None if none)."""
    query = select(func.max(Retune.started_at)).where(Retune.instance == instance,
                                                      Retune.status != "skipped")
    started_at = session.execute(query).scalar()
    return None if started_at is None else float(started_at)


def instances(session: Session) -> list[str]:
    """Every instance with a policy or a retune, sorted."""
    names = set(session.scalars(select(Policy.instance).distinct()))
    names |= set(session.scalars(select(Retune.instance).distinct()))
    return sorted(names)


def _of(query: Select, table: type[Policy | Retune], instance: str | None) -> Select:
    """`query` limited to one instance's rows (None: every instance)."""
    return query if instance is None else query.where(table.instance == instance)


def _now(at: float | None) -> float:
    return time.time() if at is None else at
