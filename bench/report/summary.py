"""The report's opening list: one line per question, each number pointing at its section.

It recomputes nothing the sections do not: acceptance from the Q1 counts, the
measured crossover from the Q2 cells, predictions from bench/report/roofline.py,
gains from the Q3 operating point, and the planner's MoE verdict.
"""

from __future__ import annotations

from bench.report import roofline
from bench.report.data import ALL, MIXED, Telemetry, measured_acceptance, usual_depth
from bench.report.measured import PLAIN, crossovers, fmt_ci, goodput_cells, operating_gain
from bench.report.planned import MOE_SPEC, PlanInputs, predicted_batches
from bench.report.stats import wilson
from engine.planner import TPU_V6E_1, make_plan, parse_moe
from engine.policy import TECHNIQUES


def _q1(t: Telemetry) -> str:
    parts = []
    for tech in sorted({k[0] for k in t.acceptance}):
        groups = {g: c for (x, g), c in t.acceptance.items() if x == tech}
        shown = [f"{'mixed' if g == MIXED else g + ' alone'} {wilson(sum(c.accepted), sum(c.offered)).value:.2f}"
                 for g, c in sorted(groups.items(), key=lambda kv: (kv[0] == MIXED, kv[0])) if sum(c.offered)]
        parts.append(f"{tech}: {', '.join(shown)}")
    return "; ".join(parts) if parts else "no speculating steps recorded"


def _q2(t: Telemetry, p: PlanInputs) -> str:
    found = crossovers(goodput_cells(t)).get(ALL, {})
    measured = "; ".join(f"{tech} {c.describe()}" for tech, c in sorted(found.items())) or "not measurable here"
    predicted = []
    for tech in (x for x in TECHNIQUES if x != PLAIN and any(k[0] == x for k in t.acceptance)):
        depth, acc = usual_depth(t, tech) or 1, measured_acceptance(t, tech)
        for chip in roofline.CHIPS.values():
            batches = predicted_batches(p, chip)
            b = roofline.predicted_crossover(tech, p.cfg, chip, depth, acc, p.context, batches, p.weight_dtype)
            top = f"none up to B={batches[-1]}" if batches else "no batch fits"
            predicted.append(f"{tech} on {chip.name}: {f'B={b}' if b else top}")
    return (f"measured (all steps): {measured}. PREDICTED ({p.model}, context {p.context}, roofline): "
            + ("; ".join(predicted) or "needs measured acceptance") + ".")


def _q3(t: Telemetry, p: PlanInputs) -> str:
    costs = {c.technique: c for c in p.plan(p.cfg).techniques}
    parts = []
    for tech in (x for x in TECHNIQUES if x != PLAIN and x in t.techniques):
        gain = operating_gain(t, tech)
        cost = costs.get(tech)
        displaced = f"{cost.tenants_displaced} tenant(s) of {p.context} tokens" if cost else "unknown memory"
        parts.append(f"{tech} costs {displaced} for " + (f"{fmt_ci(gain[1])}x goodput at B={gain[0]}"
                                                          if gain else "an unmeasured gain"))
    return "; ".join(parts) if parts else "no speculating steps recorded (planner projection only)"


def _q4(t: Telemetry) -> str:
    other = sorted(x for x in t.techniques if x not in TECHNIQUES)
    data = f"steps of {', '.join(other)} recorded" if other else "no compacting early-exit data in this database"
    bf16, int8 = (make_plan(parse_moe(MOE_SPEC), TPU_V6E_1, d, "bfloat16", 8192) for d in ("bfloat16", "int8"))
    return (f"{data}. MoE {MOE_SPEC} on a v6e-1 (planner): bfloat16 {bf16.verdict}; int8: "
            f"{int8.tenants} tenant(s) at 8192 tokens.")


def summary(t: Telemetry, p: PlanInputs) -> list[str]:
    """The "answers in short" list (Markdown lines)."""
    return ["## Answers in short", "",
            f"- **Q1 acceptance** (accepted / offered drafts; intervals in Q1): {_q1(t)}.",
            f"- **Q2 crossover**: {_q2(t, p)}",
            f"- **Q3 memory vs goodput**: {_q3(t, p)}.",
            f"- **Q4 early exit / MoE**: {_q4(t)}", ""]
