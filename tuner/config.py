"""The tuner's knobs: one frozen dataclass, checked on construction.

It is also the `[tuner]` section of the daemon's settings: `crossover serve`
reads each field from `--tuner-<field>`, `CROSSOVER_TUNER_<FIELD>` or the
config file's `[tuner]` table (daemon.settings), and takes each flag's help
from the field's docstring. A field's allowed range sits in its metadata
(`between`), beside its definition; checks that involve two fields are in
`__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engine.policy import MAX_BATCH, MAX_DEPTH, MAX_POOL_SPLIT, MAX_RULES

DEFAULT_RANGES = (2, 4, 8, 16, 64)
"""Upper ends of the batch-size ranges that get their own (technique, depth)."""
DEFAULT_DRAFT_VOCABS = (8192, 32768)
"""MTP draft vocabularies offered to the search (the engine compiles these; drafting over the
full vocabulary would cost as much as the target's own output layer)."""
DAY_S = 86400.0


def between(lo: float, hi: float) -> dict[str, Any]:
    """Field metadata: the value must lie in [lo, hi] (checked by TunerConfig.__post_init__)."""
    return {"range": (lo, hi)}


@dataclass(frozen=True)
class TunerConfig:
    """What the tuner fits, searches, demands and validates, and how the daemon runs it."""

    enabled: bool = True
    """Run the periodic retunes and exploration (admin retunes and pins work either way)."""
    interval_s: float = field(default=600.0, metadata=between(0.01, 7 * DAY_S))
    """Seconds between scheduled retunes."""
    search_process: bool = True
    """Run each search in a separate process (off the engine thread's GIL)."""
    search_timeout_s: float = field(default=900.0, metadata=between(1.0, DAY_S))
    """Longest a search may run, seconds; past it the retune fails and the search's process is
    killed (a search in the daemon's own process is abandoned instead)."""
    explore_share: float = field(default=0.02, metadata=between(0.0, 0.5))
    """Share of decode steps that try a neighbouring depth, keeping the model fresh."""
    profile_steps: int = field(default=200, metadata=between(0, 1 << 30))
    """Decode steps after startup of which every other one measures an unmeasured (technique,
    depth) cell."""
    study_name: str = "crossover-tuner"
    """Optuna study name prefix; the search space's fingerprint is appended."""
    trials: int = field(default=48, metadata=between(1, 2000))
    """New trials asked and told per TPE search (an exact solve tells at most two)."""
    max_study_trials: int = field(default=2000, metadata=between(1, 1 << 20))
    """A study this full is continued by a new generation (TPE reads every trial per ask)."""
    two_objective: bool = False
    """Maximize goodput and minimize p95 TPOT (a Pareto front) instead of goodput alone."""
    exact: bool = True
    """Solve for the best policy exactly and tell the study only it and the serving policy when
    it meets every constraint (tuner.exact); False: always `trials` trials of TPE."""
    tenant_rules: bool = True
    """Consider per-tenant rules (a tenant's rows draft with their own technique and depth) on
    top of the best single-rule policy (tuner.tenants)."""
    tenant_min_gain: float = field(default=0.03, metadata=between(0.0, 1.0))
    """Per-tenant rules are chosen only when their predicted goodput beats the best
    single-rule policy's by more than this share (a margin against the model's error)."""
    tenant_trials: int = field(default=64, metadata=between(1, 2000))
    """TPE trials of the per-tenant search when its space is too large to enumerate."""
    tenant_exact_limit: int = field(default=1024, metadata=between(1, 1 << 20))
    """The per-tenant search enumerates every combination up to this many, else runs TPE."""
    tpot_p95_ms: float = field(default=0.0, metadata=between(0.0, 1e6))
    """Constraint on the predicted p95 time per output token in ms; 0 turns it off."""
    ranges: tuple[int, ...] = DEFAULT_RANGES
    """Batch-size range upper ends; the last one also covers larger batches."""
    max_depth: int = field(default=MAX_DEPTH, metadata=between(1, MAX_DEPTH))
    """Deepest speculation searched and explored (the engine may allow less)."""
    max_pool_split: float = field(default=MAX_POOL_SPLIT, metadata=between(0.0, MAX_POOL_SPLIT))
    """Largest share of the KV pool the search may lend to speculation."""
    pool_split_step: float = 0.05
    """Granularity of the pool split."""
    draft_vocabs: tuple[int, ...] = DEFAULT_DRAFT_VOCABS
    """Draft vocabulary sizes searched when an MTP proposer is loaded."""
    fit_window_s: float = field(default=3600.0, metadata=between(0.01, 30 * DAY_S))
    """Telemetry (raw steps and requests) that the model and traffic are read from, seconds."""
    traffic_window_s: float = field(default=600.0, metadata=between(0.01, 30 * DAY_S))
    """Recent telemetry whose batch sizes, arrivals and tenant mix a retune optimizes for, so a
    policy follows the traffic of now while the model fits the whole fit window; with fewer
    than 8 steps in it, the fit window's traffic is used."""
    max_fit_rows: int = field(default=50_000, metadata=between(1, 1 << 30))
    """Most recent raw steps read for a fit."""
    cost_window_s: float = field(default=21600.0, metadata=between(0.0, 30 * DAY_S))
    """Older telemetry whose steps fill the step-time fit's gaps, seconds before the fit window:
    a (batch size, depth) with fewer than MIN_SHAPE_STEPS steps in the fit window takes its
    newest ones from here (tuner.stepfit.cost_history). Step times follow the machine and the
    rows, not the traffic; acceptance and traffic come from the fit window only."""
    min_new_steps: int = field(default=500, metadata=between(0, 1 << 30))
    """A scheduled retune is skipped (and recorded) with fewer new steps since the last one,
    each counted once per sequence it ran (tuner.data.count_step_rows): a step of 32
    sequences measures 32 of them, so a few slow steps at a large batch do not hold off the
    retune that would replace their policy."""
    min_gain: float = field(default=0.02, metadata=between(0.0, 1e6))
    """A candidate must beat the current policy's predicted goodput by this share."""
    concurrency_quantile: float = 0.95
    """Quantile of observed concurrency (running + waiting) the KV pool must hold."""
    validation_s: float = field(default=120.0, metadata=between(0.0, DAY_S))
    """Longest validation window after applying a policy, seconds; one that has seen fewer
    steps than a verdict needs (tuner.validate.enough_evidence) runs on for them, to 4x as
    long (tuner.service, 5)."""
    validation_min_steps: int = field(default=200, metadata=between(1, 1 << 30))
    """Validation ends early once the new policy has this many matched steps."""
    validation_poll_s: float = field(default=0.0, metadata=between(0.0, 3600.0))
    """How often the validation window re-reads telemetry, seconds (0: validation_s / 20,
    kept within [0.05, 2])."""
    baseline_s: float = field(default=600.0, metadata=between(0.01, 30 * DAY_S))
    """Telemetry of the previous policy that a new policy's validation compares against."""
    rollback_margin: float = field(default=0.05, metadata=between(0.0, 1.0))
    """Roll back when measured goodput is worse by more than this share (or the noise if larger)."""
    noise_z: float = field(default=2.0, metadata=between(0.0, 100.0))
    """Standard errors of the goodput difference that count as noise."""
    prediction_margin: float = 0.3
    """With no matched steps of the previous policy, roll back when measured goodput is this
    share below the model's prediction at the same batch sizes (tuner.validate.against_prediction)."""
    seed: int | None = None
    """Base sampler seed, offset by the study's trial count (no repeats); None: random."""

    def __post_init__(self) -> None:
        for f in fields(self):
            lo, hi = f.metadata.get("range", (None, None))
            value = getattr(self, f.name)
            if lo is not None and not lo <= value <= hi:
                raise ValueError(f"{f.name}={value!r} must be in [{lo}, {hi}]")
        if self.trials > self.max_study_trials:
            raise ValueError(f"trials={self.trials} must be <= max_study_trials="
                             f"{self.max_study_trials}")
        if not self.ranges or list(self.ranges) != sorted(set(self.ranges)) or self.ranges[0] < 1:
            raise ValueError(f"ranges={self.ranges} must be strictly ascending positive integers")
        if len(self.ranges) > MAX_RULES or self.ranges[-1] > MAX_BATCH:
            raise ValueError(f"ranges={self.ranges} must be at most {MAX_RULES} values up to "
                             f"{MAX_BATCH} (a policy's rule limits)")
        if not 0.0 < self.pool_split_step <= max(self.max_pool_split, 0.01):
            raise ValueError(f"pool_split_step={self.pool_split_step} must be in "
                             f"(0, max_pool_split={self.max_pool_split}]")
        if not 0.0 < self.concurrency_quantile <= 1.0:
            raise ValueError(f"concurrency_quantile={self.concurrency_quantile} must be in (0, 1]")
        if not 0.0 < self.prediction_margin <= 1.0:
            raise ValueError(f"prediction_margin={self.prediction_margin} must be in (0, 1]")

    @property
    def poll_s(self) -> float:
        """Seconds between the validation window's reads (see validation_poll_s).

        >>> TunerConfig().poll_s, TunerConfig(validation_s=3.0).poll_s
        (2.0, 0.15)
        """
        if self.validation_poll_s > 0:
            return self.validation_poll_s
        return max(0.05, min(2.0, self.validation_s / 20))
