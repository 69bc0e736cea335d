"""Q3 from rounds: tenants displaced against goodput gained, each resident proposer against plain decoding.

1. The runs of the `findings-pool-r{round}` instances (bench/report/runs.py): in each round one queue of
   requests, more than the pool holds, ran under plain decoding on an engine that loaded no proposer and
   under each resident proposer on an engine that loaded it alone (the same memory budget), the prefix
   cache emptied before each.
2. Per run label (technique, depth, split) and round: tenants displaced = plain's most sequences at once
   minus the run's; pages lent = plain's tenant pages minus the run's; gain = the run's throughput (every
   step's delivered tokens over step time, prefill included) over plain's in the same round.
3. Intervals resample whole rounds (stats.bootstrap); the verdict says whether the gain's interval lies
   above 1 and what it costs in tenants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.report import figures
from bench.report.runs import POOL_BASE, RunStats
from bench.report.stats import Interval, bootstrap, geomean

PLAIN = "none"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class Row:
    """One run label over rounds."""

    label: str
    technique: str
    gains: dict[int, float] = field(default_factory=dict)
    displaced: dict[int, float] = field(default_factory=dict)
    lent: dict[int, float] = field(default_factory=dict)
    hit_rate: list[float] = field(default_factory=list)

    def gain_ci(self) -> Interval | None:
        return bootstrap(list(self.gains.values()), geomean)

    def displaced_ci(self) -> Interval | None:
        return bootstrap(list(self.displaced.values()), _mean)

    def lent_ci(self) -> Interval | None:
        return bootstrap(list(self.lent.values()), _mean)


@dataclass
class Q3Rounds:
    rounds: int = 0
    plain: dict[int, RunStats] = field(default_factory=dict)
    """Round -> plain decoding's run."""
    rows: dict[str, Row] = field(default_factory=dict)

    @property
    def queue_exceeds_pool(self) -> bool:
        """Every plain run held fewer sequences at once than it was given."""
        return bool(self.plain) and all(r.peak_batch < r.requests for r in self.plain.values())


def label(r: RunStats) -> str:
    return f"{r.technique}@{r.depth}" + (f" split {r.split:g}" if r.split else "")


def analyse(runs: list[RunStats]) -> Q3Rounds:
    q = Q3Rounds()
    by_round: dict[int, list[RunStats]] = {}
    for r in runs:
        where = r.where
        if where is not None and where[0] == POOL_BASE and where[1] is None:
            by_round.setdefault(where[2], []).append(r)
    for rnd, members in sorted(by_round.items()):
        plain = next((r for r in members if r.technique == PLAIN and r.throughput), None)
        if plain is None:
            continue
        q.plain[rnd] = plain
        for r in members:
            if r is plain or not r.throughput:
                continue
            row = q.rows.setdefault(label(r), Row(label(r), r.technique))
            row.gains[rnd] = r.throughput / plain.throughput
            row.displaced[rnd] = plain.peak_batch - r.peak_batch
            row.lent[rnd] = plain.pages_max - r.pages_max
            if r.prefix_query:
                row.hit_rate.append(r.prefix_hit / r.prefix_query)
    q.rounds = len(q.plain)
    return q


def verdict(row: Row) -> str:
    g, d = row.gain_ci(), row.displaced_ci()
    if g is None or d is None:
        return f"{row.label}: fewer than 2 rounds, no interval"
    word = ("pays for its memory" if g.low > 1 else "costs more than it gains" if g.high < 1
            else "is not distinguishable from plain decoding")
    return (f"{row.label} displaces {d.value:.1f} [{d.low:.1f}, {d.high:.1f}] tenants and delivers "
            f"{g.value:.2f}x [{g.low:.2f}, {g.high:.2f}] plain decoding's throughput: it {word}")


def section(q: Q3Rounds, out: Path) -> list[str]:
    lines = ["### Measured in rounds: tenants displaced against goodput gained", ""]
    if not q.plain:
        return lines + [("**Not measured by this database's run:** no `findings-pool-r{round}` instances, "
                         "i.e. no rounds in which plain decoding ran without speculation's resident memory "
                         "and the prefix cache was emptied before every run; the per-run table below kept "
                         "every proposer loaded for plain decoding too."), ""]
    plain = list(q.plain.values())
    hits = [r.prefix_hit / r.prefix_query for r in plain if r.prefix_query]
    lines += [(f"{q.rounds} rounds; in each, one queue of {plain[0].requests} requests ran under plain "
               "decoding (an engine with no proposer loaded, so speculation's resident bytes are KV pages) "
               "and under each resident proposer (an engine with that proposer alone, the same budget), the "
               "prefix cache emptied before every run. Plain decoding ran at most "
               f"{min(r.peak_batch for r in plain)}-{max(r.peak_batch for r in plain)} sequences at once in "
               f"{min(r.pages_max for r in plain)}-{max(r.pages_max for r in plain)} tenant pages: the queue "
               + ("exceeded the pool in every round" if q.queue_exceeds_pool else
                  "did NOT exceed the pool in every round (the comparison does not bind)")
               + (f"; its prefix-cache hit rate {min(hits):.0%}-{max(hits):.0%}" if hits else "") + ". "
               "Tenants displaced: plain's most sequences at once minus the run's; gain: throughput (every "
               "step, prefill included) over plain's in the same round; 95% intervals resample rounds."), "",
              "| run | tenants displaced | pages lent | throughput / plain | prefix hit rate | verdict |",
              "|---|---|---|---|---:|---|"]
    for row in q.rows.values():
        d, p, g = row.displaced_ci(), row.lent_ci(), row.gain_ci()
        hit = _mean(row.hit_rate)
        lines.append(f"| {row.label} | {_ci(d, 1)} | {_ci(p, 0)} | {_ci(g, 2)} | "
                     f"{'-' if hit is None else f'{hit:.0%}'} | {verdict(row).split(': it ')[-1]} |")
    lines += ["", ("Source: `xo_steps` summed per (instance, policy_version) of the `findings-pool-r{round}` "
                   "instances: `max(batch_size)`, `max(kv_pages_used + kv_pages_free)`, "
                   "`sum(decode_tokens) / sum(step_ms)`, "
                   "`sum(prefix_hit_tokens) / sum(prefix_query_tokens)`; technique, depth and split from "
                   "`xo_policies` (bench/report/runs.py)."), ""]
    lines += figures.embed(rounds_figure(q, out), "tenants displaced and throughput gained, in rounds")
    return lines


def _ci(ci: Interval | None, digits: int) -> str:
    return "n/a" if ci is None else f"{ci.value:.{digits}f} [{ci.low:.{digits}f}, {ci.high:.{digits}f}]"


def rounds_figure(q: Q3Rounds, out: Path) -> str | None:
    """Left: tenants displaced per run label; right: throughput over plain; bars with 95% CIs."""
    from bench.report.figures import _panels, _save, _tech_color

    rows = [r for r in q.rows.values() if r.gain_ci() and r.displaced_ci()]
    if not rows:
        return None
    fig, (left, right) = _panels(2, size=(4.6, 3.6))
    xs = list(range(len(rows)))
    colors = [_tech_color(r.technique, i) for i, r in enumerate(rows)]
    for ax, cis, title in ((left, [r.displaced_ci() for r in rows], "tenants displaced (sequences at once)"),
                           (right, [r.gain_ci() for r in rows], "throughput / plain decoding")):
        ax.bar(xs, [c.value for c in cis], color=colors, capsize=4,
               yerr=[[c.value - c.low for c in cis], [c.high - c.value for c in cis]])
        ax.set_xticks(xs, [r.label.replace(" split ", "\nsplit ") for r in rows], fontsize=7)
        ax.set_title(title + " (95% CI)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    right.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("tenants")
    right.set_ylabel("ratio")
    return _save(fig, out, "q3_rounds.png")
