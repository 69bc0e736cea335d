"""What crosses the search's process boundary: the job in, the outcome out (both picklable).

`SearchOutcome` holds values, not JSON: the chosen `TunedPolicy`, the `Evaluation`s of it
and of the serving policy, the fit's `ErrorReport`, the fitted `PerfModel`, the observed
`Traffic`, this run's Pareto front and the per-tenant search's `TenantSearch`.
`details()` is their JSON form, stored with the retune (`xo_retunes.details`, which
dashboards read) and shown by `GET /admin/tuner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.policy import TunedPolicy
from tuner.config import TunerConfig
from tuner.model import ErrorReport, PerfModel
from tuner.objective import Capacity, Evaluation
from tuner.tenants import TenantSearch
from tuner.traffic import Traffic


@dataclass(frozen=True)
class SearchJob:
    """Everything one search needs (picklable)."""

    db_url: str
    config: TunerConfig
    capacity: Capacity
    incumbent: TunedPolicy
    """The policy serving now."""
    since: float
    until: float
    retune_id: int | None = None
    instance: str = ""
    """The daemon searching: its steps fit the step time, every instance's the acceptance."""


@dataclass(frozen=True)
class ParetoPoint:
    """One trial of this run's feasible Pareto front (two objectives)."""

    trial: int
    goodput: float
    p95_tpot_ms: float
    policy: TunedPolicy

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, "goodput": round(self.goodput, 3),
                "p95_tpot_ms": round(self.p95_tpot_ms, 4), "policy": self.policy.to_dict()}


@dataclass
class SearchOutcome:
    """The chosen policy and the evidence behind it."""

    study_name: str
    best: TunedPolicy | None
    """The chosen policy (version 0, source "tuner"), None when no trial was feasible."""
    best_trial: int | None
    predicted: Evaluation | None
    """The chosen policy on the traffic (None with `best`)."""
    incumbent: Evaluation
    """The serving policy on the same traffic."""
    fit: ErrorReport
    """The step-time and goodput error on held-out steps."""
    model: PerfModel
    traffic: Traffic
    """The traffic the search optimized for (tuner.search.observe_recent)."""
    acceptance_from: dict[str, int] = field(default_factory=dict)
    """Instance -> the steps it gave the pooled acceptance fit (tuner.search.pool_acceptance)."""
    trials: list[int] = field(default_factory=list)
    """The study's numbers of the trials this run told."""
    pareto: list[ParetoPoint] = field(default_factory=list)
    """This run's feasible Pareto front, highest goodput first (two objectives; else empty)."""
    per_batch: dict[int, tuple[float, float]] = field(default_factory=dict)
    """The chosen policy's predicted (tokens per step, step ms) of a step without prefill at
    each batch size up to the engine's largest (`decode_figures`): what validation compares
    its measured decode steps with, wherever the load takes the batch."""
    incumbent_per_batch: dict[int, tuple[float, float]] = field(default_factory=dict)
    """The same for the serving policy (what validation compares with when the serving
    policy has too few steps at the batch sizes the chosen one ran)."""
    method: str = "tpe"
    """Which optimizer decided: "exact" (tuner.split's solve; the study was told only the
    optimum and the serving policy) or "tpe" (Optuna's sampler; tuner.search, 5)."""
    seconds: float = 0.0
    """Wall time of the whole search: read, fit, solve, ask/tell, per-tenant rules."""
    tenants: TenantSearch | None = None
    """The per-tenant search's record (method, seconds, predicted gain over the best
    single-rule policy, the rules, whether they were chosen, the fill); None when it did not
    run (off, two objectives, nothing feasible)."""

    def details(self) -> dict[str, Any]:
        """The JSON the retune stores: fit, traffic, both predictions, trials, method, front,
        model and, when it ran, the per-tenant search."""
        d: dict[str, Any] = {
            "fit": self.fit.to_dict(), "traffic": self.traffic.summary(),
            "incumbent": self.incumbent.to_dict(),
            "predicted": None if self.predicted is None else self.predicted.to_dict(),
            "trials": len(self.trials), "search": {"method": self.method, "seconds": self.seconds},
            "pareto": [p.to_dict() for p in self.pareto],
            "model": {**self.model.summary(), "acceptance_from": self.acceptance_from}}
        if self.tenants is not None:  # per-tenant decisions and their predicted gain
            record = d["tenants"] = self.tenants.to_dict()
            d["search"].update(tenant_method=record["method"], tenant_seconds=record["seconds"])
        return d
