"""The tuner inside the daemon: its keeper, exploration, the periodic job.

`install(app, database)` (from make_app, when there is a database and the
engine has `set_policy`) builds the PolicyKeeper and the Tuner and adds a
cleanup context (STYLE 11) that, at startup:

1. restores the database's active policy into the engine (or records the
   starter policy, `starter_policy`, as version 0), measuring which
   (technique, depth) cells the telemetry lacks so the first policy's
   exploration profiles them;
2. with `settings.tuner`, starts an APScheduler AsyncIOScheduler on the app's
   loop with one interval job, `Tuner.scheduled` — a plain function, so it runs
   in the loop's thread pool, never on the loop;

and at shutdown stops the scheduler and closes the tuner (a validation
window in progress ends early), before the engine thread and the database
close. Searches run in a spawned process (`tuner_search_process`).

Exploration (`tuner.explore.ExploringPolicy`) wraps every non-pinned
policy the keeper serves while `settings.tuner` is on: `tuner_explore_share`
of decode steps try a non-chosen depth, and the first `tuner_profile_steps`
decisions after startup profile the unmeasured cells.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from daemon import state as st
from daemon.database import Database
from daemon.jsonlog import log_event
from daemon.settings import Settings
from engine.policy import NEVER, BatchRule, TunedPolicy
from store.db import session_scope
from tuner.config import TunerConfig
from tuner.data import coverage
from tuner.explore import ExploringPolicy, gap_cells
from tuner.keeper import PolicyKeeper
from tuner.objective import Capacity
from tuner.search import run_search
from tuner.service import ProcessSearch, Tuner

log = logging.getLogger("crossover.tuner")
TUNER = web.AppKey("tuner", Tuner)
"""Absent without a database or with an engine that has no set_policy."""
JOB_ID = "retune"


def tuner_config(settings: Settings) -> TunerConfig:
    return TunerConfig(
        trials=settings.tuner_trials, two_objective=settings.tuner_two_objective,
        tpot_p95_ms=settings.tuner_tpot_p95_ms, min_new_steps=settings.tuner_min_new_steps,
        validation_s=settings.tuner_validation_s,
        validation_min_steps=settings.tuner_validation_min_steps,
        validation_poll_s=max(0.05, min(2.0, settings.tuner_validation_s / 20)),
        rollback_margin=settings.tuner_rollback_margin, fit_window_s=settings.tuner_fit_window_s,
        traffic_window_s=settings.tuner_traffic_window_s, baseline_s=settings.tuner_baseline_s,
        cost_window_s=settings.tuner_cost_window_s,
    )  # fmt: skip


def engine_max_depth(engine: Any) -> int:
    """Deepest draft the engine can verify (FakeEngine.max_depth, or its verify buckets)."""
    if hasattr(engine, "max_depth"):
        return int(engine.max_depth)
    buckets = getattr(getattr(getattr(engine, "runner", None), "rc", None), "verify_tokens", ())
    return max(buckets, default=1) - 1


def engine_depths(engine: Any) -> tuple[int, ...]:
    """Depths the engine verifies without padding (its verify buckets - 1; () when unknown)."""
    buckets = getattr(getattr(getattr(engine, "runner", None), "rc", None), "verify_tokens", ())
    return tuple(sorted(q - 1 for q in buckets if q > 1))


def capacity_of(engine: Any) -> Capacity:
    """The engine's pool, proposers and limits, as the objective needs them."""
    total = int(engine.status().get("kv_pages_total", 0))
    pool = getattr(engine, "pool", None)
    page_size = int(getattr(engine, "page_size", 0) or getattr(pool, "page_size", 16))
    runner = getattr(engine, "runner", None)
    kv = getattr(runner, "kv", None)
    page_bytes = int(kv.nbytes() // total) if kv is not None and total else 0
    rc = getattr(runner, "rc", None)
    spec_max = getattr(rc, "spec_max_batch", None)
    loaded = getattr(engine, "proposers", {})
    proposers = {name: (int(p.resident_bytes()), int(p.per_sequence_bytes(1)))
                 for name, p in loaded.items()}
    return Capacity(total_pages=total, page_size=page_size, page_bytes=page_bytes,
                    max_depth=engine_max_depth(engine), depths=engine_depths(engine),
                    proposer_depths={n: int(getattr(p, "max_depth", 1 << 10)) for n, p in loaded.items()},
                    spec_max_batch=int(spec_max or getattr(engine, "max_batch", 1 << 30)),
                    batch_buckets=tuple(int(b) for b in getattr(rc, "batch_buckets", ())),
                    proposers=proposers)


def starter_policy(engine: Any) -> TunedPolicy:
    """What a daemon without policy history serves until a retune replaces it: n-gram drafting
    (it holds no memory and drafts only where a sequence repeats itself) at depth 4 up to
    batch 4 and depth 2 up to batch 8, as users configure vLLM's dynamic speculation; never
    speculating when the engine has no n-gram proposer or cannot verify 4 drafts."""
    if "ngram" not in getattr(engine, "proposers", {}) or engine_max_depth(engine) < 4:
        return NEVER
    return TunedPolicy(rules=(BatchRule(4, "ngram", 4), BatchRule(8, "ngram", 2),
                              BatchRule(NEVER.rules[-1].max_batch)), crossover=8)


class Exploration:
    """Wraps the keeper's policies in ExploringPolicy; the first one also profiles the gaps."""

    def __init__(self, capacity: Capacity, settings: Settings) -> None:
        # cheapest first: what costs no memory is profiled (and can pay) soonest
        self.techniques = sorted(capacity.proposers, key=lambda t: (capacity.proposers[t][0], t))
        self.max_depth = min(capacity.max_depth, tuner_config(settings).max_depth)
        self.depths = tuple(d for d in capacity.depths if d <= self.max_depth) or None
        self.proposer_depth = {t: min(self.max_depth, capacity.proposer_depths.get(t, self.max_depth))
                               for t in self.techniques}
        self.share = settings.tuner_explore_share
        self.profile_steps = settings.tuner_profile_steps
        self.gaps: list[tuple[str, int]] = []
        self.enabled = settings.tuner and bool(self.techniques) and self.max_depth >= 1

    def measure_gaps(self, database: Database, window_s: float) -> None:
        with session_scope(database.engine) as session:
            seen = coverage(session, time.time() - window_s)
        self.gaps = [cell for t in self.techniques
                     for cell in gap_cells(seen, [t], self.proposer_depth[t])]

    def __call__(self, policy: TunedPolicy) -> Any:
        if not self.enabled:
            return policy
        profile, self.gaps = self.gaps, []  # only the first policy after startup profiles
        return ExploringPolicy(policy, share=self.share, techniques=self.techniques,
                               max_depth=self.max_depth, depths=self.depths, profile=profile,
                               profile_steps=self.profile_steps if profile else 0,
                               seed=policy.version)


def install(app: web.Application, database: Database) -> None:
    """Add the tuner (and its cleanup context) when the engine can take policies."""
    engine, settings = app[st.ENGINE], app[st.SETTINGS]
    if not hasattr(engine, "set_policy"):
        return
    exploration = Exploration(capacity_of(engine), settings)
    keeper = PolicyKeeper(database.engine, engine, wrap=exploration, default=starter_policy(engine))
    search = ProcessSearch() if settings.tuner_search_process else run_search
    app[TUNER] = Tuner(database.engine, database.url, keeper, lambda: capacity_of(engine),
                       tuner_config(settings), search=search)
    app.cleanup_ctx.append(lambda a: _tuner_ctx(a, exploration, database))


async def _tuner_ctx(app: web.Application, exploration: Exploration,
                     database: Database) -> AsyncIterator[None]:
    tuner, settings = app[TUNER], app[st.SETTINGS]
    if exploration.enabled:
        await asyncio.to_thread(exploration.measure_gaps, database, tuner.config.fit_window_s)
    profile_cells = list(exploration.gaps)
    policy = await asyncio.to_thread(tuner.keeper.restore)
    log_event(log, "policy restored", version=policy.version, pinned=tuner.keeper.pinned,
              profile=[f"{t}@{d}" for t, d in profile_cells])
    scheduler = None
    if settings.tuner:
        scheduler = AsyncIOScheduler()
        scheduler.add_job(tuner.scheduled, "interval", seconds=settings.tuner_interval_s,
                          id=JOB_ID, max_instances=1, coalesce=True)
        scheduler.start()
    try:
        yield
    finally:
        if scheduler is not None:
            scheduler.shutdown(wait=False)
        await asyncio.to_thread(tuner.close)
