"""Fill a telemetry database with 40 minutes of plausible traffic for the dashboard tests.

Steps and requests go through the Recorder, policies and retunes through
store.history, as a serving daemon and its tuner would write them. The
numbers follow a small model in which speculation pays below a batch size of
about 14: step time grows with batch size times (1 + depth), tokens per step
with the accepted drafts.

    .venv/bin/python -m tests.daemon.dashboard_fill /tmp/dash.db   # to look at it by hand
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import replace

from sqlalchemy.orm import Session

from engine.types import RequestResult, StepStats
from store.db import make_engine, session_scope
from store.history import (
    finish_retune,
    mark_applied,
    mark_rolled_back,
    save_policy,
    start_retune,
)
from store.migrate import ensure_schema
from telemetry.recorder import Recorder

MINUTES = 40
TECHNIQUES = {  # name: (depth, P(accept at position i | accepted before), base ms, ms per seq)
    "none": (0, (), 8.0, 0.25),
    "ngram": (3, (0.62, 0.65, 0.6), 9.0, 1.2),
    "mtp": (2, (0.74, 0.7), 8.5, 1.1),
}
TENANTS = {"team-a": 0.72, "team-b": 0.48, "team-c": 0.31}  # acceptance of each tenant's drafts
CROSSOVER = 14


def fill(url: str, now: float | None = None, seed: int = 7) -> None:
    """Write steps, requests, policies and retunes ending at `now`."""
    ensure_schema(url)
    now = time.time() if now is None else now
    rng = random.Random(seed)
    start = now - MINUTES * 60
    with Recorder(url, flush_interval_s=0.05) as rec:
        for i, t in enumerate(_times(start, now, 2.0)):
            step = _step(i, t, rng, (t - start) / (now - start))
            rec.record_step(replace(step, policy_version=_version_at((now - t) / 60)))
        for i, t in enumerate(_times(start, now, 9.0)):
            rec.record_request(_request(i, t, rng))
        # flush before close: Recorder.close can lose records queued while a write
        # that began before close() was running (reported; the daemon flushes first too)
        assert rec.flush(30.0), rec.stats()
    engine = make_engine(url)
    try:
        with session_scope(engine) as session:
            _history(session, now)
    finally:
        engine.dispose()


def _times(start: float, end: float, every_s: float) -> list[float]:
    return [start + k * every_s for k in range(int((end - start) / every_s))]


def _step(i: int, t: float, rng: random.Random, progress: float) -> StepStats:
    batch = max(1, min(32, round(rng.triangular(1, 32, 9))))
    explore = rng.random() < 0.3
    technique = rng.choice(list(TECHNIQUES)) if explore else (
        "ngram" if batch <= CROSSOVER else "none")
    depth, probs, base_ms, per_seq_ms = TECHNIQUES[technique]
    drift = 1.0 + 0.12 * math.sin(progress * 2 * math.pi)  # acceptance wanders over time
    per_pos, reach = [], float(batch)
    for p in probs:
        reach *= min(0.97, p * drift * rng.uniform(0.9, 1.1))
        per_pos.append(round(reach))
    step_ms = (base_ms + per_seq_ms * batch * (1 + depth) * 0.25) * rng.uniform(0.95, 1.05)
    return StepStats(
        step_id=i, time=t, batch_size=batch, prefill_tokens=rng.choice((0, 0, 0, 128)),
        decode_tokens=batch + sum(per_pos), technique=technique, depth=depth,
        proposed=batch * depth, accepted=sum(per_pos), accepted_per_pos=tuple(per_pos),
        propose_ms=0.3 * depth, verify_ms=step_ms * 0.8, step_ms=step_ms,
        kv_pages_used=40 + 6 * batch, kv_pages_free=4096 - 40 - 6 * batch, queue_len=0,
        policy_version=0, tenants=tuple(sorted(TENANTS)[: 1 + batch % 3]),
    )  # fmt: skip


def _version_at(minutes_ago: float) -> int:
    """The policy in force then (see _history: v3 was rolled back after two minutes)."""
    for since, version in ((10, 4), (18, 2), (20, 3), (30, 2)):
        if minutes_ago < since:
            return version
    return 1


def _request(i: int, t: float, rng: random.Random) -> RequestResult:
    tenant = rng.choice(sorted(TENANTS))
    proposed = rng.randint(40, 200)
    rate = min(0.95, TENANTS[tenant] * rng.uniform(0.85, 1.15))
    output = rng.randint(20, 300)
    return RequestResult(
        request_id=f"cmpl-{i}", tenant=tenant, prompt_tokens=rng.randint(10, 900),
        output_tokens=output, arrival_time=t - 3.0, first_token_time=t - 2.8, finish_time=t,
        finish_reason=rng.choice(("stop", "stop", "length")), proposed_tokens=proposed,
        accepted_tokens=round(proposed * rate),
    )  # fmt: skip


def _policy_body(version: int, crossover: int | None, source: str) -> dict[str, object]:
    """Shaped like `engine.policy.TunedPolicy.to_dict()`."""
    rules = [{"max_batch": crossover, "technique": "ngram", "depth": 3}] if crossover else []
    return {"rules": [*rules, {"max_batch": 1 << 30, "technique": "none", "depth": 0}],
            "crossover": crossover or 0, "pool_split": 0.05 if crossover else 0.0,
            "version": version, "draft_vocab": 0, "source": source, "extra": {}}


def _history(session: Session, now: float) -> None:
    def ago(minutes: float) -> float:
        return now - minutes * 60

    save_policy(session, 1, _policy_body(1, None, "default"), "default", at=ago(45))
    mark_applied(session, 1, at=ago(45))
    plan = [  # (started min ago, trigger, status, version, crossover, predicted, measured, error)
        (31, "schedule", "applied", 2, 12, 1810.0, 1765.0, None),
        (21, "schedule", "rejected", 3, 20, 1920.0, 1640.0, None),
        (11, "admin", "applied", 4, CROSSOVER, 1955.0, 1931.0, None),
        (2, "schedule", "failed", None, None, None, None, "not enough telemetry since v4"),
    ]
    for minutes, trigger, status, version, crossover, predicted, measured, error in plan:
        retune = start_retune(session, trigger, "crossover-tuner", at=ago(minutes))
        if version is not None:
            save_policy(session, version, _policy_body(version, crossover, "tuner"), "tuner",
                        at=ago(minutes - 0.5))
            mark_applied(session, version, at=ago(minutes - 1))
            if status == "rejected":
                mark_rolled_back(session, version, "measured goodput below the prediction",
                                 at=ago(minutes - 3))
        finish_retune(session, retune.id, status, predicted_goodput=predicted,
                      measured_goodput=measured, chosen_policy_version=version,
                      trial_number=minutes, error=error, at=ago(minutes - 3),
                      details=_tenant_details(version))


def _tenant_details(version: int | None) -> dict | None:
    """A retune's per-tenant decision (tuner.tenants.TenantSearch.to_dict()): v4 gave two
    tenants rules of their own, v2's search weighed them and kept the single rule (and gave
    team-c none below the batch sizes its window observed, tuner.tenant_fill)."""
    if version == 4:
        rules = [{"tenant": "team-a", "technique": "ngram", "depth": 3, "max_batch": 8},
                 {"tenant": "team-c", "technique": "none", "depth": 0, "max_batch": 8}]
        return {"tenants": {"method": "exact", "seconds": 0.04, "chosen": True, "gain": 0.062,
                            "margin": 0.03, "single_goodput": 1841.0, "tenant_goodput": 1955.0,
                            "rules": rules}}
    if version == 2:
        return {"tenants": {"method": "tpe", "seconds": 0.3, "chosen": False, "gain": 0.011,
                            "margin": 0.03, "single_goodput": 1810.0, "tenant_goodput": 1830.0,
                            "rules": [], "fill": [{"tenant": "team-c", "technique": "none",
                                                   "depth": 0, "max_batch": 4}]}}
    return None


if __name__ == "__main__":  # pragma: no cover
    fill(sys.argv[1])
