"""The tuner inside the daemon: its keeper, exploration, the periodic job.

`install(app, database)` (from make_app, when there is a database) builds
the PolicyKeeper and the Tuner from the engine's `capacity()` and the
settings' `[tuner]` section, and adds an aiohttp cleanup context that, at
startup:

1. closes retunes a crash left "running" as "interrupted" (rolling back a
   policy they applied but never validated), then restores the database's
   active policy into the engine (or records the starter policy,
   `starter_policy`, as version 0; an invalid stored policy falls back to
   the default with a warning), measuring which
   (technique, depth) cells the telemetry lacks so the first policy's
   exploration profiles them;
2. with `tuner.enabled`, starts an APScheduler AsyncIOScheduler on the app's
   loop with one interval job, `Tuner.scheduled` — a plain function, so it runs
   in the loop's thread pool, never on the loop;

and at shutdown stops the scheduler and closes the tuner (a validation
window in progress ends early), before the engine thread and the database
close. Searches run in a spawned process (`tuner.search_process`), started
and warmed up at startup when the tuner is enabled.
The keeper and the Tuner serve the database's instance (`Database.instance`):
its own policies, versions and retunes.

Every non-pinned policy the keeper serves while `tuner.enabled` is on
carries an exploration (`tuner.explore.ExplorationPlan`): `explore_share`
of decode steps try a neighbouring depth, and the first `profile_steps`
decisions after startup profile the unmeasured cells.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from daemon import state as st
from daemon.database import Database
from daemon.jsonlog import log_event
from engine.policy import NEVER, BatchRule, TunedPolicy
from engine.types import EngineCapacity
from tuner.explore import ExplorationPlan
from tuner.keeper import PolicyKeeper
from tuner.objective import Capacity
from tuner.search import run_search
from tuner.service import ProcessSearch, Tuner

log = logging.getLogger("crossover.tuner")
TUNER = web.AppKey("tuner", Tuner)
"""Absent without a database."""
SCHEDULER = web.AppKey("tuner_scheduler", AsyncIOScheduler)
"""Present while the periodic retune job is scheduled (tuner enabled)."""
JOB_ID = "retune"


def starter_policy(capacity: EngineCapacity) -> TunedPolicy:
    """What a daemon without policy history serves until a retune replaces it: n-gram drafting
    (it holds no memory and drafts only where a sequence repeats itself) at depth 4 up to
    batch 4 and depth 2 up to batch 8, as users configure vLLM's dynamic speculation; on a
    CPU, depth 4 at batch 1 and depth 2 at batch 2 only, since there a step's time grows with
    every token it verifies (the matmuls are compute-bound from a few rows on), so a row
    verifying d drafts costs about d + 1 decode rows. Never speculating when the engine has
    no n-gram proposer or cannot verify 4 drafts."""
    if "ngram" not in capacity.proposers or capacity.max_depth < 4:
        return NEVER
    last = BatchRule(NEVER.rules[-1].max_batch)
    if capacity.backend == "cpu":
        return TunedPolicy(rules=(BatchRule(1, "ngram", 4), BatchRule(2, "ngram", 2), last), crossover=2)
    return TunedPolicy(rules=(BatchRule(4, "ngram", 4), BatchRule(8, "ngram", 2), last), crossover=8)


def install(app: web.Application, database: Database) -> None:
    """Add the tuner and its cleanup context."""
    engine, config = app[st.ENGINE], app[st.SETTINGS].tuner

    def capacity() -> Capacity:
        return Capacity.from_engine(engine.capacity())

    plan = ExplorationPlan(capacity(), config)
    keeper = PolicyKeeper(database.engine, engine, wrap=plan,
                          default=starter_policy(engine.capacity()), instance=database.instance)
    search = ProcessSearch() if config.search_process else run_search
    app[TUNER] = Tuner(database.engine, database.url, keeper, capacity, config, search=search)
    app.cleanup_ctx.append(lambda a: _tuner_ctx(a, plan, database))


async def _tuner_ctx(app: web.Application, plan: ExplorationPlan,
                     database: Database) -> AsyncIterator[None]:
    tuner = app[TUNER]
    config = tuner.config
    if plan.enabled:
        await asyncio.to_thread(plan.measure_gaps, database.engine, config.fit_window_s,
                                database.instance)
    profile_cells = list(plan.gaps)
    policy = await asyncio.to_thread(tuner.restore)  # closes interrupted retunes first
    log_event(log, "policy restored", version=policy.version, pinned=tuner.keeper.pinned,
              profile=[f"{t}@{d}" for t, d in profile_cells])
    scheduler = None
    if config.enabled:
        tuner.start_search()  # warms up while the daemon starts, not in the first retune
        scheduler = AsyncIOScheduler()
        scheduler.add_job(tuner.scheduled, "interval", seconds=config.interval_s,
                          id=JOB_ID, max_instances=1, coalesce=True)
        scheduler.start()
        app[SCHEDULER] = scheduler
    try:
        yield
    finally:
        if scheduler is not None:
            scheduler.shutdown(wait=False)
        await asyncio.to_thread(tuner.close)
