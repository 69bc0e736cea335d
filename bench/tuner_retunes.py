"""What the autotuned run of `crossover bench tuner` did (bench/tuner_report.py's module doc, 2-3):
the retune probe's inter-token gaps while a retune searches and while none runs, and the
policies and retunes read from its telemetry database.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from bench.serve_stats import distribution
from bench.tuner_ratios import TARGETS, met


def retune_itl(*probes: dict[str, Any]) -> dict[str, Any]:
    """Inter-token gaps ending while a retune searched vs those of the quiet windows before
    each retune, overlapping none, pooled over `probes` (one per round of --repeats: three
    retunes alone gave p99 ratios from 0.94 to 1.52 with the same code). A retune may apply a
    new policy, which changes the gaps by more than a search does; the quiet window before a
    retune is served by the policy its search runs under, so the gaps after the last retune
    (a policy no search ran under) are left out."""
    during, without, shown = [], [], []
    for probe in probes:
        d, w = _probe_gaps(probe)
        during += d
        without += w
        t0 = probe["settle"]["start"]
        shown += [{"id": x["id"], "status": x["status"], "version": x["version"], "note": x["note"],
                   "start_s": round(x["start"] - t0, 3), "search_s": round(x["search_end"] - x["start"], 3),
                   "total_s": round(x["end"] - x["start"], 3)} for x in [probe["settle"], *probe["windows"]]]
    d, w = distribution(during), distribution(without)
    ratio = round(d["p99"] / w["p99"], 4) if d["p99"] and w["p99"] else None
    return {"definition": "gap between two streamed chunks of one request; 'during' ends while "
                          "a retune searches, 'without' lies in a quiet window before a retune and "
                          "overlaps none (the settling one included)",
            "probes": len(probes), "retunes": shown, "during_ms": d, "without_ms": w,
            "p99_ratio": ratio, "requests": sum(len(p["streams"]) for p in probes),
            "seconds": round(sum(p["end"] - p["settle"]["start"] for p in probes), 3)}


def _probe_gaps(probe: dict[str, Any]) -> tuple[list[float], list[float]]:
    """One probe's gaps (seconds): (ending while a retune searched, in a quiet window)."""
    windows = probe["windows"]
    busy = [(probe["settle"]["start"], probe["settle"]["end"])] + [(w["start"], w["end"]) for w in windows]
    after = probe["settle"]["end"]
    until = windows[-1]["end"] if windows else probe["end"]
    during, without = [], []
    for s in probe["streams"]:
        for a, b in zip(s.chunks, s.chunks[1:]):
            if a < after or b > until:
                continue
            if any(w["start"] <= b <= w["search_end"] for w in windows):
                during.append(b - a)
            elif not any(a <= hi and b >= lo for lo, hi in busy):
                without.append(b - a)
    return during, without


def with_pooled_probes(result: dict[str, Any], probes: list[dict[str, Any]]) -> dict[str, Any]:
    """`result` (combine_rounds') with the retune-latency figures pooled over every round's
    probe; each round keeps its own ratio in `rounds[i]["retune_itl_p99_ratio"]`."""
    if not probes:
        return result
    itl = retune_itl(*probes)
    return {**result, "retune_itl": itl, "ratios": {**result["ratios"], "retune_itl": {
        "ratio": itl["p99_ratio"], "target": TARGETS["retune_itl"],
        "met": met(itl["p99_ratio"], TARGETS["retune_itl"], below=True)}}}


def read_history(database: Any, start: float) -> dict[str, Any]:
    """The policies and retunes of a run's database (times in seconds from the trace's start)."""
    from sqlalchemy import select

    from store.db import session_scope
    from store.history import retune_history
    from store.models import Policy

    with session_scope(database.engine) as session:
        policies = [{"version": p.version, "source": p.source, "created_s": _rel(p.created_at, start),
                     "rolled_back_at_s": _rel(p.rolled_back_at, start), "body": p.body}
                    for p in session.scalars(select(Policy).order_by(Policy.version))]
        retunes = [{"id": r.id, "by": r.triggered_by, "status": r.status,
                    "started_s": _rel(r.started_at, start), "finished_s": _rel(r.finished_at, start),
                    "version": r.chosen_policy_version, "predicted_goodput": r.predicted_goodput,
                    "measured_goodput": r.measured_goodput,
                    "note": r.error or (r.details or {}).get("reason")
                    or ((r.details or {}).get("validation") or {}).get("decision"),
                    **_search_evidence(r.details or {})}
                   for r in reversed(retune_history(session, limit=10_000))]
    return {"policies": policies, "retunes": retunes}


def _search_evidence(details: dict[str, Any]) -> dict[str, Any]:
    """What a retune's model saw (held-out fit error, acceptance, tenant factors) and how it
    searched: "exact" or "tpe", and its seconds from reading telemetry to the last trial."""
    if "fit" not in details:
        return {}
    model = details.get("model") or {}
    return {"fit": details["fit"], "acceptance": model.get("acceptance"),
            "tenant_factor": model.get("tenant_factor"), "search": details.get("search"),
            "tenants": details.get("tenants")}


def _rel(t: float | None, start: float) -> float | None:
    return None if t is None else round(t - start, 3)


def search_line(retunes: list[dict[str, Any]]) -> str:
    """How long the autotuned run's searches took.

    >>> search_line([{"search": {"method": "exact", "seconds": 0.5}},
    ...              {"search": {"method": "tpe", "seconds": 4.0}}, {"note": "no fit"}])
    'autotuned searches: 2 (exact 1, tpe 1), median 2.25 s, max 4.0 s'
    """
    done = [r["search"] for r in retunes if r.get("search")]
    if not done:
        return "autotuned searches: none"
    seconds = [x["seconds"] for x in done]
    methods = Counter(x["method"] for x in done)
    return (f"autotuned searches: {len(done)} ({', '.join(f'{m} {n}' for m, n in sorted(methods.items()))}), "
            f"median {np.median(seconds):.2f} s, max {max(seconds):.1f} s")


def tenant_search_line(retunes: list[dict[str, Any]]) -> str:
    """What the autotuned run's per-tenant searches decided and how long they took.

    >>> tenant_search_line([{"tenants": {"method": "exact", "seconds": 0.02, "chosen": True, "gain": 0.09}},
    ...                     {"tenants": {"method": "tpe", "seconds": 0.3, "chosen": False, "gain": 0.01}},
    ...                     {"note": "no fit"}])  # doctest: +NORMALIZE_WHITESPACE
    'per-tenant searches: 2 (exact 1, tpe 1), rules chosen in 1 (predicted gain up to +9.0%), median 0.16 s,
    max 0.3 s'
    """
    done = [r["tenants"] for r in retunes if r.get("tenants") and r["tenants"].get("method") != "skipped"]
    if not done:
        return "per-tenant searches: none"
    chosen = [x for x in done if x.get("chosen")]
    methods = Counter(x["method"] for x in done)
    seconds = [x["seconds"] for x in done]
    gain = f" (predicted gain up to {max(x['gain'] for x in chosen):+.1%})" if chosen else ""
    return (f"per-tenant searches: {len(done)} "
            f"({', '.join(f'{m} {n}' for m, n in sorted(methods.items()))}), rules chosen in "
            f"{len(chosen)}{gain}, median {np.median(seconds):.2f} s, max {max(seconds):.1f} s")
