"""The verdict table that opens the report: per question, the answer measured here with its interval,
a labelled PREDICTION for a TPU v6e-1 and an H200 with its assumptions, and what would change it.

`Rounds` bundles what bench/report/runs.py reads back from `crossover bench findings`' round instances
(Q1 by sequence, Q2 and Q3 in rounds); each cell falls back to saying "not measured by this run" where
that data is absent, so an older database still renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import q1_sequences, q2_rounds, q3_rounds, roofline
from bench.report.data import Telemetry, measured_acceptance, usual_depth
from bench.report.early import speedup_ci
from bench.report.planned import PlanInputs, predicted_crossovers, spec_batch
from bench.report.runs import read_runs, read_sequences
from engine.memory.planner import DEFAULT_MAX_BATCH
from engine.policy import TECHNIQUES

AGREEMENT = 0.95
"""Q4's quality bar: greedy agreement with the full model a threshold must keep."""


@dataclass
class Rounds:
    q1: q1_sequences.Q1Sequences = field(default_factory=q1_sequences.Q1Sequences)
    q2: q2_rounds.Q2Rounds = field(default_factory=q2_rounds.Q2Rounds)
    q3: q3_rounds.Q3Rounds = field(default_factory=q3_rounds.Q3Rounds)


def read_rounds(engine: Any) -> Rounds:
    runs = read_runs(engine)
    q1_runs = read_runs(engine, set(q1_sequences.INSTANCES))
    sequences = read_sequences(engine, tuple(q1_sequences.INSTANCES))
    return Rounds(q1_sequences.analyse(sequences, q1_runs), q2_rounds.analyse(runs), q3_rounds.analyse(runs))


def _spec(t: Telemetry) -> list[str]:
    return [x for x in TECHNIQUES if x != "none" and any(k[0] == x for k in t.acceptance)]


def _q1(r: Rounds, t: Telemetry) -> list[str]:
    techs = sorted({k[1] for k in r.q1.groups})
    measured = ("; ".join(f"**{x}** {q1_sequences.verdict(r.q1, x)}" for x in techs) if techs else
                "not measured by sequence in this database")
    alone = any(k[2] == "alone" for k in r.q1.groups)
    return ["Q1. Does acceptance hold when tenants differ?",
            ("Batch mates change nothing a row drafts: verification is lossless, so a row's tokens and "
             "drafts do not depend on them ("
             + ("alone against mixed measured: in the cell's text" if alone
                else "holds by construction; not rerun alone")
             + "). Tenants differ several-fold: " + measured),
            ("PREDICTION (both chips): the same per-tenant acceptance. Assumes the same model, heads and "
             "traffic: acceptance depends on what is decoded, not on the chip."),
            "another target or draft model, other traffic, other sampling temperatures"]


def _q2(r: Rounds, t: Telemetry, p: PlanInputs) -> list[str]:
    if r.q2.cells:
        measured = "; ".join(f"**{x}** {q2_rounds.verdict(r.q2, x)}" for x in r.q2.techniques)
        knee = ", ".join(f"context {c} {q2_rounds.fmt_batch(r.q2.knee.get(c))}" for c in r.q2.contexts)
        measured += f". Plain decoding turns compute-bound at {knee}"
    else:
        measured = ("not measured in rounds by this database's run (its pooled per-step crossovers, section "
                    "Q2, mix runs that drifted apart)")
    return ["Q2. Where does speculation stop paying (the crossover)?", measured,
            (f"PREDICTION (roofline, {p.model}, context {p.context}, acceptance measured here, each "
             f"technique at its usual depth): {'; '.join(predicted_crossovers(t, p)) or 'none'}. Assumes "
             "kernels at the "
             "roofline with no host or launch overhead."),
            ("per-step host overhead (which the roofline leaves out), acceptance at the predicted context, a "
             "larger target model (more bytes per step moves the crossover up)")]


def _predicted_memory(t: Telemetry, p: PlanInputs) -> str:
    out = []
    for chip in roofline.CHIPS.values():
        plan = p.plan(p.cfg, chip.profile)
        if not plan.fits:
            continue
        b_plain = min(plan.tenants, DEFAULT_MAX_BATCH)
        base = roofline.goodput("none", p.cfg, chip, b_plain, 0, [], p.context, p.weight_dtype)
        for c in plan.techniques:
            if c.technique not in ("mtp", "draft") or c.technique not in _spec(t):
                continue
            b, displaced = spec_batch(c, plan, b_plain)
            gain = roofline.goodput(c.technique, p.cfg, chip, b, usual_depth(t, c.technique) or 1,
                                    measured_acceptance(t, c.technique), p.context, p.weight_dtype) / base
            out.append(f"{c.technique} on {chip.name}: {displaced} of {plan.tenants} tenants, {gain:.2f}x")
    return "; ".join(out) or "none (no MTP or draft-model acceptance measured)"


def _q3(r: Rounds, t: Telemetry, p: PlanInputs) -> list[str]:
    measured = ("; ".join(q3_rounds.verdict(row) for row in r.q3.rows.values()) if r.q3.rows else
                "not measured in rounds by this database's run (plain decoding kept speculation's memory)")
    return ["Q3. Is speculation's memory worth the tenants it displaces?", measured,
            (f"PREDICTION (planner + roofline, {p.model}, {p.weight_dtype}, context {p.context}, "
             f"capacity-aware batch up to {DEFAULT_MAX_BATCH}): {_predicted_memory(t, p)}."),
            "the context per tenant (KV bytes per tenant), the model size, the weight dtype, the pool split"]


def _q4(early: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    parts = []
    for path, data in early:
        agree = {str(q["threshold"]): q["greedy_agreement"] for q in data["quality"]}
        for b in sorted({c["batch"] for c in data["cells"]}):
            ok = [c for c in data["cells"] if c["batch"] == b and isinstance(c["threshold"], (int, float))
                  and agree.get(str(c["threshold"]), 0) >= AGREEMENT]
            if ok:
                c = max(ok, key=lambda c: c["speedup_vs_never"])
                ci = speedup_ci(c)
                shown = (f"{ci.value:.2f}x [{ci.low:.2f}, {ci.high:.2f}]" if ci else
                         f"{c['speedup_vs_never']:.2f}x (no interval)")
                parts.append(f"`{path.name}` B={b}: {shown}")
    measured = (f"best speedup over never exiting at greedy agreement >= {AGREEMENT}: " + "; ".join(parts)
                if parts else "not measured (no `--early-exit` file)")
    return ["Q4. Does early exit with a compacting scheduler pay?", measured,
            ("NO PREDICTION: the roofline has no model of mid-network compaction; on a chip that is "
             "memory-bound at the batch sizes served, skipping layers saves their weight reads only when the "
             "whole bucket shrinks."),
            "a threshold that keeps agreement while exiting more rows, buckets finer than powers of two"]


def table(r: Rounds, t: Telemetry, p: PlanInputs, early: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    rows = [_q1(r, t), _q2(r, t, p), _q3(r, t, p), _q4(early)]
    lines = ["## Verdicts", "",
             ("Measured on this machine (95% intervals: over rounds for Q2-Q4, over sequences for Q1) "
              "against a PREDICTION for a TPU v6e-1 and an H200 from the planner and the roofline model "
              "(assumptions in each cell and in section Q2); predictions are never drawn on a measured "
              "axis."), "",
             "| question | measured here (95% CI) | PREDICTION for TPU v6e-1 / H200 | what would change it |",
             "|---|---|---|---|"]
    lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in rows]
    return lines + [""]
