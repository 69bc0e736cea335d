"""The summary of `crossover bench crossover`'s runs: the tally of one run (goodput, acceptance per
draft position), and per workload kind the plain and each technique's goodput by batch and depth,
its best depth per batch and the crossover.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tally:
    """Counted steps of one or more runs."""

    tokens: int = 0
    """Output tokens delivered (one per sequence plus the accepted drafts its request kept)."""
    ms: float = 0.0
    steps: int = 0
    seq_steps: int = 0
    """Sum of batch sizes over counted steps."""
    drafting_steps: int = 0
    """Counted steps in which some sequence drafted."""
    proposed: int = 0
    per_pos: list[int] = field(default_factory=list)
    propose_ms: float = 0.0
    runs: int = 0
    preempted: int = 0

    def add(self, st) -> None:
        self.tokens += st.decode_tokens
        self.ms += st.step_ms
        self.steps += 1
        self.seq_steps += st.batch_size
        self.drafting_steps += st.technique != "none"
        self.proposed += st.proposed
        self.propose_ms += st.propose_ms
        self.per_pos += [0] * (len(st.accepted_per_pos) - len(self.per_pos))
        for i, a in enumerate(st.accepted_per_pos):
            self.per_pos[i] += a

    def merge(self, other: Tally) -> None:
        for name in ("tokens", "ms", "steps", "seq_steps", "drafting_steps", "proposed", "propose_ms", "runs",
                     "preempted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.per_pos += [0] * (len(other.per_pos) - len(self.per_pos))
        for i, a in enumerate(other.per_pos):
            self.per_pos[i] += a

    @property
    def goodput(self) -> float | None:
        return self.tokens / (self.ms / 1e3) if self.ms > 0 else None

    def acceptance(self) -> dict:
        n = self.seq_steps
        cond = [(a / prev if prev else None) for a, prev in zip(self.per_pos, [n, *self.per_pos])]
        return {"per_pos": [a / n if n else 0.0 for a in self.per_pos], "conditional_per_pos": cond,
                "tokens_per_seq_step": self.tokens / n if n else None,
                "drafting_step_share": self.drafting_steps / self.steps if self.steps else None}

    def summary(self) -> dict:
        return {"goodput": self.goodput, "step_ms": self.ms / self.steps if self.steps else None,
                "steps": self.steps, "tokens": self.tokens, "runs": self.runs, "preempted": self.preempted,
                "propose_ms_per_step": self.propose_ms / self.steps if self.steps else None}


def _best(values: dict[int, float | None]) -> tuple[int, float | None]:
    """(depth, goodput) of the highest goodput; (0, None) when none was measured."""
    known = [(g, -d) for d, g in values.items() if g is not None]
    if not known:
        return 0, None
    g, d = max(known)
    return -d, g


def crossover(plain: dict[int, float | None], best: dict[int, float | None]) -> int:
    """Largest batch where the technique's best goodput beats plain's (0: none).

    Example: crossover({1: 10, 4: 30, 16: 80}, {1: 15, 4: 33, 16: 70}) == 4.
    """
    wins = [b for b, g in best.items() if g is not None and plain.get(b) is not None and g > plain[b]]
    return max(wins, default=0)


def pool_sets(rows: list[dict]) -> list[dict]:
    """One row per (technique, depth, batch): the tallies of every prompt set merged (plain runs
    stay separate rows; the summary pools them anyway)."""
    out: list[dict] = []
    index: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kind"], r["technique"], r["depth"], r["batch"])
        if r["technique"] == "none":
            out.append(r)
        elif key in index:
            index[key]["tally"].merge(r["tally"])
        else:
            pooled = Tally()
            pooled.merge(r["tally"])
            index[key] = {**r, "tally": pooled}
            out.append(index[key])
    return out


def summarize_kind(rows: list[dict], techniques, depths) -> dict:
    plain_t: dict[int, Tally] = {}
    for r in rows:
        if r["technique"] == "none":
            plain_t.setdefault(r["batch"], Tally()).merge(r["tally"])
    plain = {b: t.goodput for b, t in plain_t.items()}
    out = {"plain": [{"batch": b, **t.summary()} for b, t in sorted(plain_t.items())], "techniques": {}}
    for tech in techniques:
        runs = [r for r in rows if r["technique"] == tech]
        by_depth, pooled = {}, {}
        for r in runs:
            s = {"batch": r["batch"], **r["tally"].summary(), **r["tally"].acceptance()}
            s["speedup"] = _ratio(s["goodput"], plain.get(r["batch"]))
            by_depth.setdefault(r["depth"], []).append(s)
            pooled.setdefault(r["depth"], Tally()).merge(r["tally"])
        best = []
        for b in sorted(plain):
            d, g = _best({r["depth"]: r["tally"].goodput for r in runs if r["batch"] == b})
            best.append({"batch": b, "depth": d, "goodput": g, "speedup": _ratio(g, plain[b])})
        out["techniques"][tech] = {
            "depths": {str(d): by_depth.get(d, []) for d in depths[tech]},
            "acceptance": {str(d): t.acceptance() for d, t in sorted(pooled.items())},
            "best": best,
            "crossover": crossover(plain, {x["batch"]: x["goodput"] for x in best}),
        }
    out["speedup_batch1"] = _speedup_smallest(out)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _speedup_smallest(kind: dict) -> dict | None:
    """The best technique at the smallest batch measured (batch 1 by default) over plain."""
    if not kind["plain"]:
        return None
    b, plain = kind["plain"][0]["batch"], kind["plain"][0]["goodput"]
    cands = [(x["speedup"], t, x["depth"]) for t, v in kind["techniques"].items()
             for x in v["best"] if x["batch"] == b and x["speedup"] is not None]
    if not cands:
        return None
    s, t, d = max(cands)
    return {"batch": b, "technique": t, "depth": d, "speedup": s, "plain_goodput": plain}


def progress_line(kind: str, b: int, rows: list[dict]) -> str:
    mine = [r for r in rows if r["batch"] == b]
    plain = Tally()
    for r in mine:
        if r["technique"] == "none":
            plain.merge(r["tally"])
    parts = [f"{kind:5s} B={b:3d}: plain {plain.goodput or 0:8.1f} tok/s"]
    for t in dict.fromkeys(r["technique"] for r in mine if r["technique"] != "none"):
        d, g = _best({r["depth"]: r["tally"].goodput for r in mine if r["technique"] == t})
        parts.append(f"{t} {(_ratio(g, plain.goodput) or 0):.2f}x@{d}")
    return " | ".join(parts)
