"""Q3 measured end to end: runs of one queue of requests under each technique and pool split.

The runs are the steps of the report's pool instance (`crossover bench findings` writes them),
one policy version per run; each version's split comes from its stored policy (`xo_policies`).
Per run: the pages tenants could hold (median `kv_pages_used + kv_pages_free`), the pages lent
against plain decoding's run, the most sequences that ran at once, and the throughput over
every step (prefill included, so a smaller pool's queueing shows) with its 95% interval.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.report.data import PoolRun, Telemetry
from bench.report.stats import Interval, quotient_ci, ratio_ci

POOL_SOURCE = ("`xo_steps` rows of instance `{inst}` grouped by `policy_version` (`SELECT policy_version, "
               "technique, depth, batch_size, decode_tokens, step_ms, kv_pages_used, kv_pages_free FROM "
               "xo_steps WHERE instance = '{inst}'`) and each version's `pool_split` from `xo_policies.body` "
               "(store.history.policy_history), bench/report/data.py")


def plain_run(t: Telemetry) -> PoolRun | None:
    """The earliest pool run that never speculated and lent nothing: the baseline."""
    runs = [r for r in t.pool_runs.values() if r.technique == "none" and not r.pool_split]
    return min(runs, key=lambda r: r.version) if runs else None


def pool_rows(t: Telemetry) -> list[dict]:
    """One dict per run, in version order: label, pages, lent, peak batch, throughput, ratio."""
    base = plain_run(t)
    base_pages = statistics.median(base.tenant_pages) if base else None
    base_ci = ratio_ci(base.goodput) if base else None
    rows = []
    for v in sorted(t.pool_runs):
        r = t.pool_runs[v]
        pages = statistics.median(r.tenant_pages)
        ci = ratio_ci(r.goodput)
        rows.append({"run": r, "label": f"{r.technique}@{r.depth} split "
                                        f"{r.pool_split if r.pool_split is not None else '?'}",
                     "pages": pages, "lent": (base_pages - pages) if base_pages is not None else None,
                     "lent_share": ((base_pages - pages) / base_pages) if base_pages else None,
                     "throughput": ci,
                     "ratio": quotient_ci(ci, base_ci) if ci and base_ci and r is not base else None})
    return rows


def _fmt(ci: Interval | None, digits: int = 1) -> str:
    return "n/a" if ci is None else f"{ci.value:.{digits}f} [{ci.low:.{digits}f}, {ci.high:.{digits}f}]"


def section(t: Telemetry, out: Path) -> list[str]:
    """Markdown for the pool runs (nothing when the report has no pool instance)."""
    if t.pool_instance is None:
        return []
    lines = ["### Measured end to end: one queue under each technique and pool split (instance "
             f"`{t.pool_instance}`)",
             ""]
    if not t.pool_runs:
        return lines + [f"**No data:** no step of instance `{t.pool_instance}` in `xo_steps`.", ""]
    rows = pool_rows(t)
    lines += [("Every run serves the same requests, all queued at once; whether the pool or the engine's max "
              "batch capped how many ran together shows in *peak batch*. "
              "*Tenant pages*: median `kv_pages_used + kv_pages_free` of the run's steps, the pages tenants "
              "could hold under its split; *lent*: plain decoding's tenant pages minus the run's. *Peak "
              "batch*: the most sequences that ran in one step. *Throughput*: Σ decode_tokens / Σ step_ms "
              "over every step of the run, prefill included (95% delta-method interval); *vs plain*: over "
              "the plain run's."), "",
              ("| policy version | technique@depth | pool split | tenant pages | lent | peak batch | mean "
               "batch | steps | throughput tok/s | vs plain |"),
               "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        r: PoolRun = row["run"]
        lent = "-" if row["lent"] is None else f"{row['lent']:g} ({row['lent_share']:.0%})"
        split = "?" if r.pool_split is None else f"{r.pool_split:g}"
        lines.append(f"| {r.version} | {r.technique}@{r.depth} | {split} | {row['pages']:g} | {lent} | "
                     f"{r.peak_batch} | {r.batch_sum / r.steps:.1f} | {r.steps} | {_fmt(row['throughput'])} "
                     f"| {_fmt(row['ratio'], 2) if row['ratio'] else '-'} |")
    lines += ["", "Source: " + POOL_SOURCE.format(inst=t.pool_instance) + ".", ""]
    name = pool_figure(rows, out)
    if name:
        lines += [f"![throughput against pages lent]({name})", ""]
    return lines


def pool_figure(rows: list[dict], out: Path) -> str | None:
    """Left: throughput (95% CI) per run against the pages it lent; right: peak batch per run."""
    from bench.report.figures import _errorbar, _panels, _save, _tech_color

    shown = [r for r in rows if r["throughput"] is not None and r["lent"] is not None]
    if not shown:
        return None
    fig, (left, right) = _panels(2, size=(5.4, 3.8))
    techs = list(dict.fromkeys(r["run"].technique for r in shown))
    for i, tech in enumerate(techs):
        mine = [r for r in shown if r["run"].technique == tech]
        _errorbar(left, [r["lent"] for r in mine], [r["throughput"] for r in mine],
                  color=_tech_color(tech, i),
                  label="plain decoding" if tech == "none" else tech,
                  linestyle="-" if len(mine) > 1 else "none")
    left.set_xlabel("tenant pages lent to speculation (vs plain)")
    left.set_ylabel("throughput, tokens / s of step time (95% CI)")
    left.set_title("one queue of requests: throughput vs pages lent", fontsize=9)
    left.set_ylim(bottom=0)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    xs = range(len(shown))
    right.bar(xs, [r["run"].peak_batch for r in shown],
              color=[_tech_color(r["run"].technique, techs.index(r["run"].technique)) for r in shown])
    right.set_xticks(list(xs), [r["label"].replace(" split ", "\n") for r in shown], fontsize=6, rotation=45)
    right.set_ylabel("most sequences in one step")
    right.set_title("tenants running at once", fontsize=9)
    right.grid(True, axis="y", alpha=0.3)
    return _save(fig, out, "q3_pool.png")
