"""The planner's halves of `crossover report`: Q2 predicted, Q3 (memory vs goodput), Q4 and MoE.

Predictions combine the planner's memory arithmetic (engine/memory/planner.py,
engine/memory/spec_memory.py) with the roofline step time of bench/report/roofline.py,
fed with the acceptance measured in the database. Every heading and figure
title that holds a prediction says PREDICTION or PROJECTION.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.report import figures, pool, roofline
from bench.report.data import Telemetry, measured_acceptance, usual_depth
from bench.report.measured import PLAIN, fmt_ci, operating_gain
from engine.config import PRESETS, ModelConfig
from engine.memory.planner import DEFAULT_MAX_BATCH, TPU_V6E_1, Plan, activation_reserve, make_plan, parse_moe
from engine.memory.sizes import GiB, format_bytes, pages_per_sequence
from engine.policy import TECHNIQUES

PRED_BATCHES = tuple(2**i for i in range(13))
"""Batch sizes predictions are evaluated at, 1..4096 (each only if the plan fits that many tenants
with its activation reserve sized for that batch)."""
PROJECTED_MODELS = ("gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")
FIT_DTYPES = ("bfloat16", "int8", "int4")
"""Weight dtypes tried in order for a projection: the first that fits a tenant is used."""
MOE_SPEC = "26B/4B"


@dataclass(frozen=True)
class PlanInputs:
    """The planner's inputs the report uses (from the CLI flags)."""

    model: str = "gemma3-270m"
    """The model the database was measured on (the database does not record it)."""
    context: int = 8192
    """Tokens per tenant, for tenants displaced and KV reads."""
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    page_size: int = 16

    @property
    def cfg(self) -> ModelConfig:
        return PRESETS[self.model]

    def plan(self, cfg: ModelConfig, device=TPU_V6E_1, weight_dtype: str | None = None) -> Plan:
        return make_plan(cfg, device, weight_dtype or self.weight_dtype, self.kv_dtype, self.context,
                         self.page_size)


def _spec_techniques(t: Telemetry) -> list[str]:
    """Speculative techniques the database measured acceptance for, in engine order."""
    measured = {tech for tech, _ in t.acceptance}
    return [x for x in TECHNIQUES if x != PLAIN and x in measured]


ASSUMPTIONS = [
    ("step time = max(bytes / bandwidth, FLOPs / peak) for the target forward, plus `depth` sequential "
    "draft passes priced the same way (ngram drafts on the host: free); no launch, host or scheduling "
    "overhead, so small batches are optimistic"),
    ("bytes = weights + batch x KV each sequence reads at the planned context (global layers: every token; "
    "local layers: the sliding window); FLOPs = batch x (1 + depth) x (2 x parameters + attention)"),
    ("early exit drafts with the first 8 target layers, the draft model is the first 4, MTP runs a 3d^2 head "
    "per position over an 8192-wide vocabulary slice (engine/memory/spec_memory.py's defaults)"),
    ("acceptance per draft position measured in this database carries over to the predicted model and chip; "
    "each technique at the depth it ran most often"),
    ("a batch size is predicted only if the planner's KV pool holds that many tenants at the planned "
    "context with the activation reserve (logits, workspace) sized for that batch"),
]


def _chip_assumptions() -> list[str]:
    return [f"{c.name}: usable {format_bytes(c.profile.usable_bytes)}, "
            f"{c.profile.bandwidth_bytes_per_s / 1e12:.2f} TB/s (planner profile), peak "
            f"{c.peak_flops / 1e12:.0f} TFLOP/s ({c.source})" for c in roofline.CHIPS.values()]


def q2_predicted_section(t: Telemetry, p: PlanInputs, out: Path) -> list[str]:
    lines = [f"### PREDICTED for TPU v6e-1 and H200 (model {p.model}, context {p.context})", ""]
    techs = _spec_techniques(t)
    if not techs:
        return lines + ["**No data:** predictions need measured acceptance, and no step speculated.", ""]
    lines += [("These are **predictions**, not measurements: the roofline step-time model of "
              "bench/report/roofline.py on the planner's device profiles, fed with the acceptance "
              "measured above. Assumptions:"), ""]
    lines += [f"- {a}" for a in ASSUMPTIONS + _chip_assumptions()] + [""]
    lines += [("| technique | depth | measured acceptance per position | chip | tenants that fit (B=64 "
              "reserve) | predicted crossover | goodput over plain at B=1 / largest B |"),
              "|---|---:|---|---|---:|---|---|"]
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    marks: dict[str, dict[str, int | None]] = {}
    cfg = p.cfg
    for chip in roofline.CHIPS.values():
        plan = p.plan(cfg, chip.profile)
        batches = predicted_batches(p, chip)
        if not batches:
            lines.append(f"| all | - | - | {chip.name} | 0 | {plan.verdict} | - |")
            continue
        curves[chip.name] = {PLAIN: [(b,
                                      roofline.goodput(PLAIN, cfg, chip, b, 0, [], p.context, p.weight_dtype))
                                     for b in batches]}
        for tech in techs:
            depth, acc = usual_depth(t, tech) or 1, measured_acceptance(t, tech)
            pts = [(b, roofline.goodput(tech, cfg, chip, b, depth, acc, p.context, p.weight_dtype))
                   for b in batches]
            curves[chip.name][tech] = pts
            b_x = roofline.predicted_crossover(tech, cfg, chip, depth, acc, p.context, batches,
                                               p.weight_dtype)
            marks.setdefault(chip.name, {})[tech] = b_x
            plain = dict(curves[chip.name][PLAIN])
            ends = (f"{pts[0][1] / plain[batches[0]]:.2f}x / {pts[-1][1] / plain[batches[-1]]:.2f}x "
                    f"(B={batches[-1]})")
            where = f"B={b_x}" if b_x else f"none up to B={batches[-1]}"
            accs = ", ".join(f"{a:.3f}" for a in acc[:depth])
            lines.append(f"| {tech} | {depth} | {accs} | {chip.name} | {plan.tenants} | {where} | {ends} |")
    lines += ["", ("Source: acceptance from the Q1 table (`xo_steps.accepted_per_pos` pooled over every "
              "tenant group); depth = the depth with most speculating steps in `xo_steps`; memory and "
              f"tenants from `make_plan` (engine/memory/planner.py) for {p.model} in {p.weight_dtype}, KV "
              f"{p.kv_dtype}, context {p.context}, page {p.page_size} (as `crossover plan --device DEVICE "
              f"--model {p.model} --context {p.context}` prints)."), ""]
    name = figures.predicted_figure(curves, marks, f"{p.model}, context {p.context}", out)
    lines += figures.embed(name, "predicted goodput against batch size")
    return lines


def predicted_batches(p: PlanInputs, chip: roofline.Chip) -> list[int]:
    """PRED_BATCHES that fit on `chip`: the pool holds that many tenants once the activation
    reserve is sized for that batch."""
    def tenants_at(batch: int) -> int:
        reserve, _ = activation_reserve(p.cfg, 8, max_batch=batch)
        return make_plan(p.cfg, chip.profile, p.weight_dtype, p.kv_dtype, p.context, p.page_size,
                         activation_reserve_bytes=reserve).tenants

    return [b for b in PRED_BATCHES if b <= tenants_at(b)]


def predicted_crossovers(t: Telemetry, p: PlanInputs) -> list[str]:
    """'TECH on CHIP B=b' per measured technique and chip: where the roofline predicts speculation, at its
    usual depth with the acceptance measured, first falls below plain decoding."""
    out = []
    for tech in _spec_techniques(t):
        depth, acc = usual_depth(t, tech) or 1, measured_acceptance(t, tech)
        for chip in roofline.CHIPS.values():
            batches = predicted_batches(p, chip)
            b = roofline.predicted_crossover(tech, p.cfg, chip, depth, acc, p.context, batches,
                                             p.weight_dtype)
            top = f"none up to B={batches[-1]}" if batches else "no batch fits"
            out.append(f"{tech} on {chip.name} {f'B={b}' if b else top}")
    return out


def _pages_per_tenant(p: PlanInputs, depth: int) -> int:
    g, loc = pages_per_sequence(p.cfg, p.context, p.page_size, depth)
    return g + loc


def q3_section(t: Telemetry, p: PlanInputs, out: Path) -> list[str]:
    lines = ["## Q3. Is speculation's memory worth the KV cache it displaces?", ""]
    plan = p.plan(p.cfg)
    costs = {c.technique: c for c in plan.techniques}
    techs = [x for x in TECHNIQUES if x != PLAIN and x in t.techniques]
    measured: list[tuple[str, float, object]] = []
    if not techs:
        lines += [("**No data:** no speculating step in `xo_steps`; the measured half of this section needs "
                  "one. The planner's projection follows."), ""]
    else:
        plain_pages = t.pool_pages.get(PLAIN)
        lines += [(f"Tenants displaced: the planner's cost of each technique for {p.model} at {p.context} "
                  f"tokens (engine/memory/spec_memory.py; resident bytes plus {costs['ngram'].speculating} "
                  "speculating sequences' per-sequence bytes (verify slots for the planner's 8-deep verify, "
                  "draft KV), in tenants of that context). Measured pool: the median "
                  "`kv_pages_used + kv_pages_free` of the technique's steps against plain decoding's, in "
                  "tenants of the same context. Gain: goodput over plain at the batch size the technique ran "
                  "most decode steps at (95% CI)."), "",
                  ("| technique | resident | per sequence | tenants displaced (planner) | pool pages "
                  "(median) | tenants displaced (measured pool) | batch | goodput gain |"),
                  "|---|---|---|---:|---:|---:|---:|---|"]
        for tech in techs:
            c = costs.get(tech)
            pages = statistics.median(t.pool_pages[tech])
            meas = "n/a (no plain steps)"
            if plain_pages:
                per = _pages_per_tenant(p, usual_depth(t, tech) or 0)
                meas = f"{(statistics.median(plain_pages) - pages) / per:.2f}"
            gain = operating_gain(t, tech)
            batch, g = (str(gain[0]), fmt_ci(gain[1])) if gain else ("-", "n/a")
            res = format_bytes(c.resident_bytes) if c else "?"
            per_seq = format_bytes(c.per_sequence_bytes) if c else "?"
            lines.append(f"| {tech} | {res} | {per_seq} | {c.tenants_displaced if c else '?'} | {pages:g} | "
                         f"{meas} | {batch} | {g} |")
            if c and gain:
                measured.append((tech, float(c.tenants_displaced), gain[1]))
        lines += ["", ("Source: `xo_steps.kv_pages_used + kv_pages_free` and the Q2 goodput cells; planner "
                  f"`make_plan(...).techniques` for {p.model}."), ""]
    lines += pool.section(t, out)
    proj_lines, projected = _projection(t, p)
    lines += proj_lines
    lines += figures.embed(figures.displacement_figure(measured, projected, out),
                           "tenants displaced against goodput gained")
    return lines


def _fitting_plan(p: PlanInputs, cfg: ModelConfig) -> Plan:
    plans = [p.plan(cfg, TPU_V6E_1, d) for d in FIT_DTYPES]
    return next((x for x in plans if x.fits), plans[-1])


def spec_batch(cost, plan: Plan, batch: int) -> tuple[int, int]:
    """(largest batch <= `batch` that fits beside the technique's memory, tenants that memory costs).

    A technique at batch b needs ceil((resident + b x per-sequence bytes) / sequence bytes) tenants'
    worth of the pool, so b plus that must not exceed the tenants plain decoding fits."""
    def need(b: int) -> int:
        return -(-(cost.resident_bytes + b * cost.per_sequence_bytes) // plan.sequence_bytes)

    while batch > 0 and batch + need(batch) > plan.tenants:
        batch -= 1
    return batch, need(batch)


def _projection(t: Telemetry, p: PlanInputs) -> tuple[list[str], dict[str, list[tuple[str, int, float]]]]:
    """PROJECTION per Gemma 3 model on a v6e-1: tenants, tenants displaced, capacity-aware gain."""
    lines = [f"### PROJECTION for larger Gemma 3 models on a TPU v6e-1 (context {p.context})", ""]
    techs = _spec_techniques(t)
    chip = roofline.CHIPS["tpu-v6e-1"]
    lines += [("Capacity-aware: plain decoding runs a batch of min(tenants that fit, "
              f"{DEFAULT_MAX_BATCH}) (the planner's activation reserve is sized for {DEFAULT_MAX_BATCH}); a "
              "technique runs the largest batch that still fits once its resident memory and its sequences' "
              "verify slots / draft KV are taken from the pool. The gain is predicted goodput over plain's "
              "(roofline model above, measured acceptance). Weights: the first of bfloat16, int8, int4 that "
              "fits a tenant (compute priced at the bf16 peak either way)."), ""]
    if not techs:
        lines += ["Without measured acceptance only the memory side is shown.", ""]
    lines += ["| model | weights | tenants (plain) | technique | depth | tenants displaced | batch | "
              "predicted gain |", "|---|---|---:|---|---:|---:|---:|---:|"]
    projected: dict[str, list[tuple[str, int, float]]] = {}
    for name in PROJECTED_MODELS:
        cfg = PRESETS[name]
        plan = _fitting_plan(p, cfg)
        if not plan.fits:
            lines.append(f"| {name} | - | 0 | - | - | - | - | {plan.verdict} |")
            continue
        b_plain = min(plan.tenants, DEFAULT_MAX_BATCH)
        base = roofline.goodput(PLAIN, cfg, chip, b_plain, 0, [], p.context, plan.weight_dtype)
        for c in plan.techniques:
            if techs and c.technique not in techs:
                continue
            depth = (usual_depth(t, c.technique) or 1) if techs else 0
            b, displaced = spec_batch(c, plan, b_plain)
            gain = (roofline.goodput(c.technique, cfg, chip, b, depth, measured_acceptance(t, c.technique),
                                     p.context, plan.weight_dtype) / base) if techs and b > 0 else None
            lines.append(f"| {name} | {plan.weight_dtype} ({format_bytes(plan.weight_bytes)}) | "
                         f"{plan.tenants} | {c.technique} | {depth or '-'} | {displaced} | {b} | "
                         f"{f'{gain:.2f}x' if gain is not None else '-'} |")
            if gain is not None:
                projected.setdefault(name, []).append((c.technique, int(displaced), gain))
    lines += ["", (f"Source: `make_plan(model, tpu-v6e-1, dtype, {p.kv_dtype}, {p.context})` and its "
              "`techniques` (engine/memory/planner.py, engine/memory/spec_memory.py); acceptance and depth "
              "from `xo_steps`."), ""]
    return lines, projected


def q4_section(t: Telemetry, out: Path, measured: list[str] | None = None) -> list[str]:
    """Q4 from telemetry, after `measured` (bench/report/early.py: the `--early-exit` runs)."""
    lines = ["## Q4. Early exit with a compacting scheduler", "", *(measured or [])]
    other = sorted(x for x in t.techniques if x not in TECHNIQUES)
    if not other and measured:
        lines += [("The telemetry database holds no compacting early-exit steps (the `early_exit` technique "
                  "in `xo_steps` is the lossless self-drafting proposer); the tables above come from the "
                  "`--early-exit` files."), ""]
    elif not other:
        lines += [("**No data.** This database holds no early-exit-with-compaction measurements: every step "
                  f"in `xo_steps` has one of the techniques {', '.join(TECHNIQUES)}. The `early_exit` "
                  "technique there is the self-drafting proposer (the first target layers draft tokens that "
                  "the full model verifies, lossless), not a mid-network exit. What would fill this section: "
                  "steps recorded by a scheduler that exits confident rows after layer k and compacts the "
                  "rest into a smaller batch (issue 19, item 3), tagged with their own technique name, at "
                  "batch sizes 1, 4, 16 and 64 and several confidence thresholds, next to plain-decoding "
                  "steps at the same batch sizes; plus their quality (greedy agreement, perplexity) against "
                  "the full model. The compacting experiment of issue 19 (`crossover bench early-exit`) "
                  "writes its results to a JSON file, not to a telemetry database: pass it with "
                  "`--early-exit FILE`."), ""]
    else:
        from bench.report.measured import goodput_cells

        cells = goodput_cells(t).get("all", {})
        plain = cells.get(PLAIN, {})
        lines += [("Techniques recorded that are not speculative proposers, against plain decoding "
                  "(decode-only steps, 95% delta-method CI):"), "",
                  "| technique | steps | batch | goodput | plain |", "|---|---:|---:|---|---|"]
        for tech in other:
            for b, ci in sorted(cells.get(tech, {}).items()):
                lines.append(f"| {tech} | {t.techniques[tech]} | {b} | {fmt_ci(ci)} | {fmt_ci(plain.get(b))} "
                             "|")
            if not cells.get(tech):
                lines.append(f"| {tech} | {t.techniques[tech]} | - | too few decode-only steps | - |")
        lines += ["", "Source: `xo_steps` grouped by (technique, batch_size), decode-only steps.", ""]
    return lines + moe_section(out)


def moe_section(out: Path) -> list[str]:
    lines = [f"### Mixture of experts: the planner's verdict on the essay's {MOE_SPEC} example", ""]
    rows, bars = [], []
    for device, dtype in ((TPU_V6E_1, "bfloat16"), (TPU_V6E_1, "int8"), (TPU_V6E_1, "int4"),
                          (roofline.CHIPS["h200"].profile, "bfloat16")):
        plan = make_plan(parse_moe(MOE_SPEC), device, dtype, "bfloat16", 8192)
        rows.append(f"| {device.name} | {dtype} | {format_bytes(plan.weight_bytes)} | "
                    f"{format_bytes(device.usable_bytes)} | {plan.tenants} | {plan.verdict} |")
        bars.append((f"{device.name}\n{dtype}", {"weights": plan.weight_bytes / GiB,
                                                 "activation reserve": plan.activation_reserve_bytes / GiB,
                                                 "KV pool": plan.pool_bytes / GiB},
                                                 device.usable_bytes / GiB))
    lines += ["| device | weights | weight bytes | usable | tenants at 8192 | planner verdict |",
              "|---|---|---|---|---:|---|", *rows, "",
              ("int8 stands in for the essay's FP8 (8.5 bits a weight with block scales). Source: "
              f"`crossover plan --device tpu-v6e-1 --model {MOE_SPEC} --dtype DTYPE --context 8192` "
              "(engine/memory/planner.py `make_plan`; attention shape borrowed from gemma3-12b). The planner "
              "counts memory only: it says nothing about expert locality under mixed tenants."), ""]
    lines += figures.embed(figures.moe_figure(bars, out), "MoE memory on the planner's devices")
    return lines
