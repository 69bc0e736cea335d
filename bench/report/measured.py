"""The measured halves of `crossover report`: Q1 (acceptance) and Q2 (the crossover, measured).

Each `*_section` takes the accumulated `Telemetry`, writes its figures into
the output folder and returns Markdown lines; with nothing to show it says so
in words. Every table is followed by the query it came from.
"""

from __future__ import annotations

from pathlib import Path

from bench.report import figures
from bench.report.data import ALL, ALONE, MIXED, Telemetry, q1_acceptance, q1_mixed_by_tenant
from bench.report.stats import Crossover, Interval, crossover, quotient_ci, ratio_ci, wilson

PLAIN = "none"
"""The technique name steps record for plain decoding."""

STEPS_SOURCE = ("`xo_steps` raw rows (`SELECT technique, depth, batch_size, prefill_tokens, decode_tokens, "
                "step_ms, proposed, accepted_per_pos, tenants, row_classes, ... FROM xo_steps`, "
                "bench/report/data.py)")


def fmt_num(x: float) -> str:
    """Three significant digits, whole numbers from 100 up: 0.612, 12.3, 1066."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fmt_ci(ci: Interval | None) -> str:
    """'0.612 [0.58, 0.644]' or 'n/a'."""
    if ci is None:
        return "n/a"
    return f"{fmt_num(ci.value)} [{fmt_num(ci.low)}, {fmt_num(ci.high)}]"


def fmt_rate(ci: Interval | None) -> str:
    return "n/a" if ci is None else f"{ci.value:.3f} [{ci.low:.3f}, {ci.high:.3f}]"


def _group_order(groups: list[str]) -> list[str]:
    """Tenants alone first (by name), the mixed group last."""
    return sorted(groups, key=lambda g: (g == MIXED, g))


def acceptance_rows(t: Telemetry) -> dict[str, dict[str, list[Interval]]]:
    """Technique -> group -> Wilson interval of acceptance at each draft position."""
    out: dict[str, dict[str, list[Interval]]] = {}
    for (tech, group), c in sorted(q1_acceptance(t).items()):
        cis = [wilson(a, o) for a, o in zip(c.accepted, c.offered)]
        label = group if group == MIXED else f"{group} alone"
        out.setdefault(tech, {})[label] = [ci for ci in cis if ci is not None]
    return {tech: {g: groups[g] for g in _group_order(list(groups))} for tech, groups in out.items()}


def q1_section(t: Telemetry, out: Path) -> list[str]:
    lines = ["## Q1. Does acceptance hold on multi-tenant traffic?", ""]
    acc = q1_acceptance(t)
    if not acc:
        return lines + [("**No data:** no step in `xo_steps` speculated (depth > 0 with proposed drafts > "
                        "0), so there is no acceptance to report. Serve traffic with a speculative policy "
                        "(e.g. `crossover bench tuner`, or `crossover serve` under load) "
                        "into this database."), ""]
    lines += [("Acceptance = drafts accepted / drafts offered; a step of depth d with P proposed drafts "
              "offers P/d drafts at each position; a step that records row classes (`row_classes`: its rows "
              "may draft with several techniques and depths) counts each class at its own technique and "
              "depth. *Alone*: steps whose batch held one tenant; *mixed*: several. Intervals: 95% Wilson."),
              "",
              "| technique | batches | steps | drafts proposed | acceptance (all positions) | per position |",
              "|---|---|---:|---:|---|---|"]
    for (tech, group) in sorted(acc, key=lambda k: (k[0], k[1] == MIXED, k[1])):
        c = acc[(tech, group)]
        overall = wilson(sum(c.accepted), sum(c.offered))
        per_pos = "; ".join(f"{i + 1}: {fmt_rate(wilson(a, o))}"
                            for i, (a, o) in enumerate(zip(c.accepted, c.offered)))
        label = "mixed tenants" if group == MIXED else f"{group} alone"
        lines.append(f"| {tech} | {label} | {c.steps} | {c.proposed} | {fmt_rate(overall)} | {per_pos} |")
    only = (f" of instance `{t.tenant_instance}` only (the same prompts alone and mixed)"
            if acc is not t.acceptance else "")
    lines += ["", (f"Source: {STEPS_SOURCE}{only}, speculating steps (depth > 0, proposed > 0) grouped by "
              "(technique, tenant alone | mixed); per-position sums of `accepted_per_pos` (of each row "
              "class's where recorded)."), ""]
    lines += _mixed_by_tenant(t)
    lines += figures.embed(figures.acceptance_figure(acceptance_rows(t), out), "acceptance by draft position")
    lines += _verdicts(t)
    lines += _tenant_pays(t)
    lines += _tenant_requests(t, out)
    return lines


def _mixed_by_tenant(t: Telemetry) -> list[str]:
    """Each tenant's own acceptance in several-tenant batches, from its row classes."""
    per = q1_mixed_by_tenant(t)
    if not per:
        return []
    lines = [("Per tenant inside mixed batches, from the steps' row classes (each tenant's rows counted "
              "alone, whatever shared the batch):"), "",
             "| technique | tenant | steps | drafts proposed | acceptance (all positions) | per position |",
             "|---|---|---:|---:|---|---|"]
    for (tech, tenant), c in sorted(per.items()):
        per_pos = "; ".join(f"{i + 1}: {fmt_rate(wilson(a, o))}"
                            for i, (a, o) in enumerate(zip(c.accepted, c.offered)))
        lines.append(f"| {tech} | {tenant} | {c.steps} | {c.proposed} | "
                     f"{fmt_rate(wilson(sum(c.accepted), sum(c.offered)))} | {per_pos} |")
    return lines + ["", ("Source: the same rows' `row_classes` (one JSON object per tenant, technique and "
                         "depth: rows, proposed, accepted, accepted_per_pos), several-tenant steps only."),
                         ""]


def _verdicts(t: Telemetry) -> list[str]:
    """Per technique: does any tenant's alone interval sit apart from the mixed one?"""
    out = []
    acc = q1_acceptance(t)
    for tech in sorted({k[0] for k in acc}):
        mixed = acc.get((tech, MIXED))
        alone = {g: c for (x, g), c in acc.items() if x == tech and g != MIXED}
        if mixed is None or not alone:
            have = "mixed batches only" if mixed else "single-tenant batches only"
            out.append(f"- **{tech}**: {have} were recorded; alone vs mixed cannot be compared.")
            continue
        m = wilson(sum(mixed.accepted), sum(mixed.offered))
        parts = []
        for g, c in sorted(alone.items()):
            a = wilson(sum(c.accepted), sum(c.offered))
            if a is None or m is None:
                continue
            parts.append(f"{g} alone {a.value:.3f} is {_relation(a, m)} mixed {m.value:.3f}")
            own = q1_mixed_by_tenant(t).get((tech, g))
            o = wilson(sum(own.accepted), sum(own.offered)) if own is not None else None
            if o is not None:
                parts.append(f"{g} alone is {_relation(a, o)} {g} in mixed batches {o.value:.3f}")
        out.append(f"- **{tech}**: " + ("; ".join(parts) or "no interval") + ".")
    return out + [""] if out else []


def _relation(a: Interval, b: Interval) -> str:
    return "higher than" if a.low > b.high else "lower than" if a.high < b.low else "not distinguishable from"


def _tenant_pays(t: Telemetry) -> list[str]:
    """Per tenant alone and for mixed batches: the batch sizes where each technique pays."""
    cells = goodput_cells(t)
    out = []
    for mix, techs in cells.items():
        if mix == ALL or mix == ALONE or PLAIN not in techs:
            continue
        for tech, per_batch in sorted(techs.items()):
            if tech == PLAIN:
                continue
            ratios = {b: quotient_ci(ci, techs[PLAIN][b]) for b, ci in per_batch.items() if b in techs[PLAIN]}
            pays = [b for b, q in ratios.items() if q and q.low > 1]
            loses = [b for b, q in ratios.items() if q and q.high < 1]
            open_ = [b for b in ratios if b not in pays and b not in loses]
            verdict = "; ".join(f"{word} at B = {', '.join(map(str, bs))}" for word, bs in
                                (("pays", pays), ("loses", loses), ("undecided", open_)) if bs)
            out.append(f"- {tech}, {'mixed batches' if mix == MIXED else mix}: "
                       f"{verdict or 'no batch size with plain decoding measured too'}")
    if not out:
        return []
    return [("Does speculation pay per tenant? Decode-only goodput against plain decoding in the same kind "
             "of batch: *pays* / *loses* where the ratio's 95% interval lies above / below 1 "
             "(details in Q2)."),
            "", *out, ""]


def _tenant_requests(t: Telemetry, out: Path) -> list[str]:
    lines = ["### Per tenant, from requests", ""]
    if not t.by_tenant:
        return lines + ["**No data:** `xo_requests` holds no finished request.", ""]
    lines += [("Each request's proposed/accepted totals, classed by the steps carrying its tenant between "
              "its arrival and finish: *alone* (all single-tenant), *mixed* (all several-tenant) or *both*. "
              "Requests do not record their technique: these pool every technique the tenant ran."), "",
              "| tenant | requests ran | requests | drafts proposed | acceptance |",
              "|---|---|---:|---:|---|"]
    fig: dict[str, dict[str, Interval]] = {}
    for (tenant, kind), c in sorted(t.by_tenant.items()):
        ci = wilson(c.accepted, c.proposed)
        lines.append(f"| {tenant} | {kind} | {c.requests} | {c.proposed} | {fmt_rate(ci)} |")
        if ci is not None and kind != "no steps":
            fig.setdefault(tenant, {})[kind] = ci
    lines += ["", ("Source: `SELECT instance, tenant, arrival_time, finish_time, proposed_tokens, "
              "accepted_tokens FROM xo_requests`, joined in Python to the `xo_steps` rows of the same "
              "instance and tenant (bench/report/data.py `_request_kind`)."), ""]
    lines += figures.embed(figures.tenant_figure(fig, out), "acceptance per tenant")
    return lines


def goodput_cells(t: Telemetry) -> dict[str, dict[str, dict[int, Interval]]]:
    """Mix -> technique -> batch size -> goodput interval (cells with at least MIN_STEPS steps)."""
    out: dict[str, dict[str, dict[int, Interval]]] = {}
    for (tech, mix, batch), m in sorted(t.goodput.items()):
        ci = ratio_ci(m)
        if ci is not None:
            out.setdefault(mix, {}).setdefault(tech, {})[batch] = ci
    order = [ALL, ALONE, MIXED]
    return {mix: out[mix] for mix in sorted(out, key=lambda x: (order.index(x) if x in order else 3, x))}


def crossovers(cells: dict[str, dict[str, dict[int, Interval]]]) -> dict[str, dict[str, Crossover]]:
    """Mix -> technique -> its measured crossover against plain decoding in the same mix."""
    return {mix: {tech: crossover(c, techs.get(PLAIN, {})) for tech, c in techs.items() if tech != PLAIN}
            for mix, techs in cells.items()}


def q2_measured_section(t: Telemetry, out: Path) -> list[str]:
    lines = ["## Q2. The crossover: the batch size above which speculation stops paying", "",
             "### Measured", ""]
    cells = goodput_cells(t)
    spec = [tech for techs in cells.values() for tech in techs if tech != PLAIN]
    if not cells or not spec or not any(PLAIN in techs for techs in cells.values()):
        missing = "no decode-only steps" if not cells else (
            "no speculating steps" if not spec else "no plain-decoding steps (technique 'none')")
        return lines + [(f"**No data:** {missing} with at least 5 steps per (technique, batch size) in "
                        "`xo_steps`; the crossover needs both plain decoding and speculation measured at "
                        "the same batch sizes (`crossover bench crossover` or a served trace)."), ""]
    found = crossovers(cells)
    lines += [("Goodput = Σ decode_tokens / Σ step_ms over decode-only steps (prefill_tokens = 0) of one "
              "(technique, batch size), every depth pooled (a step whose rows drafted with several "
              "techniques counts once, as technique `mixed`); 95% interval by the delta method for a ratio "
              "of sums. **Crossover**: the smallest batch size at which speculation's interval lies wholly "
              "below plain decoding's (same tenant mix); the bracket starts at the largest smaller batch "
              "where it lies wholly above."), "",
              "| technique | steps in | crossover | batch sizes compared |", "|---|---|---|---|"]
    for mix, techs in found.items():
        for tech, c in sorted(techs.items()):
            compared = ", ".join(str(b) for b in c.compared) or "-"
            lines.append(f"| {tech} | {mix} | {c.describe()} | {compared} |")
    lines += ["", ("Goodput per cell (tokens/s, 95% CI) and speculation over plain (per-tenant cells: the "
              "figure below and the Q1 summary):"), "",
              "| steps in | technique | batch | steps | goodput | plain | ratio |",
              "|---|---|---:|---:|---|---|---|"]
    for mix, techs in cells.items():
        if mix not in (ALL, ALONE, MIXED):
            continue
        plain = techs.get(PLAIN, {})
        for tech, per_batch in sorted(techs.items()):
            if tech == PLAIN:
                continue
            for b, ci in per_batch.items():
                p = plain.get(b)
                ratio = quotient_ci(ci, p) if p else None
                n = t.goodput[(tech, mix, b)].n
                lines.append(f"| {mix} | {tech} | {b} | {n} | {fmt_ci(ci)} | {fmt_ci(p)} | {fmt_ci(ratio)} |")
    lines += ["", (f"Source: {STEPS_SOURCE}, decode-only steps grouped by (technique, tenant mix, "
              f"batch_size); {t.decode_steps} of {t.steps} steps are decode-only. Cells with fewer than 5 "
              "steps are left out."), ""]
    marks = {mix: {tech: c.batch for tech, c in techs.items()} for mix, techs in found.items()}
    lines += figures.embed(figures.goodput_figure(cells, marks, out), "measured goodput against batch size")
    return lines


def operating_gain(t: Telemetry, technique: str) -> tuple[int, Interval] | None:
    """(batch, goodput ratio over plain) at the batch size `technique` ran most decode steps at,
    among those where both have an interval (all tenant mixes)."""
    cells = goodput_cells(t).get(ALL, {})
    spec, plain = cells.get(technique, {}), cells.get(PLAIN, {})
    both = [b for b in spec if b in plain]
    if not both:
        return None
    b = max(both, key=lambda x: (t.goodput[(technique, ALL, x)].n, -x))
    q = quotient_ci(spec[b], plain[b])
    return (b, q) if q is not None else None
