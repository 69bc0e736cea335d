"""The tuner's knobs: one frozen dataclass, checked on construction (STYLE 15)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.policy import MAX_POOL_SPLIT

DEFAULT_RANGES = (2, 4, 8, 16, 64)
"""Upper ends of the batch-size ranges that get their own (technique, depth)."""
DEFAULT_DRAFT_VOCABS = (8192, 32768)
"""MTP draft vocabularies offered to the search (the engine compiles these; drafting over the
full vocabulary would cost as much as the target's own output layer)."""


@dataclass(frozen=True)
class TunerConfig:
    """What the tuner fits, searches, demands and validates."""

    study_name: str = "crossover-tuner"
    """Optuna study name prefix; the search space's fingerprint is appended."""
    trials: int = 48
    """New trials asked and told per TPE search (an exact solve tells at most two)."""
    max_study_trials: int = 2000
    """A study this full is continued by a new generation (TPE reads every trial per ask)."""
    two_objective: bool = False
    """Maximize goodput and minimize p95 TPOT (a Pareto front) instead of goodput alone."""
    exact: bool = True
    """Solve for the best policy exactly and tell the study only it and the serving policy when
    it meets every constraint (tuner.exact); False: always `trials` trials of TPE."""
    tpot_p95_ms: float = 0.0
    """Constraint on the predicted p95 time per output token (ms); 0 turns it off."""
    ranges: tuple[int, ...] = DEFAULT_RANGES
    """Batch-size range upper ends; the last one also covers larger batches."""
    max_depth: int = 8
    """Deepest speculation searched (the engine may allow less)."""
    max_pool_split: float = MAX_POOL_SPLIT
    """Largest share of the KV pool the search may lend to speculation."""
    pool_split_step: float = 0.05
    """Granularity of the pool split."""
    draft_vocabs: tuple[int, ...] = DEFAULT_DRAFT_VOCABS
    """Draft vocabulary sizes searched when an MTP proposer is loaded."""
    fit_window_s: float = 3600.0
    """Telemetry (raw steps and requests) that the model and traffic are read from."""
    traffic_window_s: float = 600.0
    """Recent telemetry whose batch sizes, arrivals and tenant mix the objective averages over,
    so a policy follows the traffic of now while the model fits the whole fit window; with
    fewer than 8 steps in it, the fit window's traffic is used."""
    max_fit_rows: int = 50_000
    """Most recent raw steps read for a fit."""
    cost_window_s: float = 21600.0
    """Older telemetry (before the fit window) whose steps fill the step-time fit's gaps: a
    (batch, query length) shape with fewer than MIN_SHAPE_STEPS steps in the fit window takes
    its newest ones from here (tuner.model.cost_history). Step times follow the machine and
    the shapes, not the traffic; acceptance and traffic come from the fit window only."""
    min_new_steps: int = 500
    """A scheduled retune is skipped (and recorded) with fewer new steps since the last one,
    each counted once per sequence it ran (tuner.data.count_step_rows): a step of 32
    sequences measures 32 of them. Counted as steps, a deep draft at batch 32 (2.7 s a step)
    held off the retunes that would replace it for 30 s of a compressed trace."""
    min_gain: float = 0.02
    """A candidate must beat the current policy's predicted goodput by this share."""
    concurrency_quantile: float = 0.95
    """Quantile of observed concurrency (running + waiting) the KV pool must hold."""
    validation_s: float = 120.0
    """Longest validation window after applying a policy."""
    validation_min_steps: int = 200
    """Validation ends early once the new policy has this many matched steps."""
    validation_poll_s: float = 2.0
    """How often the validation window re-reads telemetry."""
    baseline_s: float = 600.0
    """Telemetry of the previous policy compared against (just before the apply)."""
    rollback_margin: float = 0.05
    """Roll back when measured goodput is worse by more than this share (or the noise if larger)."""
    noise_z: float = 2.0
    """Standard errors of the goodput difference that count as noise."""
    prediction_margin: float = 0.3
    """With no matched steps of the previous policy, roll back when measured goodput is this
    share below the model's prediction at the same batch sizes (tuner.validate.against_prediction)."""
    seed: int | None = None
    """Base sampler seed, offset by the study's trial count (no repeats); None: random."""

    def __post_init__(self) -> None:
        if not 1 <= self.trials <= self.max_study_trials:
            raise ValueError(f"trials={self.trials} must be in [1, max_study_trials="
                             f"{self.max_study_trials}]")
        if not self.ranges or list(self.ranges) != sorted(set(self.ranges)) or self.ranges[0] < 1:
            raise ValueError(f"ranges={self.ranges} must be strictly ascending positive integers")
        if not 1 <= self.max_depth <= 8:
            raise ValueError(f"max_depth={self.max_depth} must be in [1, 8]")
        if not 0.0 <= self.max_pool_split <= MAX_POOL_SPLIT:
            raise ValueError(
                f"max_pool_split={self.max_pool_split} must be in [0, {MAX_POOL_SPLIT}]")
        if not 0.0 < self.pool_split_step <= max(self.max_pool_split, 0.01):
            raise ValueError(f"pool_split_step={self.pool_split_step} must be in "
                             f"(0, max_pool_split={self.max_pool_split}]")
        if not 0.0 < self.concurrency_quantile <= 1.0:
            raise ValueError(f"concurrency_quantile={self.concurrency_quantile} must be in (0, 1]")
        if self.tpot_p95_ms < 0 or self.min_gain < 0 or self.rollback_margin < 0:
            raise ValueError("tpot_p95_ms, min_gain and rollback_margin must be >= 0")
        if not 0.0 < self.prediction_margin <= 1.0:
            raise ValueError(f"prediction_margin={self.prediction_margin} must be in (0, 1]")
        if self.cost_window_s < 0:
            raise ValueError(f"cost_window_s={self.cost_window_s} must be >= 0")
        if not 0 < self.traffic_window_s or not 0 < self.fit_window_s:
            raise ValueError(f"fit_window_s={self.fit_window_s} and traffic_window_s="
                             f"{self.traffic_window_s} must be > 0")
        if self.validation_s < 0 or self.validation_poll_s <= 0 or self.baseline_s <= 0:
            raise ValueError(f"validation_s={self.validation_s} must be >= 0 and "
                             f"validation_poll_s={self.validation_poll_s}, "
                             f"baseline_s={self.baseline_s} > 0")
