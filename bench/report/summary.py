"""The report's answers: one paragraph per question, its figure, and where each number comes from.

Every sentence is written from the numbers the sections compute (nothing here is a claim typed
in by hand): acceptance from the Q1 counts, the measured crossover from the Q2 cells,
predictions from bench/report/roofline.py, memory against throughput from the pool runs
(bench/report/pool.py) or the Q3 operating point, the compacting early exit from the
`--early-exit` files, and the planner's MoE verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import pool
from bench.report.data import (
    ALL,
    MIXED,
    PositionCounts,
    Telemetry,
    q1_acceptance,
)
from bench.report.measured import PLAIN, crossovers, fmt_ci, goodput_cells, operating_gain
from bench.report.planned import MOE_SPEC, PlanInputs, predicted_crossovers
from bench.report.stats import Interval, quotient_ci, wilson
from engine.memory.planner import TPU_V6E_1, make_plan, parse_moe
from engine.policy import TECHNIQUES


def _rate(ci: Interval | None) -> str:
    return "n/a" if ci is None else f"{ci.value:.3f} [{ci.low:.3f}, {ci.high:.3f}]"


def _pooled(counts: list[PositionCounts]) -> Interval | None:
    return wilson(sum(sum(c.accepted) for c in counts), sum(sum(c.offered) for c in counts))


def _q1(t: Telemetry) -> list[str]:
    acc = q1_acceptance(t)
    if not acc:
        return ["No speculating step was recorded, so there is no acceptance to compare."]
    where = (f"instance `{t.tenant_instance}`, where every kind's prompts ran together in one batch (and "
             "alone, where the run asked for it)" if acc is not t.acceptance else "every instance")
    out = [f"Acceptance is drafts accepted / drafts offered (95% Wilson intervals), from {where}."]
    for tech in sorted({k[0] for k in acc}):
        alone = {g: c for (x, g), c in acc.items() if x == tech and g != MIXED}
        mixed = acc.get((tech, MIXED))
        a, m = _pooled(list(alone.values())), _pooled([mixed] if mixed else [])
        parts = [f"**{tech}** accepted {_rate(m)} in mixed batches and {_rate(a)} with each tenant alone "
                 "(pooled)"]
        if a is not None and m is not None:
            rel = ("lower than" if m.high < a.low else "higher than" if m.low > a.high else
                   "not distinguishable from")
            parts.append(f"mixed is {rel} alone")
        ranked = sorted(((wilson(sum(c.accepted), sum(c.offered)), g) for g, c in alone.items()
                         if sum(c.offered)),
                        key=lambda x: x[0].value)
        if len(ranked) > 1:
            (lo, lo_g), (hi, hi_g) = ranked[0], ranked[-1]
            parts.append(f"alone, tenants range from {lo_g} {_rate(lo)} to {hi_g} {_rate(hi)}")
        if mixed and mixed.offered:
            parts.append(f"first draft position mixed {_rate(wilson(mixed.accepted[0], mixed.offered[0]))}")
        out.append("; ".join(parts) + ".")
    return [" ".join(out)]


def _q2(t: Telemetry, p: PlanInputs) -> list[str]:
    cells = goodput_cells(t)
    found = crossovers(cells).get(ALL, {})
    out = []
    if found:
        plain = cells.get(ALL, {}).get(PLAIN, {})
        parts = []
        for tech, c in sorted(found.items()):
            spec = cells[ALL].get(tech, {})
            ends = [b for b in (min(c.compared, default=None), max(c.compared, default=None))
                    if b is not None]
            ratios = ", ".join(f"{fmt_ci(quotient_ci(spec[b], plain[b]))}x at B={b}"
                               for b in dict.fromkeys(ends)
                               if quotient_ci(spec[b], plain[b]))
            parts.append(f"**{tech}**: {c.describe()}"
                         + (f" (goodput over plain {ratios})" if ratios else ""))
        out.append("Measured here (decode-only steps of every instance, 95% delta-method intervals; the "
                   "crossover is the smallest batch whose interval lies wholly below plain decoding's): "
                   + "; ".join(parts) + ".")
    else:
        out.append("The crossover could not be measured: no batch size has both plain decoding and "
                   "speculation with five decode-only steps or more.")
    predicted = predicted_crossovers(t, p)
    if predicted:
        out.append(f"PREDICTED by the roofline step-time model for {p.model} at {p.context} tokens with the "
                   "acceptance measured here (assumptions in Q2): " + "; ".join(predicted) + ".")
    return [" ".join(out)]


def _q3(t: Telemetry, p: PlanInputs) -> list[str]:
    out = []
    rows = pool.pool_rows(t) if t.pool_runs else []
    base = pool.plain_run(t)
    if rows and base is not None:
        b = next(r for r in rows if r["run"] is base)
        out.append(f"One queue of requests, all queued at once, ran under each policy (instance "
                   f"`{t.pool_instance}`): plain decoding held {b['pages']:g} tenant pages, ran up to "
                   f"{base.peak_batch} sequences at once and delivered {fmt_ci(b['throughput'])} tokens/s.")
        parts = []
        for r in rows:
            if r["run"] is base or r["ratio"] is None:
                continue
            run = r["run"]
            parts.append(f"{run.technique}@{run.depth} at split {run.pool_split:g} lent {r['lent']:g} pages "
                         f"({r['lent_share']:.0%}), ran up to {run.peak_batch} at once and delivered "
                         f"{fmt_ci(r['ratio'])}x plain's throughput")
        if parts:
            out.append("Against it: " + "; ".join(parts) + ".")
            out.append(_q3_verdict(rows, base))
    costs = {c.technique: c for c in p.plan(p.cfg).techniques}
    planner = [f"{tech} {costs[tech].tenants_displaced}" for tech in TECHNIQUES if tech in costs]
    if planner:
        out.append(f"The planner prices each technique's memory for {p.model} on a v6e-1 at {p.context} "
                   f"tokens as tenants displaced: {', '.join(planner)}.")
    if not rows:
        gains = [(tech, operating_gain(t, tech)) for tech in TECHNIQUES if tech != PLAIN
                 and tech in t.techniques]
        parts = [f"{tech} {fmt_ci(g[1])}x at B={g[0]}" for tech, g in gains if g]
        out.append("No pool-split runs are in this database; goodput over plain at each technique's usual "
                   "batch: " + ("; ".join(parts) if parts else "not measured") + ".")
    return [" ".join(out)]


def _q3_verdict(rows: list[dict], base: Any) -> str:
    """One sentence: which runs' memory paid (interval of the ratio to plain wholly above 1), which
    cost more than it saved (wholly below) and which the run cannot tell apart from plain."""
    paid, lost, unclear = [], [], []
    for r in rows:
        if r["run"] is base or r["ratio"] is None:
            continue
        label = f"{r['run'].technique}@{r['run'].depth} split {r['run'].pool_split:g}"
        ratio = r["ratio"]
        (paid if ratio.low > 1 else lost if ratio.high < 1 else unclear).append(label)
    said = [f"paid for its memory: {', '.join(paid)}" if paid else "no run paid for its memory beyond doubt",
            f"cost more than it saved: {', '.join(lost)}" if lost else "",
            f"not distinguishable from plain: {', '.join(unclear)}" if unclear else ""]
    return ("In short, on this machine (95% intervals of the throughput ratio): "
            + "; ".join(s for s in said if s) + ".")


AGREEMENT, PAYS = 0.95, 1.05
"""Q4's bar: the most conservative threshold pays when it keeps this greedy agreement and gains this much."""


def _q4(t: Telemetry, early: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    out = []
    for path, data in early:
        cells = [c for c in data["cells"] if c["threshold"] != "never"]
        quality = {str(q["threshold"]): q for q in data["quality"]}
        parts, pays = [], []
        for b in sorted({c["batch"] for c in cells}):
            mine = [c for c in cells if c["batch"] == b and isinstance(c["threshold"], (int, float))
                    and c["threshold"] > 0]
            if not mine:
                continue
            best = max(mine, key=lambda c: c["speedup_vs_never"])
            q = quality.get(str(best["threshold"]))
            agree = (f", greedy agreement {q['greedy_agreement']:.3f}, "
                     f"perplexity x{q['perplexity_ratio']:.2f}" if q else "")
            safest = max(mine, key=lambda c: c["threshold"])
            qs = quality.get(str(safest["threshold"]))
            tail = (f"; at threshold {safest['threshold']:g} (agreement {qs['greedy_agreement']:.3f}) "
                    f"{safest['speedup_vs_never']:.2f}x" if qs and safest is not best else "")
            parts.append(f"B={b}: {best['speedup_vs_never']:.2f}x at threshold {best['threshold']:g} "
                         f"({best['exit_fraction']:.0%} of rows exited{agree}){tail}")
            if qs and qs["greedy_agreement"] >= AGREEMENT and safest["speedup_vs_never"] >= PAYS:
                pays.append(b)
        if parts:
            out.append(f"`{path.name}` ({data.get('kv_fill', '?')}; LOSSY), best speedup over never exiting "
                       "per batch size, among thresholds above 0: " + "; ".join(parts) + ". "
                       f"With greedy agreement >= {AGREEMENT} it gains >= {PAYS}x at "
                       + (f"B = {', '.join(map(str, pays))} only." if pays else "no batch size measured."))
    if not out:
        other = sorted(x for x in t.techniques if x not in TECHNIQUES)
        out.append("No compacting early-exit results were given (`--early-exit FILE`)"
                   + (f"; steps of {', '.join(other)} are in the database." if other else "."))
    bf16, int8 = (make_plan(parse_moe(MOE_SPEC), TPU_V6E_1, d, "bfloat16", 8192)
                  for d in ("bfloat16", "int8"))
    out.append(f"Mixture of experts, the essay's {MOE_SPEC} on a v6e-1 (planner, memory only): bfloat16 "
               f"{bf16.verdict}; int8: {int8.tenants} tenant(s) of 8192 tokens.")
    return [" ".join(out)]


QUESTIONS = (
    ("Q1", "Does acceptance hold when tenants do different things?", "q1_acceptance.png",
     "`xo_steps.accepted_per_pos`, `proposed`, `depth`, `tenants` (section Q1)"),
    ("Q2", "Where does speculation stop paying (the crossover)?", "q2_goodput_measured.png",
     ("`xo_steps.decode_tokens`, `step_ms`, `batch_size`, `prefill_tokens` (section Q2); predictions: "
      "bench/report/roofline.py with engine/memory/planner.py")),
    ("Q3", "Is speculation's memory worth the KV cache it displaces?", "q3_pool.png",
     ("`xo_steps.kv_pages_used + kv_pages_free`, `decode_tokens`, `step_ms` by `policy_version`, and "
      "`xo_policies.body.pool_split` (section Q3); planner: engine/memory/spec_memory.py")),
    ("Q4", "Does early exit with a compacting scheduler pay?", "q4_early_exit.png",
     "the `--early-exit` JSON files named in the header (section Q4); MoE: `crossover plan`"),
)


ROUND_FIGURES = {"Q1": "q1_sequences.png", "Q2": "q2_rounds.png", "Q3": "q3_rounds.png"}
"""Figures of the runs in rounds, shown instead of a question's default where drawn."""


def _rounds(r: Any) -> dict[str, str]:
    """Sentences from `crossover bench findings`' rounds (verdicts.Rounds), per question."""
    from bench.report import q1_sequences, q2_rounds, q3_rounds

    if r is None:
        return {}
    out = {}
    if r.q1.groups:
        out["Q1"] = "By sequence (95% intervals resampling sequences): " + "; ".join(
            f"**{x}** {q1_sequences.verdict(r.q1, x)}" for x in sorted({k[1] for k in r.q1.groups})) + "."
    if r.q2.cells:
        out["Q2"] = (f"In {r.q2.rounds} rounds, ratios formed within each round, each technique at its best "
                     "depth (95% intervals over rounds): "
                     + "; ".join(f"**{x}** {q2_rounds.verdict(r.q2, x)}" for x in r.q2.techniques) + ".")
    if r.q3.rows:
        out["Q3"] = (f"In {r.q3.rounds} rounds, plain decoding without speculation's memory: "
                     + "; ".join(q3_rounds.verdict(row) for row in r.q3.rows.values()) + ".")
    return out


def summary(t: Telemetry, p: PlanInputs, early: list[tuple[Path, dict[str, Any]]] | None = None,
            out: Path | None = None, rounds: Any = None) -> list[str]:
    """The "answers in short": a paragraph per question, its figure (when drawn), its source."""
    paragraphs = {"Q1": _q1(t), "Q2": _q2(t, p), "Q3": _q3(t, p), "Q4": _q4(t, early or [])}
    for key, text in _rounds(rounds).items():
        paragraphs[key] = [text, "", *paragraphs[key]]
    lines = ["## Answers in short", ""]
    for key, question, figure, source in QUESTIONS:
        lines += [f"### {key}. {question}", "", *paragraphs[key], ""]
        if out is not None and (out / ROUND_FIGURES.get(key, figure)).exists():
            figure = ROUND_FIGURES.get(key, figure)
        if key == "Q3" and out is not None and not (out / figure).exists():
            figure = "q3_displacement.png"
        if out is None or (out / figure).exists():
            lines += [f"![{key}]({figure})", ""]
        lines += [f"Source: {source}.", ""]
    return lines
