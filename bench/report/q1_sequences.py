"""Q1 by sequences: each tenant's acceptance per technique, greedy and sampled, intervals over sequences.

1. The requests of the Q1 instances (`findings-tenants`, greedy; `findings-tenants-sampled`), each with
   its drafts proposed and accepted (bench/report/runs.py `read_sequences`), are tied to their run by the
   policy version in their id, and so to the run's technique; a run whose requests hold several tenants is
   *mixed*, one tenant *alone*.
2. Acceptance = accepted / proposed summed over a tenant's sequences; its 95% interval resamples whole
   sequences (stats.bootstrap), since the drafts of one sequence are not independent of each other.
3. The spread: the best tenant's acceptance over the worst's in the same mixed runs, resampled likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.report import figures
from bench.report.runs import SAMPLED, TENANT_BASE, RunStats, Sequence, tenant_instance
from bench.report.stats import Interval, bootstrap

INSTANCES = {tenant_instance(TENANT_BASE, s): s for s in ("greedy", SAMPLED)}
"""Q1 instance -> its sampling mode."""


def _acceptance(seqs: list[Sequence]) -> float | None:
    proposed = sum(s.proposed for s in seqs)
    return sum(s.accepted for s in seqs) / proposed if proposed else None


def _spread(seqs: list[Sequence]) -> float | None:
    by: dict[str, list[Sequence]] = {}
    for s in seqs:
        by.setdefault(s.tenant, []).append(s)
    rates = [x for x in (_acceptance(v) for v in by.values()) if x is not None]
    return max(rates) / min(rates) if len(rates) > 1 and min(rates) > 0 else None


@dataclass
class Group:
    """One (sampling, technique, batch kind) with its sequences."""

    sequences: list[Sequence] = field(default_factory=list)

    def tenant_ci(self) -> dict[str, Interval | None]:
        tenants = sorted({s.tenant for s in self.sequences})
        return {t: bootstrap([s for s in self.sequences if s.tenant == t], _acceptance) for t in tenants}

    def pooled_ci(self) -> Interval | None:
        return bootstrap(self.sequences, _acceptance)

    def spread_ci(self) -> Interval | None:
        return bootstrap(self.sequences, _spread)


@dataclass
class Q1Sequences:
    groups: dict[tuple[str, str, str], Group] = field(default_factory=dict)
    """(sampling, technique, "mixed" | "alone") -> its sequences."""

    @property
    def samplings(self) -> list[str]:
        return sorted({k[0] for k in self.groups}, key=lambda s: s != "greedy")

    def counts(self, sampling: str) -> dict[str, int]:
        """Tenant -> sequences per technique run (the most of any technique) in `sampling`'s mixed runs."""
        out: dict[str, int] = {}
        for (smp, _, kind), g in self.groups.items():
            if smp == sampling and kind == "mixed":
                for t in {s.tenant for s in g.sequences}:
                    out[t] = max(out.get(t, 0), sum(1 for s in g.sequences if s.tenant == t))
        return out


def analyse(sequences: list[Sequence], runs: list[RunStats]) -> Q1Sequences:
    tech = {r.version: r.technique for r in runs}
    tenants: dict[int, set[str]] = {}
    for s in sequences:
        tenants.setdefault(s.version, set()).add(s.tenant)
    q = Q1Sequences()
    for s in sequences:
        technique = tech.get(s.version)
        if technique is None or technique == "none" or s.instance not in INSTANCES:
            continue
        kind = "mixed" if len(tenants[s.version]) > 1 else "alone"
        q.groups.setdefault((INSTANCES[s.instance], technique, kind), Group()).sequences.append(s)
    return q


def _rate(ci: Interval | None) -> str:
    return "n/a" if ci is None else f"{ci.value:.3f} [{ci.low:.3f}, {ci.high:.3f}]"


def verdict(q: Q1Sequences, technique: str) -> str:
    """Both findings for one technique: batch mates change nothing measurable; tenants differ."""
    parts = []
    for sampling in q.samplings:
        g = q.groups.get((sampling, technique, "mixed"))
        if g is None:
            continue
        cis = {t: c for t, c in g.tenant_ci().items() if c}
        if len(cis) > 1:
            lo, hi = min(cis, key=lambda t: cis[t].value), max(cis, key=lambda t: cis[t].value)
            parts.append(f"{sampling}: tenants range from {lo} {_rate(cis[lo])} to {hi} {_rate(cis[hi])}, "
                         f"a spread of {_rate(g.spread_ci())}x")
        alone = q.groups.get((sampling, technique, "alone"))
        if alone is not None:
            rel = []
            for t, a in alone.tenant_ci().items():
                m = cis.get(t)
                if a and m:
                    rel.append(f"{t} {'differs' if a.high < m.low or a.low > m.high else 'does not differ'}")
            parts.append(f"{sampling} alone against mixed: {', '.join(rel) or 'no tenant in both'}")
    return "; ".join(parts) or "not measured"


def section(q: Q1Sequences, out: Path) -> list[str]:
    lines = ["### Per tenant, by sequence: greedy and sampled", ""]
    if not q.groups:
        return lines + ["**Not measured by this database's run:** no speculating request of a Q1 instance.",
                        ""]
    missing = [s for s in ("greedy", SAMPLED) if s not in q.samplings]
    lines += [("Each tenant's acceptance (drafts accepted / proposed, summed over its requests) in batches "
               "that mixed every tenant, per technique; 95% intervals resample whole sequences, not drafts. "
               "Sequences per tenant and technique: "
               + "; ".join(f"{s}: " + ", ".join(f"{t} {n}" for t, n in sorted(q.counts(s).items()))
                           for s in q.samplings) + "."
               + (f" **Not measured by this database's run:** {', '.join(missing)} decoding." if missing
                  else "")), "",
              "| sampling | technique | batches | tenant | sequences | acceptance (95% CI) |",
              "|---|---|---|---|---:|---|"]
    for (sampling, tech, kind), g in sorted(q.groups.items()):
        for tenant, ci in g.tenant_ci().items():
            n = sum(1 for s in g.sequences if s.tenant == tenant)
            lines.append(f"| {sampling} | {tech} | {kind} | {tenant} | {n} | {_rate(ci)} |")
    lines += ["", *(f"- **{t}**: {verdict(q, t)}." for t in sorted({k[1] for k in q.groups})), "",
              ("Source: `SELECT instance, request_id, tenant, proposed_tokens, accepted_tokens FROM "
               "xo_requests` of the Q1 instances; the run (policy version) from the request id, its "
               "technique from `xo_policies` (bench/report/runs.py)."), ""]
    lines += figures.embed(tenant_figure(q, out), "acceptance per tenant and technique, greedy and sampled")
    return lines


def tenant_figure(q: Q1Sequences, out: Path) -> str | None:
    """A panel per sampling mode: a bar group per technique, a bar per tenant, each with its 95% CI."""
    from bench.report.figures import GROUP_COLORS, _panels, _rgb, _save

    mixed = {k: g for k, g in q.groups.items() if k[2] == "mixed"}
    if not mixed:
        return None
    samplings = [s for s in q.samplings if any(k[0] == s for k in mixed)]
    tenants = sorted({s.tenant for g in mixed.values() for s in g.sequences})
    techs = sorted({k[1] for k in mixed})
    fig, axes = _panels(len(samplings), size=(5.6, 3.8))
    width = 0.8 / len(tenants)
    for ax, sampling in zip(axes, samplings):
        for k, tenant in enumerate(tenants):
            xs, cis = [], []
            for i, tech in enumerate(techs):
                g = mixed.get((sampling, tech, "mixed"))
                ci = g.tenant_ci().get(tenant) if g else None
                if ci:
                    xs.append(i + (k - (len(tenants) - 1) / 2) * width)
                    cis.append(ci)
            color = _rgb(GROUP_COLORS[k % len(GROUP_COLORS)])
            ax.bar(xs, [c.value for c in cis], width=width, capsize=3, color=color,
                   yerr=[[c.value - c.low for c in cis], [c.high - c.value for c in cis]],
                   label=tenant if ax is axes[0] else None)
        ax.set_xticks(range(len(techs)), techs, fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_ylabel("accepted / proposed (95% CI, by sequence)")
        ax.set_title(f"{sampling}: acceptance per tenant, mixed batches", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=len(tenants), fontsize=8)
    return _save(fig, out, "q1_sequences.png")
