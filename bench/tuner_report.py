"""The figures of `crossover bench tuner` (bench.tuner): JSON summary and PNG plot.

1. Per policy and phase: goodput = output tokens of the requests that
   arrived in the phase / their engine time, where each step's step_ms is
   split evenly over the requests it emitted tokens for (a backlog served in
   the next phase, with --no-drain, counts where it arrived); the clients'
   TTFT, TPOT and inter-token gaps (ms) and errors of those requests; and,
   for the steps that started within the phase's time (drained: until its
   last request finished), their count, mean batch and share per (technique,
   depth) cell (a step whose rows drafted with several choices split over
   its row classes by their decode rows, so the shares still sum to 1).
   "whole" is the same over the three phases; `wall_s` and
   each phase's `wall_s` are its time on the clock.
2. Ratios, each with its target and whether it is met (ratios are rounded
   to 4 digits from the goodputs in the JSON):
   - per phase, autotuned over the best static policy of that phase (>= 0.95);
   - whole trace, autotuned over the best fixed policy: never, or one
     (technique, depth) at every batch size (>= 1.05);
   - whole trace, autotuned over the static oracle (each phase served by
     that phase's best static policy; >= 0.98);
   - whole trace, autotuned over the batch-size table (no target);
   - per phase, autotuned (which may give tenants rules of their own) over
     the best single-depth policy of that phase (the fixed policies and
     never), with the share of its steps whose rows drafted with several
     choices; in the mid-mixed phase (--mid-mixed) the target is >= 1.08;
   - with a "single-rule" run (the autotuned daemon with per-tenant rules
     off, --runs ...,single-rule): per phase and whole trace, autotuned over
     it (>= 0.98): considering per-tenant rules must not cost more than 2%
     where none pays. Neither tuned run is one of the static policies;
   - with a "tenants" run (a fixed per-tenant policy, --runs ...,tenants):
     per phase, it over the best single-depth policy of that phase, no
     target: what a per-tenant rule can gain on this machine where the
     tuner is not in the way. It is not one of the static policies above;
   - for reference, no target: the static oracle over the best fixed policy
     and over the table, which bound what switching policies once per phase
     can gain on this trace (a trace where they are near 1 cannot show a
     tuner's worth);
   - p99 inter-token gap while a retune searches over p99 while none runs
     (<= 1.10), from the probe after the autotuned trace.
3. The autotuned run's history, read from its telemetry database: every
   policy version (who made it, when, its rules) and every retune that ran
   (skips are only counted), with how it searched and for how long.
4. With --repeats N, every policy runs once per round (the order rotated
   each round) and each policy's figures are its median round's per phase
   and whole trace; the ratios come from those, each round's are in
   `rounds` (combine_rounds).
5. The PNG (bench.plots.tuner_plot): goodput bars per phase and whole trace
   for every policy, then the ratios as bars with their targets marked (the
   oracle's in grey).
6. `drift`: how fast the machine was in each run and phase (bench.drift: a
   speed index from the steps of shapes that several runs share), the
   goodputs and ratios with every step's time divided by its stretch's
   index (with --repeats, medians over the rounds as above; each round's
   indexes in `rounds`), and `search_slowdown`: the autotuned run's steps
   while a retune searched over those while none did. A diagnostic of the
   shared machine's drift; the targets are judged on the measured figures.

The ratios (2) are computed in bench/tuner_ratios.py, the retune probe's gaps and the
history (2's last, 3) in bench/tuner_retunes.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from bench.serve_stats import distribution
from bench.tuner_ratios import TARGETS, met, ratios
from bench.tuner_retunes import retune_itl, search_line, tenant_search_line


# ---- the summary ---------------------------------------------------------------------
def summarize(cfg: Any, engine: Any, phases: list[Any], arrivals: list[Any],
              runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from bench.workloads.trace import PHASE_NAMES

    policies = {name: _run_summary(run) for name, run in runs.items()}
    for name in ("autotuned", "single-rule"):
        if name in runs:
            policies[name]["history"] = _history_summary(runs[name]["history"])
    counts = Counter(a.phase for a in arrivals)
    trace = [{"phase": i, "name": PHASE_NAMES[i], "duration_s": p.duration_s,
              "rate_per_s": p.rate_per_s, "mix": dict(p.mix), "max_concurrency": p.max_concurrency,
              "requests": counts.get(i, 0)} for i, p in enumerate(phases)]
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()}
    result: dict[str, Any] = {
        "bench": "tuner", "config": config, "engine": _describe(engine), "trace": trace,
        "goodput_unit": "output tokens per second of engine step time (module doc, 1)", "policies": policies,
        "ratios": ratios(policies, names := [PHASE_NAMES[i] for i in range(len(phases))])}
    result["drift"] = drift(runs, names)
    auto = runs.get("autotuned")
    if auto is not None and auto["probe"] is not None:
        result["retune_itl"] = retune_itl(auto["probe"])
        result["ratios"]["retune_itl"] = {
            "ratio": result["retune_itl"]["p99_ratio"], "target": TARGETS["retune_itl"],
            "met": met(result["retune_itl"]["p99_ratio"], TARGETS["retune_itl"], below=True)}
    return result


def drift(runs: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The machine's speed per run and phase (bench.drift) and the goodputs and ratios with
    each step's time divided by it (module doc, 6): a diagnostic next to the measured ones."""
    from bench import drift as d

    fitted = d.fit(runs)
    policies = {}
    for name, run in runs.items():
        tokens, ms = _attribute(run, d.adjusted_ms(run, fitted["index"][name]))
        policies[name] = {"phases": [_goodput(tokens[i], ms[i]) for i in range(len(run["bounds"]))],
                          "whole": _goodput(sum(tokens.values()), sum(ms.values()))}
    out = {"speed_index": fitted["index"], "shared_steps": fitted["steps"], "policies": policies,
           "ratios": ratios(policies, names)}
    auto = runs.get("autotuned")
    if auto is not None and auto.get("history"):
        start = auto["bounds"][0][0]
        windows = [(start + r["started_s"], start + (r["finished_s"] or r["started_s"]))
                   for r in auto["history"]["retunes"] if r["started_s"] is not None]
        out["search_slowdown"] = d.search_slowdown(fitted["residual"].get("autotuned", []), windows)
    return out


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the summaries of several rounds (`bench tuner --repeats`): each policy's
    phases and whole trace are its median round's there (the lower middle of an even count,
    by goodput; a phase's figures stay those of one run), the ratios are recomputed from them,
    the retune-latency probe and the autotuned history are round 1's (`with_pooled_probes`
    pools every round's probe), and `rounds` lists each round's goodputs and ratios. One
    round: that round's summary as it is.

    >>> def summary(g):
    ...     return {"trace": [{"name": "low-copy"}], "policies": {
    ...         "never": {"phases": [{"goodput": g, "engine_tokens": g, "engine_s": 1.0}],
    ...                   "whole": {"goodput": g}}}, "ratios": {}}
    >>> out = combine_rounds([summary(3.0), summary(1.0), summary(2.0)])
    >>> (out["policies"]["never"]["phases"][0]["goodput"],
    ...  [r["policies"]["never"]["whole"] for r in out["rounds"]])
    (2.0, [3.0, 1.0, 2.0])
    """
    if len(rounds) == 1:
        return rounds[0]
    first, names = rounds[0], [p["name"] for p in rounds[0]["trace"]]
    policies = _median_policies([r["policies"] for r in rounds])
    out = {**first, "policies": policies, "ratios": ratios(policies, names)}
    if "retune_itl" in first["ratios"]:
        out["ratios"]["retune_itl"] = first["ratios"]["retune_itl"]
    if all("drift" in r for r in rounds):
        adjusted = _median_policies([r["drift"]["policies"] for r in rounds])
        out["drift"] = {"policies": adjusted, "ratios": ratios(adjusted, names)}
    out["rounds"] = [{"policies": _goodputs(r["policies"]),
                      "ratios": {k: v for k, v in r["ratios"].items() if k != "retune_itl"},
                      **({"retune_itl_p99_ratio": r["ratios"]["retune_itl"]["ratio"]}
                         if "retune_itl" in r["ratios"] else {}),
                      **({"drift": _round_drift(r["drift"])} if "drift" in r else {})}
                     for r in rounds]
    return out


def _median_policies(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each policy of the rounds' {policy: figures} with its phases and whole trace its median
    round's (median_run; other fields from round 1)."""
    out = {}
    for name, run in rounds[0].items():
        each = [r[name] for r in rounds]
        phases = [median_run([e["phases"][i] for e in each]) for i in range(len(run["phases"]))]
        out[name] = {**run, "phases": phases, "whole": median_run([e["whole"] for e in each])}
    return out


def _goodputs(policies: dict[str, Any]) -> dict[str, Any]:
    """{policy: {"phases": [goodput per phase], "whole": goodput}}: what `rounds` keeps."""
    return {n: {"phases": [p["goodput"] for p in run["phases"]], "whole": run["whole"]["goodput"]}
            for n, run in policies.items()}


def _round_drift(drift: dict[str, Any]) -> dict[str, Any]:
    """What `rounds` keeps of a round's drift figures: goodputs, indexes and ratios."""
    return {"policies": _goodputs(drift["policies"]),
            **{k: drift[k] for k in ("speed_index", "ratios", "search_slowdown") if k in drift}}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run (or phase) whose goodput is the median of `runs` (the lower middle one of an
    even count), so its other figures belong to the same run; with one run, that run.

    >>> median_run([{"goodput": 3.0}, {"goodput": 1.0}, {"goodput": 2.0}])
    {'goodput': 2.0}
    """
    ordered = sorted(runs, key=lambda r: r["goodput"])
    return ordered[(len(ordered) - 1) // 2]


def _run_summary(run: dict[str, Any]) -> dict[str, Any]:
    bounds = run["bounds"]
    start, end = bounds[0][0], bounds[-1][1]
    tokens, ms = _attribute(run)
    out = []
    for i, (lo, hi) in enumerate(bounds):
        steps = [stats for stats, _ in run["steps"] if lo <= stats.time < hi]
        streams = [s for s in run["streams"] if s.phase == i]
        out.append({"phase": i, **_goodput(tokens[i], ms[i]), **_steps(steps), **_clients(streams),
                    "wall_s": round(hi - lo, 3)})
    steps = [stats for stats, _ in run["steps"] if start <= stats.time < end]
    whole = _goodput(sum(tokens.values()), sum(ms.values()))
    return {"policy": run["policy"], "other_processes_cpu_share": run["other_processes_cpu_share"],
            "steal_share": run.get("steal_share"),
            "search_process_cpu_s": run["search_process_cpu_s"],
            "compiles_during_trace": run["compiles_during_trace"], "phases": out,
            "whole": {**whole, **_steps(steps), **_clients(run["streams"]), "wall_s": round(end - start, 3)}}


def _attribute(run: dict[str, Any], ms_of: Any = None) -> tuple[Counter, Counter]:
    """Phase -> output tokens and engine ms of the requests that arrived in it (module doc, 1).
    `ms_of(stats)`: a step's time (default its measured step_ms)."""
    phase_of = {s.request_id: s.phase for s in run["streams"] if s.request_id}
    tokens: Counter = Counter()
    ms: Counter = Counter()
    for stats, per_request in run["steps"]:
        for request_id, n in per_request.items():
            phase = phase_of.get(request_id)
            if phase is not None:
                tokens[phase] += n
                ms[phase] += (stats.step_ms if ms_of is None else ms_of(stats)) / len(per_request)
    return tokens, ms


def _goodput(tokens: int, ms: float) -> dict[str, Any]:
    return {"goodput": round(tokens * 1000.0 / ms, 3) if ms else 0.0, "engine_tokens": tokens,
            "engine_s": round(ms / 1000.0, 4)}


def _steps(steps: list[Any]) -> dict[str, Any]:
    """What the engine did in a stretch of time: steps, mean batch, share per cell, and the
    share of steps whose rows drafted with more than one (technique, depth) choice ("none"
    counted as one; per-tenant rules at work)."""
    cells: Counter = Counter()
    for s in steps:
        cells.update(cell_shares(s))
    per_row = sum(len({(c.technique, c.depth) for c in getattr(s, "row_classes", ())}) > 1
                  for s in steps)
    return {"steps": len(steps),
            "mean_batch": round(sum(s.batch_size for s in steps) / len(steps), 2) if steps else 0.0,
            "cells": {k: round(v / len(steps), 3) for k, v in cells.most_common()},
            "per_row_steps": round(per_row / len(steps), 3) if steps else 0.0}


def cell_shares(s: Any) -> dict[str, float]:
    """A step's share of each (technique, depth) cell: its row classes by their decode rows, or
    all of it in its own cell without classes (older telemetry, no decode rows).

    >>> from engine.types import RowClass, StepStats
    >>> cell_shares(StepStats(technique="ngram", depth=4, row_classes=(
    ...     RowClass("copy", "ngram", 4, 3), RowClass("chat", "mtp", 2, 1))))
    {'ngram@4': 0.75, 'mtp@2': 0.25}
    """
    classes = getattr(s, "row_classes", ())
    rows = sum(c.rows for c in classes)
    if not rows:
        return {_cell(s.technique, s.depth): 1.0}
    out: Counter = Counter()
    for c in classes:
        out[_cell(c.technique, c.depth)] += c.rows / rows
    return dict(out)


def _cell(technique: str, depth: int) -> str:
    return f"{technique}@{depth}" if depth else "none"


def _clients(streams: list[Any]) -> dict[str, Any]:
    ok = [s for s in streams if s.error is None and s.chunks]
    tpot = [(s.chunks[-1] - s.chunks[0]) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]
    return {"requests": len(streams), "errors": sum(s.error is not None for s in streams),
            "output_tokens": sum(s.output_tokens for s in ok),
            "ttft_ms": distribution([s.chunks[0] - s.sent for s in ok]),
            "tpot_ms": distribution(tpot), "itl_ms": distribution(_gaps(ok))}


def _gaps(streams: list[Any]) -> list[float]:
    return [b - a for s in streams for a, b in zip(s.chunks, s.chunks[1:])]


def _history_summary(history: dict[str, Any]) -> dict[str, Any]:
    real = [r for r in history["retunes"] if not (r["note"] or "").startswith("skipped")]
    return {"policies": [{**p, "rules": describe(p["body"])} for p in history["policies"]],
            "retunes": real, "skipped": len(history["retunes"]) - len(real),
            "statuses": dict(Counter(r["status"] for r in real))}


def describe(body: dict[str, Any]) -> str:
    """A policy in one line.

    >>> describe({"rules": [{"max_batch": 4, "technique": "ngram", "depth": 4},
    ...                     {"max_batch": 32, "technique": "none", "depth": 0}], "crossover": 4})
    '<=4 ngram@4, <=32 none; crossover 4; split 0.0'
    """
    rules = body.get("rules") or [{"max_batch": 1 << 30, "technique": "none", "depth": 0}]
    parts = [f"<={r['max_batch']} {r['technique']}@{r['depth']}" if r["depth"]
             else f"<={r['max_batch']} none" for r in rules]
    tenants = [f"{t['tenant']} {t['technique']}@{t['depth']}<={t['max_batch']}" if t["depth"]
               else f"{t['tenant']} none<={t['max_batch']}" for t in body.get("tenants") or []]
    return (f"{', '.join(parts)}; crossover {body.get('crossover', 0)}; split {body.get('pool_split', 0.0)}"
            + (f"; tenants {', '.join(tenants)}" if tenants else ""))


def headline(result: dict[str, Any]) -> list[str]:
    """The figures in a few lines for stderr."""
    lines = []
    for name, run in result["policies"].items():
        per = ", ".join(f"{p['goodput']:.1f}" for p in run["phases"])
        lines.append(f"{name}: goodput per phase {per}, whole {run['whole']['goodput']:.1f} tok/s")
    ratios = result["ratios"]
    rows = [(f"phase {r['phase'] + 1} vs best static ({r['best_static']})", r)
            for r in ratios.get("per_phase", [])]
    rows += [((f"phase {r['phase'] + 1} per-tenant vs best single depth ({r['best_single_depth']}; "
               f"{r['per_row_steps']:.0%} of steps with per-row choices)"), r)
             for r in ratios.get("per_phase_vs_single_depth", [])]
    rows += [((f"phase {r['phase'] + 1} fixed per-tenant policy vs best single depth "
               f"({r['best_single_depth']}; {r['per_row_steps']:.0%} of steps with per-row choices)"), r)
             for r in ratios.get("tenants_vs_single_depth", [])]
    rows += [(f"phase {r['phase'] + 1} vs the single-rule tuner", r)
             for r in ratios.get("vs_single_rule", [])]
    rows += [(key, r) for key, r in ratios.items() if key not in PER_PHASE]
    for label, r in rows:
        verdict = "" if r["target"] is None else f" (target {r['target']}: {'met' if r['met'] else 'missed'})"
        lines.append(f"{label}: {r['ratio']}{verdict}")
    auto = result["policies"].get("autotuned")
    if auto is not None:
        lines.append(search_line(auto["history"]["retunes"]))
        lines.append(tenant_search_line(auto["history"]["retunes"]))
    if "drift" in result:
        lines.append(drift_line(result))
    return lines


PER_PHASE = ("per_phase", "per_phase_vs_single_depth", "tenants_vs_single_depth", "vs_single_rule")
"""The ratios given per phase (lists), each on lines of its own in `headline`."""


def drift_line(result: dict[str, Any]) -> str:
    """The drift-adjusted ratios (module doc, 6) in one line, with each run's speed index."""
    drift, parts = result["drift"], []
    r = drift["ratios"]
    if "per_phase" in r:
        parts.append("per phase " + " / ".join(f"{x['ratio']}" for x in r["per_phase"]))
    for key, label in (("whole_vs_best_fixed", "best fixed"), ("whole_vs_oracle", "oracle")):
        if key in r:
            parts.append(f"{r[key]['ratio']}x {label}")
    rounds = [x["drift"] for x in result.get("rounds", [])] or [drift]
    speeds = "; ".join(", ".join(f"{n} {'/'.join(f'{v:.2f}' for v in idx)}"
                                 for n, idx in d["speed_index"].items()) for d in rounds
                                 if "speed_index" in d)
    slow = [d["search_slowdown"]["ratio"] for d in rounds if d.get("search_slowdown", {}).get("ratio")]
    return (f"drift-adjusted (a diagnostic): {', '.join(parts)}; speed index per phase: {speeds}"
            + (f"; steps while searching / not: {', '.join(f'{x:.2f}' for x in slow)}" if slow else ""))


def _describe(engine: Any) -> dict[str, Any]:
    from engine.fake import FakeEngine

    capacity = engine.capacity()
    info: dict[str, Any] = {"model": engine.model_name, "max_batch": engine.max_batch,
                            "max_context": engine.max_context,
                            "proposers": sorted(capacity.proposers)}
    if isinstance(engine, FakeEngine):
        info.update(engine="FakeEngine", cost=vars(engine.cost) if engine.cost else None,
                    tenant_acceptance=engine.tenant_acceptance,
                    acceptance={n: list(p.acceptance) for n, p in engine.proposers.items()})
    else:
        import jax

        rc = engine.runner.rc
        info.update(engine="EngineCore", dtype=rc.dtype, backend=jax.default_backend(),
                    spec_max_batch=capacity.spec_max_batch, verify_tokens=list(rc.verify_tokens))
    return info


def write_result(result: dict[str, Any], out_path: str) -> dict[str, Any]:
    """Write the PNG next to `out_path` (same name, .png), then the JSON naming it."""
    from bench.plots import tuner_plot

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    result["plot"] = tuner_plot(result, png)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result
