"""`crossover bench tuner`: the autotuned daemon against static policies on a shifting trace.

1. Load the engine once: Gemma 3 270M with speculation verified up to
   --max-batch (n-gram, and those heads-based proposers of --techniques, all
   by default, when a heads file exists), or with --fake a
   FakeEngine whose proposers' acceptance depends on the tenant (high for
   copy, low for prose) and which sleeps its FakeCost step time, so wall time
   follows the policy as on a real accelerator.
2. The trace: `bench.workloads.shifting_trace` (low-load copy-heavy at batch
   1-2, high-load mixed beyond what the engine serves at --max-batch, low-load
   prose at batch 1-2; with --mid-mixed a fourth phase of every tenant at
   moderate load, batches of about 4-8), --phase-seconds each, rates times --rate-scale,
   Poisson arrivals, each phase starting once the previous one's requests
   have finished (--no-drain: back to back, so a backlog carries over and
   mixes with the next phase's traffic); each request is sent by its kind's tenant
   ("copy-tenant", ...) with that tenant's API key, so the tuner sees
   per-tenant acceptance as in production. Chat and prose requests sample
   (temperature 0.8, a seed each; --temperatures), copy and code are greedy,
   as their clients would ask: sampled text repeats itself less, so n-gram
   drafts pay less there than on greedy output.
3. One run per policy, each on a fresh daemon started in this process
   (`make_app`, a new temporary SQLite telemetry database, the kind tenants,
   an admin token), sharing the engine: static policies are pinned over
   PUT /admin/policy/pin with the tuner off; the autotuned run has the tuner
   on with time-compressed settings (retune interval, fit window, validation
   window and baselines scaled to the phase length); a "single-rule" run
   (--runs ...,single-rule) is the same daemon with per-tenant rules off
   (TunerConfig.tenant_rules), what the autotuned run is worth to compare
   when it may also give tenants rules of their own. The trace is replayed
   open loop (a phase's max_concurrency holds later arrivals back). A thin
   wrapper around the engine keeps every step's StepStats and output tokens
   per request id; the client keeps each request's id (X-Request-Id) and
   every streamed chunk's time.
4. Autotuned run only, after the trace: the retune probe. Closed-loop
   traffic of the mixed phase at --probe-concurrency, scheduled retunes off,
   one retune to settle on that traffic, then --probe-retunes admin retunes
   (POST /admin/retune), each after a quiet window. An inter-token gap (time
   between two streamed chunks of one request) counts as "during" when it
   ends while a retune searches, as "without" when it overlaps no retune.
5. Summary (`bench.tuner_report`): per policy and phase, goodput =
   output tokens per second of engine step time, of the requests that
   arrived in the phase (each step's time split evenly over the requests it
   emitted tokens for), so a backlog served later still counts where it
   arrived; at low load the client's throughput is the offered load whatever
   the policy, engine time is what a policy saves. Also the clients' TTFT /
   TPOT / inter-token percentiles, and the ratios against their targets;
   JSON to --out, PNG next to it, progress on stderr.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.workloads.trace import PHASE_NAMES
from daemon.user_error import UserError
from engine.policy import BatchRule, TenantRule, TunedPolicy
from engine.types import StepStats

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
            raise ValueError(f"split_repeats={self.split_repeats} and repeats={self.repeats} must be at least 1")
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
            raise ValueError(f"traces={self.traces} must be among {SPLIT_TRACES} and splits={self.splits} in [0, 0.5]")
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


@dataclass(frozen=True)
class Arrival:
    """One request of the trace, ready to send."""

    index: int
    at_s: float
    phase: int
    tenant: str
    route: str
    body: dict[str, Any]


@dataclass
class Stream:
    """What the client saw of one request; times are unix seconds."""

    index: int
    phase: int
    request_id: str = ""
    """The daemon's id (X-Request-Id), which is the engine request's."""
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried text."""
    output_tokens: int = 0
    done: float | None = None
    error: str | None = None


class RecordingEngine:
    """The engine as the daemon sees it (daemon.bridge.Engine): every step's stats and output
    tokens per request are kept (appended on the engine thread); the rest is the wrapped
    engine's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.tokenizer, self.model_name = engine.tokenizer, engine.model_name
        self.max_context = engine.max_context
        self.steps: list[tuple[StepStats, dict[str, int]]] = []
        self.add_request, self.abort, self.has_work = engine.add_request, engine.abort, engine.has_work
        self.warmup, self.status, self.capacity = engine.warmup, engine.status, engine.capacity
        self.set_policy, self.recover = engine.set_policy, engine.recover

    @property
    def policy(self) -> Any:
        return self._engine.policy

    def step(self) -> Any:
        out = self._engine.step()
        if out.stats is not None:
            tokens: dict[str, int] = {}
            for event in out.events:
                if event.token_ids:
                    tokens[event.request_id] = tokens.get(event.request_id, 0) + len(event.token_ids)
            self.steps.append((out.stats, tokens))
        return out


# ---- the bench ---------------------------------------------------------------------
def run_bench(cfg: TunerBenchConfig, out_path: str | None = None) -> dict[str, Any]:
    """Run every policy over the trace and return (and write) the JSON result."""
    from bench.tuner_report import combine_rounds, headline, summarize, with_pooled_probes, write_result
    from daemon.progress import reporter
    from engine.runtime.compiles import freeze_heap
    from engine.runtime.progress import Steps

    engine = load_engine(cfg)
    phases, arrivals = build_trace(cfg, engine)
    policies = static_policies(cfg, engine)
    tuned = [name for name in TUNED if name in cfg.runs]
    _log(f"{len(arrivals)} requests over {len(phases)} phases of {cfg.phase_s:g} s; policies: "
         + ", ".join(tuned + list(policies)))
    order = [(name, None) for name in tuned] + list(policies.items())
    rounds: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    with Steps(reporter(), "bench tuner: runs", len(order) * cfg.repeats) as bar:
        for r in range(cfg.repeats):
            # later rounds rotate the order; each round's autotuned run ends with the probe
            runs: dict[str, dict[str, Any]] = {}
            for name, policy in order[r % len(order):] + order[:r % len(order)]:
                if cfg.repeats > 1:
                    _log(f"round {r + 1}/{cfg.repeats}: {name}")
                tag = f"-r{r + 1}" if cfg.repeats > 1 else ""
                runs[name] = asyncio.run(_run(cfg, engine, name, policy, phases, arrivals, tag))
                # the records kept for the report live to the end: out of the collector's full
                # walks, which would otherwise lengthen with every run and stall later runs' steps
                freeze_heap()
                bar.advance()
            if runs.get("autotuned", {}).get("probe") is not None:
                probes.append(runs["autotuned"]["probe"])
            rounds.append(summarize(cfg, engine, phases, arrivals, runs))
    result = combine_rounds(rounds)
    if len(rounds) > 1:
        result = with_pooled_probes(result, probes)
    for line in headline(result):
        _log(line)
    if out_path:
        write_result(result, out_path)
        _log(f"wrote {out_path} and {Path(out_path).with_suffix('.png')}")
    return result


def load_engine(cfg: TunerBenchConfig) -> Any:
    if cfg.fake:
        engine = fake_engine(cfg)
        engine.warmup(progress=False)
        return engine
    from engine.loader import MODEL_PROPOSERS
    from engine.loader import load_engine as load

    # Verification is compiled up to the largest batch, so a fixed policy speculates at every
    # batch size and the tuner's crossover ranges over all of them (`crossover serve` stops at
    # SPEC_MAX_BATCH). Only --techniques' proposers and those the static policies name are
    # loaded: the autotuned daemon chooses among them.
    wanted = set(cfg.techniques) | named_techniques(cfg)
    proposers = tuple(t for t in MODEL_PROPOSERS if not cfg.techniques or t in wanted)
    from daemon.progress import reporter

    progress = reporter()
    _log("loading the model with speculation")
    engine = load(model=cfg.model, dtype=cfg.dtype, max_batch=cfg.max_batch, kv_budget_bytes=cfg.kv_budget,
                  max_context=cfg.max_context, speculation=True, heads=cfg.heads,
                  spec_max_batch=cfg.max_batch, model_proposers=proposers, progress=progress)
    _log(f"proposers: {', '.join(sorted(engine.proposers)) or 'none'}; warming up")
    engine.warmup(progress=progress)
    from bench.engine import run_each_shape_once

    run_each_shape_once(engine, progress)
    return engine


def fake_engine(cfg: TunerBenchConfig) -> Any:
    """A FakeEngine that sleeps its FakeCost; n-gram pays on copy traffic at small batches."""
    from engine.fake import FakeCost, FakeEngine, FakeProposer

    class CostedFake(FakeEngine):
        def step(self) -> Any:
            start = time.perf_counter()
            out = super().step()
            if out.stats is not None:
                time.sleep(max(0.0, out.stats.step_ms / 1000.0 * cfg.fake_time_scale
                               - (time.perf_counter() - start)))
            return out

    proposers = {"ngram": FakeProposer("ngram", (0.9, 0.85, 0.8, 0.75)),
                 "mtp": FakeProposer("mtp", (0.6, 0.5, 0.4, 0.3))}
    acceptance = {"copy-tenant": 1.0, "code-tenant": 0.6, "chat-tenant": 0.3, "prose-tenant": 0.15}
    return CostedFake(max_batch=cfg.max_batch, max_context=max(cfg.max_context, 8192),
                      proposers=proposers, max_depth=4, tenant_acceptance=acceptance,
                      cost=FakeCost(base_ms=5.0, per_seq_ms=0.2, per_token_ms=0.6, per_draft_ms=0.05))


def build_trace(cfg: TunerBenchConfig, engine: Any) -> tuple[list[Any], list[Arrival]]:
    """The phases and every arrival that fits the engine's context, in time order."""
    from bench.loadgen import Job
    from bench.workloads import shifting_trace, trace

    phases = shifting_trace(cfg.phase_s, cfg.low_rate * cfg.rate_scale,
                            cfg.high_rate * cfg.rate_scale, cfg.low_max_concurrency,
                            cfg.mid_rate * cfg.rate_scale if cfg.mid_phase else None,
                            cfg.mid_max_concurrency)
    arrivals, dropped = [], 0
    temperatures = dict(cfg.temperatures)
    for timed in trace(phases, cfg.seed):
        p = timed.prompt
        max_tokens = min(p.max_tokens, cfg.max_tokens or p.max_tokens)
        if len(engine.tokenizer.encode(p.render(engine.tokenizer))) + max_tokens > engine.max_context:
            dropped += 1
            continue
        job = Job(len(arrivals), p, max_tokens, timed.at_s)
        body = {**job.body(engine.model_name), "ignore_eos": cfg.ignore_eos}
        temperature = temperatures.get(p.kind, 0.0)
        if temperature > 0:
            body.update(temperature=temperature, seed=cfg.seed * 100_003 + job.index)
        arrivals.append(Arrival(job.index, timed.at_s, timed.phase, timed.tenant, job.route(), body))
    if dropped:
        _log(f"{dropped} prompts do not fit max_context {engine.max_context} and are left out")
    if not arrivals:
        raise UserError("the trace is empty: raise --phase-seconds or --rate-scale")
    return phases, arrivals


def static_policies(cfg: TunerBenchConfig, engine: Any) -> dict[str, TunedPolicy]:
    """name -> policy: "never", "fixed:<technique>@<depth>" for each, and "table"."""
    proposers = engine.capacity().proposers
    loaded = sorted(proposers)
    techniques = cfg.fixed_techniques or cfg.techniques or tuple(loaded)
    wanted = set(techniques) | named_techniques(cfg)
    missing = sorted(wanted - set(loaded))
    if missing:
        raise UserError(f"technique(s) {', '.join(missing)} not loaded (loaded: {', '.join(loaded)})")
    top = engine.max_batch
    out: dict[str, TunedPolicy] = {}
    if "never" in cfg.runs:
        out["never"] = TunedPolicy()
    if "fixed" in cfg.runs:
        for t in techniques:
            for d in (d for d in cfg.depths if d <= _deepest(engine, t)):
                out[f"fixed:{t}@{d}"] = TunedPolicy((BatchRule(top, t, d),), crossover=top,
                                                    **_memory(cfg, engine, t))
    if "table" in cfg.runs:
        t = cfg.table_technique
        rules = tuple(BatchRule(b, t, d) for b, d in cfg.table)
        rules += (BatchRule(max(top, rules[-1].max_batch + 1)),)
        out["table"] = TunedPolicy(rules, crossover=cfg.table[-1][0], **_memory(cfg, engine, t))
    if "tenants" in cfg.runs:
        out["tenants"] = tenant_policy(cfg, engine)
    return out


def named_techniques(cfg: TunerBenchConfig) -> set[str]:
    """The techniques the static policies name besides `techniques`: the fixed policies', the
    table's and the "tenants" run's (the engine loads them too)."""
    named = set(cfg.fixed_techniques) if "fixed" in cfg.runs else set()
    named |= {cfg.table_technique} if "table" in cfg.runs else set()
    if "tenants" in cfg.runs:
        named |= {t for _, t, _ in cfg.tenant_policy if t != "none"}
    return named


def _deepest(engine: Any, technique: str) -> int:
    """The deepest a static policy drafts with `technique`: no deeper than the proposer drafts
    (e.g. MTP: its heads) or the engine's verify compiled."""
    cap = engine.capacity()
    return min(cap.proposers[technique].max_depth, cap.max_depth)


def tenant_policy(cfg: TunerBenchConfig, engine: Any) -> TunedPolicy:
    """The "tenants" run's policy (TunerBenchConfig.tenant_policy) at every batch size the
    engine runs; each technique no deeper than it drafts or the engine verifies."""
    top = engine.max_batch

    def depth(t: str, d: int) -> int:
        return 0 if t == "none" else min(d, _deepest(engine, t))

    base = next((t, depth(t, d)) for n, t, d in cfg.tenant_policy if n == "*")
    rules = tuple(TenantRule(n, t, depth(t, d), max_batch=top) for n, t, d in cfg.tenant_policy
                  if n != "*")
    used = [t for _, t, _ in cfg.tenant_policy if t != "none"]
    memory = _memory(cfg, engine, used[0]) if used else {}
    return TunedPolicy((BatchRule(top, *base),), crossover=top, tenants=rules, **memory)


def _memory(cfg: TunerBenchConfig, engine: Any, technique: str) -> dict[str, Any]:
    """Pool split (none for n-gram) and, for MTP, its smallest compiled draft vocabulary
    (as `crossover bench crossover` uses)."""
    if technique == "ngram":
        return {"pool_split": 0.0}
    mtp = engine.capacity().proposers.get("mtp")
    vocabs = mtp.draft_vocabs if technique == "mtp" and mtp else ()
    return {"pool_split": cfg.pool_split, "draft_vocab": min((v for v in vocabs if v), default=0)}


# ---- one run: a fresh daemon, the trace, the probe ----------------------------------
async def _run(cfg: TunerBenchConfig, engine: Any, name: str, policy: TunedPolicy | None,
               phases: list[Any], arrivals: list[Arrival], tag: str = "") -> dict[str, Any]:
    """Serve the trace under `policy` (None: the tuner) on a fresh daemon; the raw record.
    `tag` ends the kept database's file name (a round of --repeats)."""
    import aiohttp
    from aiohttp import web

    from bench.loadgen import forget_prefixes
    from bench.serve import CpuMeter
    from bench.tuner_report import read_history
    from daemon.app import make_app
    from daemon.database import open_database
    from daemon.state import ENGINE_THREAD
    from daemon.tuning import TUNER
    from telemetry.recorder import RecorderConfig, RetentionConfig

    # Every run replays the same prompts: a prefix cache kept from the run before would skip
    # most of this run's prefill (the first run, the autotuned one, would pay for all the others).
    forget_prefixes(engine)
    admin = secrets.token_hex(16)
    recording = RecordingEngine(engine)
    with tempfile.TemporaryDirectory(prefix="crossover-bench-tuner-") as tmp:
        recorder = RecorderConfig(flush_interval_s=min(1.0, cfg.phase_s / 30),
                                  retention=RetentionConfig())
        path = Path(tmp) / "telemetry.db"
        if cfg.keep_db:  # each run's database, for a look at what the tuner saw
            path = Path(cfg.keep_db) / f"{name.replace(':', '-').replace('@', '-')}{tag}.db"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        database = open_database(f"sqlite:///{path}", recorder_config=recorder)
        # every request waits in the engine's queue, where the policy and the pool decide: the
        # daemon's default tenant cap (half of max_batch in flight, none queued) would refuse
        # a busy phase's backlog with 429s, fewer for a faster policy
        limits = {"max_concurrent": len(arrivals) + 1}
        keys = _tenants(database, sorted({a.tenant for a in arrivals}), limits)
        app = make_app(_settings(cfg, engine, policy is None, admin, len(arrivals),
                                 tenant_rules=name != "single-rule"), recording,
                       database=database, warmup=False)
        tuner = app[TUNER]
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            while not app[ENGINE_THREAD].ready:
                await asyncio.sleep(0.01)
            # a daemon's search process warms up while its engine compiles; here the engine
            # is warm already, so wait for it (bounded) as traffic would after a real start
            deadline = time.monotonic() + 120.0
            while not tuner.search_ready and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            base = f"http://127.0.0.1:{runner.addresses[0][1]}"
            timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=timeout) as http:
                client = Client(http, base, keys, admin)
                if policy is not None:
                    await client.admin("PUT", "/admin/policy/pin", policy.to_dict())
                warm = dataclasses.replace(arrivals[0], body={**arrivals[0].body, "max_tokens": 2})
                await client.stream(warm, Stream(-1, 0))
                meter, compiles, children = CpuMeter(), _compiles(engine), _children_cpu()
                wall = time.perf_counter()
                streams, bounds = await replay(client, phases, arrivals, name, cfg.drain)
                search_cpu = _children_cpu(children)
                share, steal = meter.share(), meter.steal()
                capacity = (time.perf_counter() - wall) * (os.cpu_count() or 1)
                contention = {  # the search process is this bench's own, not "other"
                    "other_processes_cpu_share":
                        None if share is None else round(max(0.0, share - search_cpu / capacity), 3),
                    "steal_share": steal,
                    "search_process_cpu_s": round(search_cpu, 2),
                    "compiles_during_trace": _compiles(engine) - compiles}
                if (contention["other_processes_cpu_share"] or 0.0) > 0.1:
                    _log(f"{name}: other processes took {contention['other_processes_cpu_share']:.0%} "
                         f"of the CPU during the trace (the hypervisor's steal: {steal or 0:.0%} of the "
                         "CPU): its figures are not comparable")
                probe = (await _probe(client, cfg, tuner, arrivals)
                         if name == "autotuned" and cfg.probe_retunes else None)
                history = await asyncio.to_thread(read_history, database, bounds[0][0])
        finally:
            await runner.cleanup()
    return {"bounds": bounds, "steps": recording.steps, "streams": streams, **contention,
            "probe": probe, "history": history, "policy": None if policy is None else policy.to_dict()}


def _children_cpu(since: dict[int, float] | None = None) -> Any:
    """CPU seconds of this process's live children (the spawned search process), per pid;
    with `since`, the total used since then."""
    import multiprocessing

    now = {}
    for child in multiprocessing.active_children():
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            now[child.pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            continue
    if since is None:
        return now
    return sum(t - since.get(pid, 0.0) for pid, t in now.items())


def _compiles(engine: Any) -> int:
    """XLA compilations so far (serving should add none; the fake has none)."""
    return int(engine.status().get("compile_count") or 0)


def _settings(cfg: TunerBenchConfig, engine: Any, tuned: bool, admin: str, requests: int,
              tenant_rules: bool = True) -> Any:
    from daemon.settings import Settings
    from tuner.config import TunerConfig

    tuner = TunerConfig(
        enabled=tuned, tenant_rules=tenant_rules, min_new_steps=cfg.min_new_steps, trials=cfg.trials,
        profile_steps=cfg.profile_steps, validation_min_steps=cfg.validation_min_steps,
        search_process=cfg.search_process, **cfg.tuner_times())
    return Settings(
        host="127.0.0.1", port=0, max_batch=engine.max_batch, max_context=engine.max_context,
        max_waiting=max(256, requests), open_mode=False, admin_token=admin, log_level="warning",
        tuner=tuner)


def _tenants(database: Any, names: list[str], limits: dict[str, Any] | None = None) -> dict[str, str]:
    """Create the trace's tenants (with `limits`, else the daemon's defaults); name -> API key."""
    from daemon.tenants.admin_ops import create_tenant
    from store.db import session_scope

    with session_scope(database.engine) as session:
        return {name: create_tenant(session, name, dict(limits or {}))[1] for name in names}


class Client:
    """Streams requests with their tenant's key and calls the admin API."""

    def __init__(self, http: Any, base: str, keys: dict[str, str], admin_token: str) -> None:
        self.http, self.base, self.keys, self.admin_token = http, base, keys, admin_token

    async def admin(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        async with self.http.request(method, self.base + path, json=body, headers=headers) as r:
            payload = await r.json()
            if r.status >= 300:
                raise UserError(f"{method} {path}: HTTP {r.status}: {payload}")
            return payload

    async def stream(self, arrival: Arrival, s: Stream) -> Stream:
        import aiohttp

        from bench.loadgen import read_sse

        s.sent = time.time()
        headers = {"Authorization": f"Bearer {self.keys[arrival.tenant]}"}
        try:
            async with self.http.post(self.base + arrival.route, json=arrival.body,
                                      headers=headers) as response:
                if response.status != 200:
                    s.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return s
                s.request_id = response.headers.get("X-Request-Id", "")
                async for chunk in read_sse(response.content):
                    if chunk.error is not None:
                        s.error = chunk.error
                    if chunk.usage:
                        s.output_tokens = chunk.usage["completion_tokens"]
                    s.chunks += [time.time()] * chunk.texts
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        s.done = time.time()
        return s


async def replay(client: Client, phases: list[Any], arrivals: list[Arrival], name: str,
                 drain: bool = True) -> tuple[list[Stream], list[tuple[float, float]]]:
    """Send every arrival at its time (open loop), honouring each phase's max_concurrency.

    With `drain`, a phase starts once the previous one's requests have all finished (its
    arrivals keep their offsets from the phase's start). Returns the streams and each
    phase's (start, end) in unix seconds; the last ends when its last request finished.
    """
    streams = [Stream(a.index, a.phase) for a in arrivals]
    tasks: list[asyncio.Task] = []
    bounds: list[tuple[float, float]] = []
    offset, start = 0.0, time.time()
    for i, phase in enumerate(phases):
        begin = time.time() if drain else start + offset
        gate = asyncio.Semaphore(phase.max_concurrency) if phase.max_concurrency else None
        done = sum(s.done is not None for s in streams)
        _log(f"{name}: phase {i + 1}/{len(phases)} ({PHASE_NAMES[i]}), {done} requests done")
        mine = []
        for a in (a for a in arrivals if a.phase == i):
            await asyncio.sleep(max(0.0, begin + a.at_s - offset - time.time()))
            mine.append(asyncio.create_task(_send(client, a, streams[a.index], gate)))
        await asyncio.sleep(max(0.0, begin + phase.duration_s - time.time()))
        if drain:
            await asyncio.gather(*mine)
        tasks += mine
        offset += phase.duration_s
        bounds.append((begin, time.time() if drain else begin + phase.duration_s))
    await asyncio.gather(*tasks)
    bounds[-1] = (bounds[-1][0], max(bounds[-1][1], time.time()))
    errors = Counter(s.error.split(":", 1)[0] for s in streams if s.error is not None)
    _log(f"{name}: trace done in {time.time() - start:.1f} s, {sum(errors.values())} errors"
         + "".join(f", {n} {e}" for e, n in errors.most_common(3)))
    return streams, bounds


async def _send(client: Client, a: Arrival, s: Stream, gate: asyncio.Semaphore | None) -> None:
    if gate is None:
        await client.stream(a, s)
        return
    async with gate:
        await client.stream(a, s)


# ---- the retune probe -----------------------------------------------------------------
async def _probe(client: Client, cfg: TunerBenchConfig, tuner: Any,
                 arrivals: list[Arrival]) -> dict[str, Any]:
    """Closed-loop mixed traffic; retunes triggered between quiet windows (module doc, 4)."""
    tuner.config = dataclasses.replace(tuner.config, min_new_steps=1 << 30)  # schedule: skip
    pool = [a for a in arrivals if a.phase == 1] or arrivals
    streams: list[Stream] = []
    stop = asyncio.Event()

    async def worker(k: int) -> None:
        i = k
        while not stop.is_set():
            a = pool[i % len(pool)]
            s = Stream(len(streams), 1)
            streams.append(s)
            await client.stream(a, s)
            i += cfg.probe_concurrency

    _log(f"probe: {cfg.probe_concurrency} clients, a settling retune, then {cfg.probe_retunes} "
         f"retunes {cfg.quiet:g} s apart")
    workers = [asyncio.create_task(worker(k)) for k in range(cfg.probe_concurrency)]
    try:
        await _wait_running(client, tuner)
        settle = await _retune(client)
        windows = []
        for k in range(cfg.probe_retunes):
            await asyncio.sleep(cfg.quiet)
            windows.append(await _retune(client))
            _log(f"probe: retune {k + 1}/{cfg.probe_retunes} searched "
                 f"{windows[-1]['search_end'] - windows[-1]['start']:.1f} s, {windows[-1]['status']}")
        await asyncio.sleep(cfg.quiet)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    return {"settle": settle, "windows": windows, "streams": streams, "end": time.time()}


async def _wait_running(client: Client, tuner: Any) -> None:
    """Let a scheduled retune that is still running finish first."""
    running = tuner.describe()["running"]
    while running is not None:
        view = await client.admin("GET", f"/admin/retunes/{running}")
        if view["status"] != "running":
            return
        await asyncio.sleep(0.1)


async def _retune(client: Client) -> dict[str, Any]:
    """Trigger a retune and follow it: when it started, stopped searching and ended."""
    start = time.time()
    view = (await client.admin("POST", "/admin/retune"))["retune"]
    search_end = None
    while view["status"] == "running":
        if search_end is None and view.get("phase") not in ("searching", "running"):
            search_end = time.time()
        await asyncio.sleep(0.05)
        view = await client.admin("GET", f"/admin/retunes/{view['id']}")
    end = time.time()
    return {"id": view["id"], "start": start, "search_end": search_end or end, "end": end,
            "status": view["status"], "version": view["chosen_policy_version"],
            "note": view["error"] or (view["details"] or {}).get("reason")}


# ---- progress on stderr -----------------------------------------------------------------
def _log(message: str) -> None:
    from daemon.progress import say

    say(f"bench tuner: {message}")
