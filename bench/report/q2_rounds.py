"""Q2 from rounds: speculation over plain decoding formed within each round, intervals over rounds.

1. The runs of the `findings-c{context}-r{round}` instances (bench/report/runs.py) are grouped by
   (context, round, batch), the batch being the requests a run submitted. The group's plain runs (one
   before its techniques, one after) pool into its plain goodput; each technique's goodput at each depth
   over it is that round's ratio.
2. Per (context, batch, technique) the best depth is the one with the highest geometric mean ratio over
   rounds; its interval resamples whole rounds (stats.bootstrap).
3. Per (context, technique) the crossover is where the best-depth curve crosses 1 (interpolated in log
   batch between the two measured batches around the crossing); its interval resamples rounds jointly
   for every batch. Per context, where plain decoding turns compute-bound: the batch at which a fitted
   step time a + c x batch has c x batch = a.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import figures
from bench.report.runs import Q2_BASE, RunStats
from bench.report.stats import Interval, bootstrap, geomean

PLAIN = "none"


@dataclass
class Cell:
    """One (context, batch, technique): the best depth's ratios over plain, one per round."""

    depth: int
    ratios: dict[int, float]
    """Round -> goodput ratio over plain decoding in that round."""
    ci: Interval | None
    depths: dict[int, float] = field(default_factory=dict)
    """Depth -> geometric mean ratio (every depth measured)."""


@dataclass
class Q2Rounds:
    """Everything the rounds section, the summary and the verdict table read."""

    rounds: int = 0
    plain: dict[tuple[int, int], dict[int, RunStats]] = field(default_factory=dict)
    """(context, batch) -> round -> plain decoding's runs pooled (tokens and seconds summed)."""
    drift: dict[tuple[int, int], float] = field(default_factory=dict)
    """(context, batch) -> largest goodput ratio between a group's two plain runs, over rounds."""
    cells: dict[tuple[int, str], dict[int, Cell]] = field(default_factory=dict)
    """(context, technique) -> batch -> its cell."""
    crossover: dict[tuple[int, str], Interval | None] = field(default_factory=dict)
    knee: dict[int, Interval | None] = field(default_factory=dict)

    @property
    def contexts(self) -> list[int]:
        return sorted({c for c, _ in self.plain})

    @property
    def techniques(self) -> list[str]:
        return sorted({t for _, t in self.cells})


def _pool(runs: list[RunStats]) -> RunStats:
    out = RunStats(runs[0].instance, runs[0].version)
    for r in runs:
        out.decode_tokens += r.decode_tokens
        out.decode_s += r.decode_s
        out.decode_steps += r.decode_steps
    return out


def analyse(runs: list[RunStats]) -> Q2Rounds:
    q = Q2Rounds()
    groups: dict[tuple[int, int, int], list[RunStats]] = {}
    for r in runs:
        where = r.where
        if where is None or where[0] != Q2_BASE or where[1] is None or not r.requests:
            continue
        groups.setdefault((where[1], r.requests, where[2]), []).append(r)
    ratios: dict[tuple[int, int, str, int], dict[int, float]] = {}
    for (ctx, batch, rnd), members in groups.items():
        plain = [r for r in members if r.technique == PLAIN and r.goodput]
        if not plain:
            continue
        base = _pool(plain)
        q.plain.setdefault((ctx, batch), {})[rnd] = base
        rates = [r.goodput for r in plain]
        q.drift[(ctx, batch)] = max(q.drift.get((ctx, batch), 1.0), max(rates) / min(rates))
        for r in members:
            if r.technique != PLAIN and r.goodput:
                ratios.setdefault((ctx, batch, r.technique, r.depth), {})[rnd] = r.goodput / base.goodput
    q.rounds = len({rnd for per in q.plain.values() for rnd in per})
    for (ctx, batch, tech, depth), per in ratios.items():
        q.cells.setdefault((ctx, tech), {}).setdefault(batch, Cell(0, {}, None)).depths[depth] = geomean(
            list(per.values())) or 0.0
    for (ctx, tech), by_batch in q.cells.items():
        for batch, cell in by_batch.items():
            cell.depth = max(cell.depths, key=lambda d: (cell.depths[d], -d))
            cell.ratios = ratios[(ctx, batch, tech, cell.depth)]
            cell.ci = bootstrap(list(cell.ratios.values()), geomean)
        q.crossover[(ctx, tech)] = _crossover_ci(by_batch)
    for ctx in q.contexts:
        q.knee[ctx] = _knee_ci({b: per for (c, b), per in q.plain.items() if c == ctx})
    return q


def crossing(curve: dict[int, float]) -> float | None:
    """The batch where a ratio curve first drops below 1, interpolated in log batch; the smallest batch
    when it starts below 1, math.inf when it never does.

    >>> crossing({1: 2.0, 4: 2.0, 16: 0.5}), crossing({1: 0.9, 2: 0.8}), crossing({1: 1.1})
    (8.0, 1, inf)
    """
    pts = sorted(curve.items())
    if not pts:
        return None
    if pts[0][1] < 1:
        return pts[0][0]
    for (b0, r0), (b1, r1) in itertools.pairwise(pts):
        if r1 < 1 <= r0:
            frac = math.log(r0) / (math.log(r0) - math.log(r1))
            return 2 ** (math.log2(b0) + frac * (math.log2(b1) - math.log2(b0)))
    return math.inf


def _crossover_ci(by_batch: dict[int, Cell]) -> Interval | None:
    rounds = sorted(set.intersection(*(set(c.ratios) for c in by_batch.values()))) if by_batch else []

    def at(chosen: list[int]) -> float | None:
        return crossing({b: geomean([c.ratios[r] for r in chosen]) or 0.0 for b, c in by_batch.items()})

    return bootstrap(rounds, at) if len(rounds) > 1 else None


def _knee_ci(plain: dict[int, dict[int, RunStats]]) -> Interval | None:
    rounds = sorted(set.intersection(*(set(p) for p in plain.values()))) if plain else []

    def knee(chosen: list[int]) -> float | None:
        pts = [(b, sum(per[r].step_ms or 0.0 for r in chosen) / len(chosen)) for b, per in plain.items()]
        if len(pts) < 2:
            return None
        mb, my = sum(b for b, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        sxx = sum((b - mb) ** 2 for b, _ in pts)
        slope = sum((b - mb) * (y - my) for b, y in pts) / sxx if sxx else 0.0
        intercept = my - slope * mb
        return intercept / slope if slope > 0 and intercept > 0 else math.inf

    return bootstrap(rounds, knee) if len(rounds) > 1 else None


def fmt_batch(ci: Interval | None) -> str:
    """'B=8.2 [4.1, 16]' with open ends spelled out; 'n/a' without an interval."""
    if ci is None:
        return "n/a"

    def one(x: float) -> str:
        return "never" if math.isinf(x) else f"{x:.3g}"

    return f"B={one(ci.value)} [{one(ci.low)}, {one(ci.high)}]"


def verdict(q: Q2Rounds, tech: str) -> str:
    """One phrase per context: where `tech` at its best depth stops paying."""
    parts = []
    for ctx in q.contexts:
        cells = q.cells.get((ctx, tech), {})
        if not cells:
            continue
        top = max(cells)
        ci = q.crossover.get((ctx, tech))
        pays = [b for b, c in sorted(cells.items()) if c.ci and c.ci.low > 1]
        loses = [b for b, c in sorted(cells.items()) if c.ci and c.ci.high < 1]
        where = (f"crossover {fmt_batch(ci)}" if ci and not math.isinf(ci.value)
                 else f"no crossover up to B={top}" + (f" ({fmt_batch(ci)})" if ci else ""))
        parts.append(f"context {ctx}: {where}; pays at {_batches(pays)}, loses at {_batches(loses)}")
    return "; ".join(parts) or "not measured"


def _batches(xs: list[int]) -> str:
    """'B=1,2', or 'no batch' for none."""
    return "B=" + ",".join(map(str, xs)) if xs else "no batch"


def section(q: Q2Rounds, out: Path) -> list[str]:
    lines = ["### Measured in rounds: speculation over plain decoding, per context", ""]
    if not q.plain:
        return lines + [("**Not measured by this database's run:** no `findings-c{context}-r{round}` "
                         "instances, i.e. no Q2 runs in rounds with plain decoding beside each technique; "
                         "the pooled per-step table below is all there is."), ""]
    lines += [(f"{q.rounds} rounds. In each round, at each (context, batch), plain decoding ran first and "
               "last and every technique at every depth ran between (their order turned each round). A "
               "round's ratio is the technique's decode-only goodput over the pooled plain runs of the same "
               "group; each technique is shown at its best depth (highest geometric mean ratio), and its 95% "
               "interval resamples whole rounds (percentile bootstrap; with 3 rounds about their range; "
               "picking the best depth biases the ratio up slightly). *Plain drift*: the larger goodput "
               "over the smaller of a group's two plain runs, worst round."), "",
              "| context | batch | plain tok/s | plain drift | " + " | ".join(q.techniques) + " |",
              "|---:|---:|---:|---:|" + "---|" * len(q.techniques)]
    for ctx, batch in sorted(q.plain):
        per = q.plain[(ctx, batch)]
        rate = sorted(r.goodput or 0.0 for r in per.values())[len(per) // 2]
        cells = [q.cells.get((ctx, t), {}).get(batch) for t in q.techniques]
        shown = [f"{_ci(c.ci)} @{c.depth}" if c else "-" for c in cells]
        lines.append(f"| {ctx} | {batch} | {rate:.1f} | {q.drift[(ctx, batch)]:.2f} | " + " | ".join(shown)
                     + " |")
    lines += ["", "| technique | context | crossover (95% CI over rounds) | where it stands |",
              "|---|---:|---|---|"]
    for ctx in q.contexts:
        for tech in q.techniques:
            if (ctx, tech) in q.cells:
                lines.append(f"| {tech} | {ctx} | {fmt_batch(q.crossover.get((ctx, tech)))} | "
                             f"{verdict(_only(q, ctx), tech)} |")
    lines += ["", ("Compute-bound from (plain decoding, a + c x batch fitted to its mean decode step time "
                   "per batch; the batch where c x batch = a, 95% CI over rounds): "
                   + "; ".join(f"context {c}: {fmt_batch(q.knee.get(c))}" for c in q.contexts) + "."), "",
              ("Source: `xo_steps` summed per (instance, policy_version), decode-only steps "
               "(prefill_tokens = 0); context and round from the instance name, technique and depth from "
               "`xo_policies.body.rules`, batch from the run's `xo_requests` (bench/report/runs.py)."), ""]
    lines += figures.embed(ratio_figure(q, out), "speculation over plain decoding, per context, in rounds")
    return lines


def _ci(ci: Interval | None) -> str:
    return "n/a" if ci is None else f"{ci.value:.2f} [{ci.low:.2f}, {ci.high:.2f}]"


def _only(q: Q2Rounds, ctx: int) -> Q2Rounds:
    return Q2Rounds(q.rounds, {k: v for k, v in q.plain.items() if k[0] == ctx}, {},
                    {k: v for k, v in q.cells.items() if k[0] == ctx},
                    {k: v for k, v in q.crossover.items() if k[0] == ctx})


def ratio_figure(q: Q2Rounds, out: Path) -> str | None:
    """A panel per context: each technique's best-depth ratio over plain (95% CI) against batch, the
    series offset sideways so no two error bars overlap; the legend below the panels."""
    from bench.report.figures import _errorbar, _log2_batches, _panels, _save, _tech_color

    if not q.cells:
        return None
    fig, axes = _panels(len(q.contexts), size=(5.0, 3.6), cols=3)
    techs = q.techniques
    for ax, ctx in zip(axes, q.contexts):
        batches = sorted({b for (c, _), cells in q.cells.items() if c == ctx for b in cells})
        for i, tech in enumerate(techs):
            cells = q.cells.get((ctx, tech), {})
            xs = [b for b in sorted(cells) if cells[b].ci]
            if xs:
                shift = 2 ** ((i - (len(techs) - 1) / 2) * 0.08)
                _errorbar(ax, [b * shift for b in xs], [cells[b].ci for b in xs], color=_tech_color(tech, i),
                          label=tech if ax is axes[0] else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        knee = q.knee.get(ctx)
        if knee and not math.isinf(knee.value):
            ax.axvspan(max(knee.low, batches[0] / 2), min(knee.high, batches[-1] * 2), color="0.85", zorder=0)
        _log2_batches(ax, batches)
        ax.set_xlim(batches[0] / 1.4, batches[-1] * 1.4)
        ax.set_ylim(bottom=0)
        ax.set_title(f"context {ctx} (grey: plain turns compute-bound)", fontsize=9)
        ax.set_xlabel("batch size (log scale)")
        ax.set_ylabel("goodput / plain, best depth (95% CI)")
        ax.grid(True, alpha=0.3)
    fig.legend(loc="outside lower center", ncols=max(len(techs), 1), fontsize=8)
    return _save(fig, out, "q2_rounds.png")
