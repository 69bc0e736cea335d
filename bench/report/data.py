"""What `crossover report` reads from a telemetry database, in one pass over each table.

1. `open_database` checks the URL (a SQLite file must exist: opening a missing
   one would create it), connects, and insists the schema is at head
   (store.migrate.check_schema); any failure is a `ReportInputError` naming it.
2. `read_telemetry` streams the raw `xo_steps` rows once (columns named in
   STEP_COLUMNS, so columns added later do not matter) and accumulates:
   acceptance per (technique, group, draft position), where the group is the
   one tenant of a single-tenant batch or MIXED — a step that records row
   classes (schema 0009: rows of one step may draft with several techniques
   and depths) counts each class at its own technique and depth, and in a
   several-tenant batch also under its own tenant (`mixed_by_tenant`), so a
   tenant's acceptance in mixed batches is measured directly; decode-only goodput moments
   per (technique, mix, batch size), a step whose rows drafted with several
   techniques counted once under telemetry.rowclasses.MIXED ("mixed"), as
   the telemetry queries time it; KV pool pages per technique.
3. It then streams `xo_requests` once: each request's proposed / accepted
   drafts go to its tenant and to the kind of batches it ran in (alone, mixed
   or both), read off the steps of its instance between its arrival and its
   finish that carried its tenant.

Rollups (`xo_step_rollups`) keep no tenants and no per-step times, so the
report reads raw steps only; `rollup_minutes` says how much older data exists.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import Engine, func, select
from sqlalchemy.engine import make_url

from bench.report.stats import Moments
from store.models import Request, Step, StepRollup
from telemetry.rowclasses import drafts, step_technique

MIXED = "(mixed)"
"""Group of a batch holding several tenants."""
ALL, ALONE = "all", "alone"
"""Tenant mixes goodput is split by (with MIXED): every step, single-tenant steps, several-tenant steps."""
UNNAMED = "(no tenant)"
STEP_COLUMNS = ("instance", "time", "technique", "depth", "batch_size", "prefill_tokens", "decode_tokens",
                "step_ms", "proposed", "accepted", "accepted_per_pos", "tenants", "kv_pages_used",
                "kv_pages_free", "policy_version", "row_classes")


class ReportInputError(ValueError):
    """A bad --db or --out value; the message names it (the CLI exits 2 with it)."""


def shown_url(url: str) -> str:
    """The URL with its password hidden (store.db.shown_url), or as given when it does not parse."""
    from store.db import shown_url as hidden

    try:
        return hidden(url)
    except Exception:  # an unparsable URL is shown as given, minus nothing to hide
        return url


def open_database(url: str) -> Engine:
    """An Engine on a reachable database at the schema head, else ReportInputError."""
    from pathlib import Path

    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from store.db import make_engine, resolve_url
    from store.migrate import SchemaError, check_schema

    shown = shown_url(url)
    try:
        parsed = make_url(resolve_url(url))
    except ArgumentError as exc:
        raise ReportInputError(f"--db {shown!r} is not a database URL ({exc})") from None
    local = parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:")
    if local and not Path(parsed.database).is_file():
        raise ReportInputError(f"--db {shown!r}: database file {parsed.database!r} does not exist")
    try:
        engine = make_engine(url)
        with engine.connect():
            pass
        check_schema(url)
    except SchemaError as exc:
        raise ReportInputError(f"--db {shown!r}: {exc}") from None
    except (SQLAlchemyError, ImportError, OSError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise ReportInputError(f"--db {shown!r}: cannot connect "
                               f"({type(reason).__name__}: {reason})") from None
    return engine


@dataclass
class PositionCounts:
    """Drafts offered and accepted at each draft position."""

    offered: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    proposed: int = 0

    def add(self, depth: int, proposed: int, per_pos: list, steps: int = 1) -> None:
        """Add one unit of drafts; `steps` 0 for a step's second row class under the same key."""
        self.steps += steps
        self.proposed += proposed
        while len(self.offered) < depth:
            self.offered.append(0.0)
            self.accepted.append(0)
        for i in range(depth):  # each speculating row offers one draft per position
            self.offered[i] += proposed / depth
            self.accepted[i] += int(per_pos[i]) if i < len(per_pos) else 0


@dataclass
class RequestCounts:
    requests: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class PoolRun:
    """The steps of one policy version of the pool-split instance (a queue run under one split)."""

    version: int
    technique: str = "none"
    """The technique its speculating steps ran (none if no step speculated)."""
    depth: int = 0
    pool_split: float | None = None
    """From the policy's stored body in `xo_policies` (None: not stored)."""
    steps: int = 0
    batch_sum: int = 0
    peak_batch: int = 0
    tenant_pages: list[int] = field(default_factory=list)
    """kv_pages_used + kv_pages_free of each step: the pages tenants could hold."""
    goodput: Moments = field(default_factory=Moments)
    """(decode tokens, step seconds) of every step, prefill included: the run's throughput."""
    first_time: float | None = None
    last_time: float | None = None


@dataclass
class Telemetry:
    """Everything the report's sections read, accumulated from the database."""

    steps: int = 0
    decode_steps: int = 0
    """Steps counted for goodput: no prefill tokens, positive step time."""
    first_time: float | None = None
    last_time: float | None = None
    instances: set[str] = field(default_factory=set)
    tenants: set[str] = field(default_factory=set)
    techniques: dict[str, int] = field(default_factory=dict)
    """Technique -> steps."""
    acceptance: dict[tuple[str, str], PositionCounts] = field(default_factory=dict)
    """(technique, tenant or MIXED) -> counts per position."""
    depths: dict[str, dict[int, int]] = field(default_factory=dict)
    """Technique -> depth -> speculating steps."""
    goodput: dict[tuple[str, str, int], Moments] = field(default_factory=dict)
    """(technique, mix, batch size) -> (decode tokens, step seconds) moments; the mixes are ALL,
    ALONE, MIXED and "alone: TENANT" for each tenant's single-tenant steps."""
    pool_pages: dict[str, list[int]] = field(default_factory=dict)
    """Technique -> kv_pages_used + kv_pages_free of each step."""
    requests: int = 0
    by_tenant: dict[tuple[str, str], RequestCounts] = field(default_factory=dict)
    """(tenant, "alone" / "mixed" / "both" / "no steps") -> request totals."""
    rollup_minutes: int = 0
    pool_instance: str | None = None
    """The instance whose steps are pool-split runs (left out of everything above)."""
    tenant_instance: str | None = None
    """The instance whose steps Q1 compares tenants alone and mixed on (None: every instance)."""
    acceptance_by_instance: dict[str, dict[tuple[str, str], PositionCounts]] = field(default_factory=dict)
    """Instance -> `acceptance` of its steps alone."""
    mixed_by_tenant: dict[tuple[str, str], PositionCounts] = field(default_factory=dict)
    """(technique, tenant) -> counts of the tenant's row classes in several-tenant batches (steps
    that record row classes only)."""
    mixed_by_tenant_by_instance: dict[str,
                                      dict[tuple[str, str], PositionCounts]] = field(default_factory=dict)
    """Instance -> `mixed_by_tenant` of its steps alone."""
    pool_runs: dict[int, PoolRun] = field(default_factory=dict)
    """Policy version -> its run, for `pool_instance`."""


def read_telemetry(engine: Engine, instance: str | None = None, pool_instance: str | None = None,
                   tenant_instance: str | None = None) -> Telemetry:
    """Accumulate the steps and requests tables (of one instance, or all); the steps of
    `pool_instance` go to `pool_runs` alone, by policy version, with each version's pool split
    read from `xo_policies` (store.history.policy_history)."""
    from store.db import session_scope

    t = Telemetry(pool_instance=pool_instance, tenant_instance=tenant_instance)
    presence: dict[tuple[str, str], tuple[list[float], list[int], list[int]]] = {}
    cols = [getattr(Step, c) for c in STEP_COLUMNS]
    where = [Step.instance == instance] if instance is not None else []
    with session_scope(engine) as session:
        query = select(*cols).where(*where).order_by(Step.instance, Step.time)
        for row in session.execute(query.execution_options(yield_per=5000)):
            r = dict(zip(STEP_COLUMNS, row))
            if _is_pool(r["instance"], pool_instance):
                _add_pool_step(t, r)
            else:
                _add_step(t, r, presence)
        rq = select(Request.instance, Request.tenant, Request.arrival_time, Request.finish_time,
                    Request.proposed_tokens, Request.accepted_tokens)
        if instance is not None:
            rq = rq.where(Request.instance == instance)
        rows = session.execute(rq.execution_options(yield_per=5000))
        for inst, tenant, start, end, proposed, accepted in rows:
            if _is_pool(inst, pool_instance):
                continue
            kind = _request_kind(presence.get((inst, tenant)), start, end)
            c = t.by_tenant.setdefault((tenant, kind), RequestCounts())
            c.requests, c.proposed, c.accepted = c.requests + 1, c.proposed + proposed, c.accepted + accepted
            t.requests += 1
            t.tenants.add(tenant)
        ru = select(func.count()).select_from(StepRollup)
        t.rollup_minutes = int(session.execute(
            ru.where(StepRollup.instance == instance) if instance is not None else ru).scalar() or 0)
        if t.pool_runs:
            _pool_splits(session, t)
    return t


def _is_pool(instance: str, pool_instance: str | None) -> bool:
    """`pool_instance` itself or one of its rounds (`{pool_instance}-r{round}`, bench/report/runs.py)."""
    if pool_instance is None:
        return False
    rest = instance.removeprefix(pool_instance)
    return rest == "" or (rest != instance and rest.startswith("-r") and rest[2:].isdigit())


def _add_pool_step(t: Telemetry, r: dict) -> None:
    run = t.pool_runs.setdefault(int(r["policy_version"]), PoolRun(int(r["policy_version"])))
    run.steps += 1
    run.batch_sum += int(r["batch_size"])
    run.peak_batch = max(run.peak_batch, int(r["batch_size"]))
    run.tenant_pages.append(int(r["kv_pages_used"]) + int(r["kv_pages_free"]))
    run.goodput.add(float(r["decode_tokens"]), float(r["step_ms"]) / 1000.0)
    run.first_time = r["time"] if run.first_time is None else min(run.first_time, r["time"])
    run.last_time = r["time"] if run.last_time is None else max(run.last_time, r["time"])
    if int(r["depth"]) > 0 and str(r["technique"]) != "none":
        run.technique, run.depth = str(r["technique"]), max(run.depth, int(r["depth"]))


def _pool_splits(session, t: Telemetry) -> None:
    """Each pool run's split (and its rule's technique, for runs that never speculated) from its stored
    policy."""
    from store.history import policy_history

    for p in policy_history(session, limit=100_000, instance=None):
        run = t.pool_runs.get(int(p.version))
        body = p.body if isinstance(p.body, dict) else {}
        if run is None or not _is_pool(str(p.instance), t.pool_instance):
            continue
        run.pool_split = float(body.get("pool_split", 0.0))
        rules = body.get("rules") or []
        if run.technique == "none" and rules and rules[0].get("technique", "none") != "none":
            run.technique = f"{rules[0]['technique']} (never drafted)"


def _add_step(t: Telemetry, r: dict, presence: dict) -> None:
    tech, depth, batch = str(r["technique"]), int(r["depth"]), int(r["batch_size"])
    tenants = sorted({str(x) for x in (r["tenants"] or ())})
    t.steps += 1
    t.techniques[tech] = t.techniques.get(tech, 0) + 1
    t.instances.add(r["instance"])
    t.tenants.update(tenants)
    t.first_time = r["time"] if t.first_time is None else min(t.first_time, r["time"])
    t.last_time = r["time"] if t.last_time is None else max(t.last_time, r["time"])
    mixed = len(tenants) > 1
    group = MIXED if mixed else (tenants[0] if tenants else UNNAMED)
    if depth > 0 and r["proposed"] > 0:
        _add_drafts(t, r, group, mixed)
    t.pool_pages.setdefault(tech, []).append(int(r["kv_pages_used"]) + int(r["kv_pages_free"]))
    if r["prefill_tokens"] == 0 and r["step_ms"] > 0 and batch > 0:
        t.decode_steps += 1
        mixes = (ALL, MIXED) if mixed else (ALL, ALONE) + tuple(f"{ALONE}: {x}" for x in tenants)
        timed = step_technique(tech, r["row_classes"])
        for mix in mixes:
            t.goodput.setdefault((timed, mix, batch), Moments()).add(float(r["decode_tokens"]),
                                                                   float(r["step_ms"]) / 1000.0)
    for tenant in tenants:  # rows arrive ordered by (instance, time): lists stay sorted
        times, alone, mix = presence.setdefault((r["instance"], tenant), ([], [0], [0]))
        times.append(r["time"])
        alone.append(alone[-1] + (not mixed))
        mix.append(mix[-1] + mixed)


def _add_drafts(t: Telemetry, r: dict, group: str, mixed: bool) -> None:
    """A speculating step's drafts: per row class where it records them (module doc, 2), else
    the step's; each key counts the step once."""
    units = drafts(str(r["technique"]), int(r["depth"]), int(r["proposed"]), int(r["accepted"] or 0),
                   r["accepted_per_pos"], r["row_classes"])
    seen: set[tuple] = set()
    for d in (d for d in units if d.proposed > 0):
        keyed = [((d.technique, group), t.acceptance, t.acceptance_by_instance)]
        if mixed and d.tenant is not None:
            keyed.append(((d.technique, str(d.tenant)), t.mixed_by_tenant, t.mixed_by_tenant_by_instance))
        for key, pooled, by_instance in keyed:
            first = (id(pooled), key) not in seen
            seen.add((id(pooled), key))
            for acc in (pooled, by_instance.setdefault(r["instance"], {})):
                acc.setdefault(key, PositionCounts()).add(d.depth, d.proposed, list(d.accepted_per_pos),
                                                          steps=int(first))
        if (d.technique, d.depth) not in seen:
            seen.add((d.technique, d.depth))
            per_depth = t.depths.setdefault(d.technique, {})
            per_depth[d.depth] = per_depth.get(d.depth, 0) + 1


def _request_kind(presence: tuple[list[float], list[int], list[int]] | None, start: float,
                  end: float) -> str:
    """"alone" / "mixed" / "both" from the steps carrying the request's tenant in [start, end]."""
    if presence is None:
        return "no steps"
    times, alone, mixed = presence
    lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
    n_alone, n_mixed = alone[hi] - alone[lo], mixed[hi] - mixed[lo]
    if n_alone and n_mixed:
        return "both"
    return "alone" if n_alone else "mixed" if n_mixed else "no steps"


def q1_acceptance(t: Telemetry) -> dict[tuple[str, str], PositionCounts]:
    """The counts Q1 compares: the tenant instance's when it has any, else every instance's."""
    if t.tenant_instance is not None and t.acceptance_by_instance.get(t.tenant_instance):
        return t.acceptance_by_instance[t.tenant_instance]
    return t.acceptance


def q1_mixed_by_tenant(t: Telemetry) -> dict[tuple[str, str], PositionCounts]:
    """`mixed_by_tenant` of the instance `q1_acceptance` reads (the same choice)."""
    if t.tenant_instance is not None and t.acceptance_by_instance.get(t.tenant_instance):
        return t.mixed_by_tenant_by_instance.get(t.tenant_instance, {})
    return t.mixed_by_tenant


def measured_acceptance(t: Telemetry, technique: str) -> list[float]:
    """Unconditional acceptance per draft position of `technique`, pooled over every group."""
    offered: defaultdict[int, float] = defaultdict(float)
    accepted: defaultdict[int, int] = defaultdict(int)
    for (tech, _), counts in t.acceptance.items():
        if tech == technique:
            for i, n in enumerate(counts.offered):
                offered[i] += n
                accepted[i] += counts.accepted[i]
    return [accepted[i] / offered[i] if offered[i] else 0.0 for i in sorted(offered)]


def usual_depth(t: Telemetry, technique: str) -> int | None:
    """The depth `technique` speculated at most often."""
    depths = t.depths.get(technique)
    return max(depths, key=lambda d: (depths[d], -d)) if depths else None
