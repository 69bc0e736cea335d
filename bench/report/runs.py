"""Runs of `crossover bench findings` as the report reads them back: one row per policy version.

1. Instance names carry what the steps do not: `findings-c{context}-r{round}` (Q2), `findings-pool-r{round}`
   (Q3), `findings-tenants` / `findings-tenants-sampled` (Q1). `q2_instance`, `pool_instance` and
   `tenant_instance` spell them; `parse_instance` reads them back.
2. `read_runs` aggregates `xo_steps` per (instance, policy version) in SQL (decode-only goodput sums, all
   steps' sums, peak batch, tenant pages, prefix-cache hits), reads each version's technique, depth and
   pool split from `xo_policies`, and counts each run's requests from `xo_requests` (request ids start
   `v{version}-`).
3. `read_sequences` lists the Q1 instances' requests with their drafts proposed and accepted, for
   intervals that resample whole sequences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Engine, case, func, select

from store.models import Policy, Request, Step

Q2_BASE, POOL_BASE, TENANT_BASE = "findings", "findings-pool", "findings-tenants"
SAMPLED = "sampled"
_ROUND = re.compile(r"^(?P<base>.+?)(?:-c(?P<context>\d+))?-r(?P<round>\d+)$")


def q2_instance(base: str, context: int, round_: int) -> str:
    """The Q2 instance of one context and round.

    >>> q2_instance("findings", 2048, 3)
    'findings-c2048-r3'
    """
    return f"{base}-c{context}-r{round_}"


def pool_instance(base: str, round_: int) -> str:
    return f"{base}-r{round_}"


def tenant_instance(base: str, sampling: str) -> str:
    """The Q1 instance of a sampling mode: greedy keeps the base name."""
    return base if sampling == "greedy" else f"{base}-{sampling}"


def parse_instance(name: str) -> tuple[str, int | None, int] | None:
    """(base, context or None, round) of a round instance, None for any other name.

    >>> parse_instance("findings-c512-r2"), parse_instance("findings-pool-r1"), parse_instance("findings")
    (('findings', 512, 2), ('findings-pool', None, 1), None)
    """
    m = _ROUND.match(name)
    if m is None:
        return None
    return m["base"], int(m["context"]) if m["context"] else None, int(m["round"])


@dataclass
class RunStats:
    """One policy version's steps (a batch of requests under one policy)."""

    instance: str
    version: int
    technique: str = "none"
    depth: int = 0
    split: float = 0.0
    requests: int = 0
    steps: int = 0
    peak_batch: int = 0
    decode_steps: int = 0
    decode_tokens: float = 0.0
    """Tokens delivered by decode-only steps (no prefill tokens)."""
    decode_s: float = 0.0
    tokens: float = 0.0
    """Tokens delivered by every step."""
    seconds: float = 0.0
    pages_min: int = 0
    pages_max: int = 0
    """Fewest / most tenant pages (kv_pages_used + kv_pages_free) a step saw."""
    prefix_hit: int = 0
    prefix_query: int = 0
    sampled_rows: int = 0

    @property
    def goodput(self) -> float | None:
        """Decode-only tokens per second of step time."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def throughput(self) -> float | None:
        """Every step's tokens per second of step time (prefill included)."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def step_ms(self) -> float | None:
        """Mean decode-only step time."""
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else None

    @property
    def where(self) -> tuple[str, int | None, int] | None:
        return parse_instance(self.instance)


def read_runs(engine: Engine, instances: set[str] | None = None) -> list[RunStats]:
    """Every run of the round instances (or of `instances`), ordered by policy version."""
    from store.db import session_scope

    decode = Step.prefill_tokens == 0
    pages = Step.kv_pages_used + Step.kv_pages_free
    cols = (Step.instance, Step.policy_version, func.count(), func.max(Step.batch_size),
            func.sum(case((decode, 1), else_=0)), func.sum(case((decode, Step.decode_tokens), else_=0)),
            func.sum(case((decode, Step.step_ms), else_=0.0)), func.sum(Step.decode_tokens),
            func.sum(Step.step_ms), func.min(pages), func.max(pages), func.sum(Step.prefix_hit_tokens),
            func.sum(Step.prefix_query_tokens), func.sum(Step.sampled_rows))
    runs: dict[tuple[str, int], RunStats] = {}
    with session_scope(engine) as session:
        for row in session.execute(select(*cols).group_by(Step.instance, Step.policy_version)):
            inst, version = str(row[0]), int(row[1])
            if not _wanted(inst, instances):
                continue
            r = RunStats(inst, version)
            (r.steps, r.peak_batch, r.decode_steps, r.decode_tokens, ms, r.tokens, all_ms, r.pages_min,
             r.pages_max, r.prefix_hit, r.prefix_query, r.sampled_rows) = (int(x or 0) if i not in (4, 6)
                                                                           else float(x or 0)
                                                                           for i, x in enumerate(row[2:]))
            r.decode_s, r.seconds = ms / 1000, all_ms / 1000
            runs[(inst, version)] = r
        for inst, version, body in session.execute(select(Policy.instance, Policy.version, Policy.body)):
            r = runs.get((str(inst), int(version)))
            if r is not None and isinstance(body, dict):
                rules = body.get("rules") or []
                r.split = float(body.get("pool_split", 0.0) or 0.0)
                if rules:
                    rule = rules[0]
                    r.technique, r.depth = str(rule.get("technique", "none")), int(rule.get("depth", 0))
        names = {inst for inst, _ in runs}
        if names:
            for inst, rid in session.execute(select(Request.instance, Request.request_id)
                                             .where(Request.instance.in_(names))):
                r = runs.get((str(inst), _version_of(rid)))
                if r is not None:
                    r.requests += 1
    return sorted(runs.values(), key=lambda r: r.version)


def _wanted(instance: str, instances: set[str] | None) -> bool:
    return instance in instances if instances is not None else parse_instance(instance) is not None


def _version_of(request_id: str) -> int:
    """The policy version a findings request ran under (its id is `v{version}-{i}`; -1 otherwise)."""
    head = str(request_id).split("-", 1)[0]
    return int(head[1:]) if head.startswith("v") and head[1:].isdigit() else -1


@dataclass(frozen=True)
class Sequence:
    """One finished request of a Q1 instance."""

    instance: str
    version: int
    tenant: str
    proposed: int
    accepted: int


def read_sequences(engine: Engine, instances: tuple[str, ...]) -> list[Sequence]:
    """The requests of `instances` that proposed drafts, in request-id order."""
    from store.db import session_scope

    query = (select(Request.instance, Request.request_id, Request.tenant, Request.proposed_tokens,
                    Request.accepted_tokens)
             .where(Request.instance.in_(instances), Request.proposed_tokens > 0)
             .order_by(Request.instance, Request.id))
    with session_scope(engine) as session:
        return [Sequence(str(i), _version_of(rid), str(t), int(p), int(a))
                for i, rid, t, p, a in session.execute(query)]
