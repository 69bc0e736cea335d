"""The dashboard's data, read from the telemetry database (blocking: run in a thread).

Each function takes a Session and a window `[since, until)` and returns
JSON-ready dicts. Acceptance over time calls `telemetry.queries` once per
bucket; buckets are whole minutes aligned to the epoch, so a per-minute
rollup lands in exactly one bucket. Goodput against batch size reads the raw
steps (`queries.goodput_by_batch`): output tokens per second of step time,
per technique and batch size. The crossover batch size is the `crossover`
field of the active policy's body (`engine.policy.TunedPolicy.to_dict()`),
else the newest policy's; 0 there means the policy never speculates. Policy
and retune history come from `store.history`.

Every function takes `instance`: the daemon whose rows to show (several may
share the database), or None for every instance's (`?instance=all`).
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.orm import Session

from store import history
from store.models import Policy
from telemetry import queries

BUCKET_CHOICES_S = (60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
MAX_BUCKETS = 30


def bucket_for(window_s: float) -> int:
    """The smallest bucket (whole minutes) that cuts `window_s` into at most MAX_BUCKETS.

    >>> bucket_for(3600), bucket_for(600), bucket_for(7 * 86400)
    (120, 60, 21600)
    """
    for bucket in BUCKET_CHOICES_S:
        if window_s / bucket <= MAX_BUCKETS:
            return bucket
    return BUCKET_CHOICES_S[-1]


def acceptance_over_time(session: Session, since: float, until: float, *,
                         instance: str | None = None) -> dict[str, Any]:
    """Acceptance rate per bucket, one series per technique and one per tenant."""
    bucket = bucket_for(until - since)
    starts = range(int(since // bucket) * bucket, math.ceil(until), bucket)
    by_technique: dict[str, list[dict[str, Any]]] = {}
    by_tenant: dict[str, list[dict[str, Any]]] = {}
    for start in starts:
        end = start + bucket
        for out, rows in (
                (by_technique, queries.acceptance_by_technique(session, start, end,
                                                               instance=instance)),
                (by_tenant, queries.acceptance_by_tenant(session, start, end, instance=instance))):
            for row in rows:
                if row.proposed:
                    out.setdefault(row.key, []).append(
                        {"t": start, "rate": row.rate, "proposed": row.proposed,
                         "accepted": row.accepted})
    return {"bucket_s": bucket, "since": since, "until": until,
            "by_technique": _series(by_technique), "by_tenant": _series(by_tenant),
            "by_position": _positions(session, since, until, instance)}


def _series(points: dict[str, list[dict[str, Any]]], label: str = "key") -> list[dict[str, Any]]:
    return [{label: key, "points": pts} for key, pts in sorted(points.items())]


def _positions(session: Session, since: float, until: float,
               instance: str | None) -> list[dict[str, Any]]:
    return [{"technique": p.technique, "position": p.position, "rate": p.rate,
             "conditional_rate": p.conditional_rate}
            for p in queries.acceptance_by_position(session, since, until, instance=instance)]


def batch_histogram(session: Session, since: float, until: float, *,
                    instance: str | None = None) -> dict[str, Any]:
    hist = queries.batch_size_histogram(session, since, until, instance=instance)
    return {"since": since, "until": until,
            "bins": [{"batch_size": size, "steps": n} for size, n in hist.items()]}


def goodput_by_batch(session: Session, since: float, until: float, *,
                     instance: str | None = None) -> dict[str, Any]:
    """Output tokens/s of step time per technique and batch size, and the crossover."""
    series: dict[str, list[dict[str, Any]]] = {}
    for row in queries.goodput_by_batch(session, since, until, instance=instance):
        series.setdefault(row.technique, []).append(
            {"batch_size": row.batch_size, "steps": row.steps,
             "tokens_per_s": round(row.tokens_per_s, 3)})
    return {"since": since, "until": until, "series": _series(series, "technique"),
            "crossover": crossover(session, instance)}


def crossover(session: Session, instance: str | None = "") -> dict[str, Any] | None:
    """{"batch_size", "policy_version"} from the instance's active (else newest) policy (of
    every instance: the newest created), or None."""
    active = history.active_policy(session, instance=instance) if instance is not None else None
    policy = active or next(iter(history.policy_history(session, 1, instance=instance)), None)
    if policy is None:
        return None
    value = (policy.body or {}).get("crossover")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"batch_size": value, "policy_version": policy.version}
    return None


def retunes(session: Session, limit: int = 20, *, instance: str | None = "") -> dict[str, Any]:
    """The newest retunes, each with the policy it chose, and the policy history."""
    policies = {(p.instance, p.version): p
                for p in history.policy_history(session, limit=200, instance=instance)}
    rows = []
    for r in history.retune_history(session, limit=limit, instance=instance):
        chosen = (policies.get((r.instance, r.chosen_policy_version))
                  if r.chosen_policy_version else None)
        rows.append({
            "id": r.id, "instance": r.instance, "triggered_by": r.triggered_by,
            "status": r.status,
            "started_at": r.started_at, "finished_at": r.finished_at,
            "trial_number": r.trial_number, "predicted_goodput": r.predicted_goodput,
            "measured_goodput": r.measured_goodput, "error": r.error,
            "policy": _policy(chosen) if chosen is not None else None,
            "tenants": _tenants((r.details or {}).get("tenants")),
        })
    return {"retunes": rows,
            "policies": [_policy(p) for p in list(policies.values())[:limit]]}


def _tenants(record: Any) -> dict[str, Any] | None:
    """The per-tenant decision of a retune's search (tuner.tenants.TenantSearch.to_dict()):
    whether rules were chosen, each tenant's technique, depth and largest batch, and the
    predicted gain over the best single-rule policy; `fill`, the rules given where the window
    held none of a tenant's rows (tuner.tenant_fill); None when none was weighed or given."""
    if not isinstance(record, dict):
        return None
    fill = list(record.get("fill") or [])
    if record.get("method") in (None, "skipped") and not fill:
        return None
    keys = ("chosen", "gain", "method", "seconds", "margin", "single_goodput", "tenant_goodput")
    return {**{k: record.get(k) for k in keys}, "rules": list(record.get("rules") or []), "fill": fill}


def _policy(p: Policy) -> dict[str, Any]:
    return {"instance": p.instance, "version": p.version, "source": p.source, "created_at": p.created_at,
            "applied_at": p.applied_at, "rolled_back_at": p.rolled_back_at,
            "rollback_reason": p.rollback_reason, "body": p.body}
