"""The runs `crossover bench findings` makes, as data, and how long they should take.

1. `plan(cfg)` lists every run in the order it runs: Q1 (one mixed batch of every kind per technique,
   greedy then sampled, optionally each kind alone), Q2 (per context, per round, per batch size: plain
   decoding, each (technique, depth), plain again, the techniques' order turned by one each round), Q3
   (per round: plain decoding on an engine with no proposer loaded, then each resident proposer on an
   engine that loads it alone, the draft model at each split).
2. Each run names its instance (bench/report/runs.py spells the names the report parses back),
   engine, batch, context, sampling and whether the prefix cache is emptied before it.
3. `estimate_s(plan, cfg)` prices the plan with STEP_MODEL, a linear step-time model fitted by hand to
   bench/results (engine decode rates at contexts 128 / 2048 and batches 1-64, prefill rates), so
   `--dry-run` prints how long the real run should take before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.findings_config import RESIDENT_TECHNIQUES, FindingsConfig
from bench.report.runs import POOL_BASE, Q2_BASE, TENANT_BASE, pool_instance, q2_instance, tenant_instance

MAIN = "main"
"""The engine of Q1 and Q2: every proposer loaded, budget `kv_budget`."""


def q3_engine(technique: str) -> str:
    """Name of the Q3 engine that loads `technique`'s proposer alone ("none": no proposer)."""
    return f"q3-{technique}"


@dataclass(frozen=True)
class PlannedRun:
    """One batch of requests submitted at once under one policy."""

    phase: str
    instance: str
    engine: str
    technique: str
    depth: int
    split: float
    batch: int
    """Requests submitted at once (the engine runs as many as its pool and max_batch hold)."""
    context: int
    """Prompt plus new tokens of each request (Q1: the longest prompt plus new tokens)."""
    new_tokens: int
    round: int = 0
    """1.. in Q2 and Q3; 0 in Q1."""
    sampling: str = "greedy"
    kinds: tuple[str, ...] = ()
    """The kinds of its requests, round-robin (one kind: that kind alone)."""
    reset_prefix: bool = False
    """Empty the prefix cache before it, so no run reuses an earlier run's prompts."""


def _split(cfg: FindingsConfig, technique: str) -> float:
    return cfg.draft_split if technique == "draft" else 0.0


def q1_plan(cfg: FindingsConfig, techs: tuple[str, ...]) -> list[PlannedRun]:
    """Every technique on one batch of all kinds' prompts, greedy then sampled; greedy alone too."""
    runs = []
    ctx, n = cfg.prompt_tokens + cfg.q1_new_tokens, cfg.q1_prompts
    for sampling in ("greedy", "sampled"):
        inst = tenant_instance(TENANT_BASE, sampling)
        groups = [cfg.kinds] + ([(k,) for k in cfg.kinds] if cfg.q1_alone and sampling == "greedy" else [])
        for kinds in groups:
            runs += [PlannedRun("q1", inst, MAIN, t, cfg.depth, _split(cfg, t), n * len(kinds), ctx,
                                cfg.q1_new_tokens, sampling=sampling, kinds=kinds) for t in techs]
    return runs


def q2_plan(cfg: FindingsConfig, techs: tuple[str, ...]) -> list[PlannedRun]:
    """Per context, per round, per batch: plain, every (technique, depth) in an order turned by one
    each round, plain."""
    runs = []
    cells = [(t, d) for t in techs for d in cfg.depths]
    for ctx in sorted(cfg.contexts):
        for r in range(1, cfg.rounds + 1):
            inst = q2_instance(Q2_BASE, ctx, r)
            turn = (r - 1) % max(len(cells), 1)
            order = cells[turn:] + cells[:turn]
            for c, b in cfg.q2_grid():
                if c != ctx:
                    continue
                group = [("none", 0), *order, ("none", 0)]
                runs += [PlannedRun("q2", inst, MAIN, t, d, _split(cfg, t), b, ctx, cfg.new_tokens, r,
                                    kinds=cfg.kinds) for t, d in group]
    return runs


def q3_plan(cfg: FindingsConfig, techs: tuple[str, ...]) -> list[PlannedRun]:
    """Per round: plain without speculation memory, each resident proposer alone, the draft model at
    each split; the prefix cache emptied before every run."""
    order = [("none", 0.0)] + [(t, 0.0) for t in techs if t in RESIDENT_TECHNIQUES and t != "draft"]
    order += [("draft", s) for s in cfg.splits] if "draft" in techs else []
    return [PlannedRun("q3", pool_instance(POOL_BASE, r), q3_engine(t), t, 0 if t == "none" else cfg.depth,
                       s, cfg.q3_requests, cfg.q3_context, cfg.q3_new_tokens, r, kinds=cfg.q3_kinds,
                       reset_prefix=True)
            for r in range(1, cfg.rounds + 1) for t, s in order]


def plan(cfg: FindingsConfig, techs: tuple[str, ...]) -> list[PlannedRun]:
    """Every run of `cfg.phases`, in order."""
    make = {"q1": q1_plan, "q2": q2_plan, "q3": q3_plan}
    return [run for phase in cfg.phases for run in make[phase](cfg, techs)]


@dataclass(frozen=True)
class StepModel:
    """Seconds of a CPU step: decode_ms = base_ms + rows x (row_ms + row_ms_per_1k x context / 1024),
    rows = batch x (1 + depth); a drafter's pass costs `draft_share` of a target step per position;
    prefill costs prefill_ms x (1 + context / 2048) per prompt token."""

    base_ms: float = 45.0
    row_ms: float = 9.0
    row_ms_per_1k: float = 3.0
    prefill_ms: float = 2.5
    draft_share: tuple[tuple[str, float], ...] = (("ngram", 0.0), ("mtp", 0.05), ("early_exit", 8 / 18),
                                                  ("draft", 4 / 18))
    acceptance: tuple[tuple[str, float], ...] = (("none", 0.0), ("ngram", 0.45), ("mtp", 0.15),
                                                 ("early_exit", 0.2), ("draft", 0.12))
    """Mean acceptance per draft position (the committed findings database's)."""

    def decode_ms(self, rows: int, context: int) -> float:
        return self.base_ms + rows * (self.row_ms + self.row_ms_per_1k * context / 1024)


STEP_MODEL = StepModel()
"""Gemma 3 270M in float32 on the 2-core CPU of bench/results (bench/README.md: `bench findings`)."""


def run_s(run: PlannedRun, max_batch: int, prefill_tokens: int, m: StepModel = STEP_MODEL) -> float:
    """Estimated seconds of one run whose requests prefill `prefill_tokens` between them."""
    acc, share = dict(m.acceptance).get(run.technique, 0.0), dict(m.draft_share).get(run.technique, 0.0)
    width = min(run.batch, max_batch)
    per_step = 1 + run.depth * acc
    steps = -(-run.batch // width) * run.new_tokens / per_step
    target = m.decode_ms(width * (1 + run.depth), run.context)
    draft = run.depth * share * m.decode_ms(width, run.context)
    return (steps * (target + draft) + prefill_tokens * m.prefill_ms * (1 + run.context / 2048)) / 1000


def estimate_s(runs: list[PlannedRun], cfg: FindingsConfig) -> dict[str, float]:
    """Seconds per phase: Q2's prompts are prefilled once per context (the prefix cache keeps them
    across its runs), Q1's once per sampling mode, Q3's before every run."""
    out: dict[str, float] = {}
    seen: set[tuple] = set()
    for run in runs:
        prompt = run.context - run.new_tokens
        key = (run.phase, run.sampling if run.phase == "q1" else run.context, run.kinds)
        if run.reset_prefix:
            fresh = run.batch
        else:
            fresh = max(0, run.batch - max((b for k, b in seen if k == key), default=0))
            seen.add((key, run.batch))
        out[run.phase] = out.get(run.phase, 0.0) + run_s(run, cfg.max_batch, fresh * prompt)
    return out
