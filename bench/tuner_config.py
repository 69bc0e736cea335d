"""`crossover bench tuner`'s configuration: what the flags (cli/commands/bench_tuner.py) ask for,
and the tuner settings scaled to the phase length (bench/tuner.py runs it).
"""

from __future__ import annotations

from dataclasses import dataclass

TUNED = ("autotuned", "single-rule")
"""The runs with the tuner on, in the order they run: the autotuned daemon, and the same with
per-tenant rules off (module doc, 3)."""


@dataclass(frozen=True)
class TunerBenchConfig:
    """What `crossover bench tuner` was asked to do."""

    phase_s: float = 60.0
    """Length of each of the trace's three phases."""
    rate_scale: float = 1.0
    """Factor on the trace's arrival rates (0.5 and 2 requests/s by default)."""
    low_rate: float = 0.5
    """Arrivals per second of the low-load phases, before rate_scale: ~30 requests a low phase
    (13-16 at 0.25, where one request more or less moved a phase's goodput by several %)."""
    high_rate: float = 2.0
    """Arrivals per second of the high-load phase, before rate_scale (on a 2-core CPU, more
    than the engine serves at batch 32: the batch fills up and a queue waits)."""
    low_max_concurrency: int | None = 2
    """Most requests in flight during a low-load phase, so it runs at batch 1-2 (None: no cap)."""
    mid_phase: bool = False
    """Add a fourth phase, "mid-mixed": every kind (so every tenant) at moderate load, where one
    depth for the whole batch is a compromise between tenants (bench.workloads.shifting_trace)."""
    mid_rate: float = 2.0
    """Arrivals per second of the mid-mixed phase, before rate_scale (more than its cap serves,
    so it runs near mid_max_concurrency)."""
    mid_max_concurrency: int = 8
    """Most requests in flight during the mid-mixed phase: batches of about 4-8."""
    max_tokens: int | None = None
    """Cap on each request's max_tokens (None: the kind's suggestion, 96-256)."""
    ignore_eos: bool = False
    """Ask for exactly max_tokens tokens (vLLM's ignore_eos)."""
    seed: int = 0
    """Seed of the trace (arrival times, kinds, prompts)."""
    temperatures: tuple[tuple[str, float], ...] = (("chat", 0.8), ("prose", 0.8))
    """(kind, temperature) of the kinds whose requests are sampled, each with its own seed;
    the other kinds are greedy. Chat clients sample (OpenAI's default temperature is 1); edits
    and code run greedy. Sampled text quotes itself less, so n-gram drafts fewer tokens."""
    drain: bool = True
    """Start each phase once the previous one's requests finished (no backlog carried over)."""
    techniques: tuple[str, ...] = ()
    """Proposers loaded, hence the autotuned run's choices, and the fixed policies'
    techniques unless `fixed_techniques` says (empty: every proposer the model has)."""
    fixed_techniques: tuple[str, ...] = ()
    """Techniques of the fixed policies, among those loaded (empty: every loaded one)."""
    depths: tuple[int, ...] = (2, 4, 8)
    """Depths of the fixed policies."""
    table: tuple[tuple[int, int], ...] = ((4, 4), (8, 2))
    """The batch-size table: (up to batch, depth) ascending; larger batches do not speculate."""
    table_technique: str = "ngram"
    """Technique of the batch-size table."""
    pool_split: float = 0.25
    """Pool split of static policies using a model-based proposer (n-gram uses 0)."""
    runs: tuple[str, ...] = ("autotuned", "never", "fixed", "table")
    """Which policies to run: autotuned, never, fixed, table, tenants, single-rule (TUNED:
    the runs with the tuner on)."""
    tenant_policy: tuple[tuple[str, str, int], ...] = (
        ("*", "ngram", 2), ("copy-tenant", "ngram", 4), ("code-tenant", "ngram", 4),
        ("prose-tenant", "none", 0))
    """The "tenants" run's fixed per-tenant policy: (tenant or "*" for every other row,
    technique, depth) at every batch size. Rows of copy and code (greedy, self-quoting) draft
    deep, sampled prose not at all, chat at the base depth: what a per-tenant rule would give
    them by their acceptance. It is measured beside the single-depth policies, not counted
    among the static policies the autotuned run is compared with (bench.tuner_report)."""
    retune_interval_s: float | None = None
    """Scheduled retune interval (None: phase_s / 6, as 10 min is to the 1 h fit window)."""
    fit_window_s: float | None = None
    """Telemetry the tuner fits on (None: phase_s); its validation baseline is a sixth of it."""
    traffic_window_s: float | None = None
    """Recent traffic a retune optimizes for (None: phase_s / 3, two retune intervals)."""
    validation_s: float | None = None
    """Longest validation window (None: half the retune interval, so validation ends before the
    next scheduled retune and none is skipped as still running)."""
    trials: int = 48
    """Optuna trials per TPE search (an exact solve, the default, tells at most two)."""
    min_new_steps: int = 10
    """A scheduled retune needs this many new steps (counted per sequence, as in the daemon).
    The daemon's default, 500 per 10-minute interval (a step per 1.2 s), compressed like the
    interval (phase_s / 6 = 10 s): ~10."""
    profile_steps: int = 100
    """Startup profile decisions of the autotuned daemon."""
    validation_min_steps: int = 60
    """Validation ends early with this many steps of the new policy."""
    search_process: bool = True
    """Run searches in a spawned process, as `crossover serve` does."""
    probe_retunes: int = 12
    """Measured retunes of the probe (0: no probe). With 3, the p99 was taken over ~75 gaps
    (its largest one) and read 3.5x in one run, 0.36x in the next."""
    probe_concurrency: int = 4
    """Closed-loop clients during the probe."""
    probe_quiet_s: float | None = None
    """Quiet time before each probe retune and after the last (None: phase_s / 4)."""
    model: str | None = None
    """A .gguf file or a HF Gemma 3 directory; None: Gemma 3 270M."""
    heads: str | None = None
    """A train-heads file; None: the user cache's, else the model's shipped one, if any."""
    dtype: str | None = None
    """Compute dtype; None: the backend's default."""
    max_batch: int = 32
    """The engine's most sequences decoded together."""
    max_context: int = 1024
    """The engine's context; prompts that do not fit with their max_tokens are dropped."""
    keep_db: str | None = None
    """Keep each run's telemetry database in this directory (as <policy>.db)."""
    fake: bool = False
    """FakeEngine (tests): ngram and mtp FakeProposers, a FakeCost it sleeps."""
    fake_time_scale: float = 1.0
    """FakeEngine: real seconds slept per simulated second of step time."""
    traces: tuple[str, ...] = ()
    """Pool-split traces (bench.workloads.memory: memory-bound, light), run by
    bench.split_bench.run_split_bench instead of this module's run_bench (empty: the shifting
    trace)."""
    splits: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5)
    """Fixed pool splits each split trace runs."""
    split_technique: str = "draft"
    """Technique of the fixed-split policies (its KV pages come from the split)."""
    split_depth: int = 2
    """Depth of the fixed-split policies (no deeper than the technique drafts)."""
    split_repeats: int = 1
    """Rounds of each split trace: every fixed split and the tuned policy once per round, in
    turn, each policy's goodput the median over the rounds (a shared machine's drift hits all)."""
    kv_budget: int | None = None
    """KV pool bytes of the engine (None: the backend's default); the fake: 64 KiB a page."""
    repeats: int = 1
    """Rounds of the shifting trace: every policy once per round, the order rotated each round
    (so no policy always runs first); each policy's phase and whole-trace figures are the
    median round's (bench.tuner_report.combine_rounds). The machine drifts between runs."""

    def __post_init__(self) -> None:
        if self.split_repeats < 1 or self.repeats < 1:
            raise ValueError(f"split_repeats={self.split_repeats} and repeats={self.repeats} must be at "
                             "least 1")
        if not self.phase_s > 0 or not self.rate_scale > 0:
            raise ValueError(f"phase_s={self.phase_s} and rate_scale={self.rate_scale} must be > 0")
        unknown = set(self.runs) - {"never", "fixed", "table", "tenants", *TUNED}
        if unknown or not self.runs:
            raise ValueError(f"runs={self.runs} must name some of autotuned, never, fixed, table, tenants, "
                             "single-rule")
        names = [n for n, _, _ in self.tenant_policy]
        if names.count("*") != 1 or len(set(names)) != len(names) or any(
                (t == "none") != (d == 0) or not 0 <= d <= 8 for _, t, d in self.tenant_policy):
            raise ValueError(f"tenant_policy={self.tenant_policy} needs one \"*\" entry, each tenant "
                             f"once, and depth 0 exactly with technique none (else 1-8)")
        bounds = [b for b, _ in self.table]
        if not self.table or bounds != sorted(set(bounds)) or any(not 1 <= d <= 8 for _, d in self.table):
            raise ValueError(f"table={self.table} needs ascending batch bounds and depths in 1-8")
        if any(not 1 <= d <= 8 for d in self.depths):
            raise ValueError(f"depths={self.depths} must be in 1-8")
        from bench.workloads import KINDS

        for kind, t in self.temperatures:
            if kind not in KINDS or not 0.0 <= t <= 2.0:
                raise ValueError(f"temperature {kind}:{t} needs a kind of {KINDS} and a value in [0, 2]")
        from bench.workloads.memory import SPLIT_TRACES

        if set(self.traces) - set(SPLIT_TRACES) or any(not 0 <= s <= 0.5 for s in self.splits):
            raise ValueError(f"traces={self.traces} must be among {SPLIT_TRACES} and splits={self.splits} in "
                             "[0, 0.5]")
        if not self.mid_rate > 0 or self.mid_max_concurrency < 1:
            raise ValueError(f"mid_rate={self.mid_rate} must be > 0 and mid_max_concurrency="
                             f"{self.mid_max_concurrency} >= 1")
        if self.probe_retunes < 0 or self.probe_concurrency < 1:
            raise ValueError(f"probe_retunes={self.probe_retunes} must be >= 0 and "
                             f"probe_concurrency={self.probe_concurrency} >= 1")

    def tuner_times(self) -> dict[str, float]:
        """The autotuned daemon's TunerConfig time settings, time-compressed to the phase: each
        one left None follows from phase_s as its field says, and the validation baseline and
        the cost window are a sixth and six times the fit window."""
        interval = self.retune_interval_s or self.phase_s / 6
        window = self.fit_window_s or self.phase_s
        return dict(interval_s=interval, validation_s=self.validation_s or interval / 2,
                    fit_window_s=window, baseline_s=window / 6, cost_window_s=window * 6,
                    traffic_window_s=self.traffic_window_s or self.phase_s / 3)

    @property
    def quiet(self) -> float:
        return self.probe_quiet_s or self.phase_s / 4
