"""`crossover bench tuner-compare A.json B.json`: do two `bench tuner` runs read the same?

`bench tuner --quick` exists so that a tuner change can be checked in minutes; it is only
useful while it reads what the full run reads. This compares two result JSONs of the
three-phase trace (typically a quick run against the full run of record), ratio by ratio:

- per phase, autotuned over that phase's best static policy;
- whole trace, autotuned over the best fixed policy and over the static oracle;
- the static oracle over the best fixed policy (what the trace lets switching gain);
- retune inter-token latency p99 over none.

Each ratio has a median (the run's figure) and per-round values (`rounds` of a
`--repeats` run; a one-round run has its figure alone); its range spans both. Two
readings agree when either median lies within the other run's range: the machine moves a phase's
ratio by up to 0.1-0.2 between rounds (bench/README.md), and that range is the noise
each run shows itself. Also reported, not part of the verdict: whether each phase's best
static policy and each target's met/not-met are the same in both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Reading = Callable[[dict[str, Any]], float | None]


def _phase(i: int) -> Reading:
    def read(ratios: dict[str, Any]) -> float | None:
        phases = ratios.get("per_phase", [])
        return phases[i].get("ratio") if i < len(phases) else None
    return read


def _key(name: str) -> Reading:
    return lambda ratios: (ratios.get(name) or {}).get("ratio")


READINGS: dict[str, Reading] = {
    "low-copy vs best static": _phase(0),
    "high-mixed vs best static": _phase(1),
    "low-prose vs best static": _phase(2),
    "whole vs best fixed": _key("whole_vs_best_fixed"),
    "whole vs oracle": _key("whole_vs_oracle"),
    "oracle vs best fixed": _key("oracle_vs_best_fixed"),
    "retune ITL p99": _key("retune_itl"),
}


def load(path: str) -> dict[str, Any]:
    """A `bench tuner` result JSON; ValueError naming the file when it is not one."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(result, dict) or "ratios" not in result or "per_phase" not in result["ratios"]:
        raise ValueError(f"{path}: not a `crossover bench tuner` result of the three-phase trace")
    return result


def readings(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Name -> {"median": the run's figure, "rounds": per-round figures, "range": the least
    and greatest of both} of each READINGS ratio the run has. A round's retune ITL ratio is
    its `retune_itl_p99_ratio`."""
    rounds = result.get("rounds") or []
    out = {}
    for name, read in READINGS.items():
        median = read(result["ratios"])
        if median is None:
            continue
        per_round = [r.get("retune_itl_p99_ratio") if name == "retune ITL p99" else read(r.get("ratios", {}))
                     for r in rounds]
        per_round = [v for v in per_round if v is not None]
        # the median run's ratio comes from median goodputs, so it can fall outside its rounds'
        low, high = min([median, *per_round]), max([median, *per_round])
        out[name] = {"median": median, "rounds": per_round or [median], "range": [low, high]}
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The agreement of run `a` with run `b` (module doc).

    >>> def run(*phases, rounds=()):
    ...     r = {"ratios": {"per_phase": [{"ratio": p, "best_static": "table"} for p in phases]}}
    ...     return {**r, "rounds": [{"ratios": {"per_phase": [{"ratio": p} for p in x]}} for x in rounds]}
    >>> full = run(1.0, 0.99, 1.0, rounds=[(1.05, 0.96, 1.03), (1.0, 0.99, 0.88), (0.98, 1.0, 1.06)])
    >>> c = compare(run(1.04, 0.9, 0.93), full)
    >>> [(r["name"][:9], r["agree"]) for r in c["ratios"]], c["agree"]
    ([('low-copy ', True), ('high-mixe', False), ('low-prose', True)], False)
    """
    ra, rb = readings(a), readings(b)
    rows = []
    for name in READINGS:
        if name not in ra or name not in rb:
            continue
        x, y = ra[name], rb[name]
        agree = y["range"][0] <= x["median"] <= y["range"][1] or x["range"][0] <= y["median"] <= x["range"][1]
        rows.append({"name": name, "a": x, "b": y, "difference": round(x["median"] - y["median"], 4),
                     "agree": agree})
    best = [(p.get("best_static"), q.get("best_static"))
            for p, q in zip(a["ratios"]["per_phase"], b["ratios"]["per_phase"])]
    met = {k: (a["ratios"][k].get("met"), b["ratios"][k].get("met"))
           for k in a["ratios"] if isinstance(a["ratios"][k], dict) and k in b["ratios"]
           and isinstance(b["ratios"][k], dict) and "met" in a["ratios"][k]}
    return {"ratios": rows, "agree": all(r["agree"] for r in rows),
            "agreeing": sum(r["agree"] for r in rows), "compared": len(rows),
            "best_static": [{"phase": i, "a": p, "b": q, "same": p == q} for i, (p, q) in enumerate(best)],
            "targets": {k: {"a": v[0], "b": v[1], "same": v[0] == v[1]} for k, v in met.items()}}


def table(result: dict[str, Any], a_name: str, b_name: str) -> str:
    """The comparison as text: one line per ratio, then the verdict."""
    def span(r: dict[str, Any]) -> str:
        n = len(r["rounds"])
        return f"{r['median']:.3f} [{r['range'][0]:.3f}-{r['range'][1]:.3f}, {n} round{'s' * (n > 1)}]"
    lines = [f"{'ratio':26s} {'A: ' + a_name:>34s}   {'B: ' + b_name:>34s}  agree"]
    for r in result["ratios"]:
        verdict = "yes" if r["agree"] else "NO"
        lines.append(f"{r['name']:26s} {span(r['a']):>34s}   {span(r['b']):>34s}  {verdict}")
    for p in result["best_static"]:
        if not p["same"]:
            lines.append(f"phase {p['phase']}: best static policy {p['a']} in A, {p['b']} in B")
    lines.append(f"{result['agreeing']} of {result['compared']} ratios agree within the runs' "
                 f"round-to-round ranges" + ("" if result["agree"] else " (not all)"))
    return "\n".join(lines)


def run_compare(a_path: str, b_path: str, out: str | None = None) -> dict[str, Any]:
    """Compare two result files, print the table, write the JSON to `out` when given."""
    result = compare(load(a_path), load(b_path))
    result = {"a": a_path, "b": b_path, **result}
    print(table(result, a_path.rsplit("/", 1)[-1], b_path.rsplit("/", 1)[-1]))
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    return result
