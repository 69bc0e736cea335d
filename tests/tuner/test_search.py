"""The Optuna study: persisted beside the project's tables, continued across restarts,
constrained by KV capacity, and a Pareto front in two-objective mode. Most tests drive TPE
(`exact=False`); tests/tuner/test_exact.py covers the exact solve."""

from __future__ import annotations

import dataclasses
import os
import time

import optuna
import pytest
from sqlalchemy import Engine, inspect

from engine.policy import NEVER, BatchRule, TunedPolicy
from store.migrate import check_schema, head_revision
from tests.tuner import synth
from tests.tuner.conftest import CAPACITY, FAST, history
from tuner.capacity import Capacity
from tuner.search import (
    REVISIT,
    SearchJob,
    make_storage,
    observe_recent,
    run_search,
    trial_constraints,
)
from tuner.space import SearchSpace
from tuner.validate import MAX_FIGURE_BATCH

TPE = dataclasses.replace(FAST, exact=False)


def job(db_url: str, config=TPE, capacity: Capacity = CAPACITY) -> SearchJob:
    now = time.time()
    return SearchJob(db_url, config, capacity, NEVER, since=now - 3600, until=now + 1)


def test_study_lives_in_the_project_database_and_continues_after_a_restart(
        db: Engine, db_url: str) -> None:
    history(db)
    first = run_search(job(db_url))
    assert first.trials == list(range(TPE.trials))
    # the project's schema is still at head with Optuna's tables beside it
    assert check_schema(db_url) == head_revision()
    tables = set(inspect(db).get_table_names())
    assert {"studies", "trials", "alembic_version", "xo_alembic_version", "xo_steps"} <= tables
    # a "restart": nothing shared but the file
    second = run_search(job(db_url))
    assert second.study_name == first.study_name
    assert second.trials == list(range(TPE.trials, 2 * TPE.trials))
    study = optuna.load_study(study_name=first.study_name, storage=make_storage(db_url))
    assert len(study.trials) == 2 * TPE.trials
    # the second run re-scored the first run's best parameters among its first (enqueued) trials
    best_params = study.trials[first.best_trial].params
    assert any(study.trials[n].params == best_params for n in second.trials[:REVISIT + 2])


def test_a_full_study_is_continued_by_a_new_generation(db: Engine, db_url: str) -> None:
    history(db, n=300)
    config = dataclasses.replace(TPE, trials=6, max_study_trials=10)
    first, second, third = (run_search(job(db_url, config)) for _ in range(3))
    assert first.study_name == second.study_name and third.study_name == first.study_name + ".2"
    storage = make_storage(db_url)
    old = optuna.load_study(study_name=first.study_name, storage=storage)
    new = optuna.load_study(study_name=third.study_name, storage=storage)
    assert len(old.trials) == 12 and len(new.trials) == 6
    feasible = [t for t in old.trials if all(c <= 0 for c in trial_constraints(t))]
    best = max(feasible, key=lambda t: t.value).params
    assert any(t.params == best for t in new.trials[:REVISIT + 2])  # carried over


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tpe"])
def test_the_search_finds_speculation_where_it_pays(db: Engine, db_url: str, exact: bool) -> None:
    history(db)
    out = run_search(job(db_url, dataclasses.replace(FAST, trials=16, exact=exact)))
    assert out.method == ("exact" if exact else "tpe")
    best = out.best
    assert isinstance(best, TunedPolicy) and best.source == "tuner"
    assert best.choose(1)[0] in ("ngram", "mtp")  # acceptance 0.7-0.8 pays at batch 1
    assert out.predicted.goodput > out.incumbent.goodput * 1.2
    assert out.fit.step_ms_median_ape < 0.10
    assert set(out.traffic.tenant_mix) == {"chat", "code"}
    # validation's figures cover every batch size the engine may run, seen in the window or not
    seen = set(out.traffic.batch_weights)
    for figures in (out.per_batch, out.incumbent_per_batch):
        assert set(range(1, MAX_FIGURE_BATCH + 1)) <= set(figures) and seen < set(figures)
        assert all(tokens >= b and ms > 0 for b, (tokens, ms) in figures.items())


def test_constraints_exclude_policies_that_starve_tenants(db: Engine, db_url: str) -> None:
    """A pool just big enough for the observed concurrency at split <= 0.1: no chosen policy
    may lend more, and every trial that did is recorded infeasible."""
    history(db)
    out0 = run_search(job(db_url))
    need = out0.incumbent.tenant_pages_needed
    tight = dataclasses.replace(CAPACITY, total_pages=int(need / 0.9) + 1)
    config = dataclasses.replace(TPE, trials=20, study_name="tight")
    out = run_search(job(db_url, config, tight))
    assert out.best.pool_split <= 0.1
    exact = run_search(job(db_url, dataclasses.replace(config, exact=True), tight))
    assert exact.method == "exact" and exact.predicted.feasible
    assert exact.best.pool_split <= 0.1
    study = optuna.load_study(study_name=out.study_name, storage=make_storage(db_url))
    splits = [(t.params["pool_split"], trial_constraints(t)[0]) for t in study.trials]
    assert any(s > 0.1 for s, _ in splits), "the sampler never tried a large split"
    assert all((c > 0) == (s > 0.1) for s, c in splits)


def test_two_objective_mode_exposes_a_pareto_front(db: Engine, db_url: str) -> None:
    history(db)
    config = dataclasses.replace(FAST, trials=24, two_objective=True)  # exact or not: TPE
    out = run_search(job(db_url, config))
    assert out.method == "tpe" and out.pareto and out.best == out.pareto[0].policy
    points = [(p.goodput, p.p95_tpot_ms) for p in out.pareto]
    for g, t in points:  # nobody on the front dominates anybody else on it
        assert not any(g2 >= g and t2 <= t and (g2, t2) != (g, t) for g2, t2 in points)
    study = optuna.load_study(study_name=out.study_name, storage=make_storage(db_url))
    assert len(study.directions) == 2 and study.best_trials
    assert out.study_name != SearchSpace.build(FAST, CAPACITY).study_name(FAST.study_name)


def test_the_search_runs_in_a_spawned_process(db: Engine, db_url: str) -> None:
    """What the daemon does by default: the job and the outcome cross a process boundary."""
    from tuner.service import ProcessSearch

    history(db, n=300)
    search = ProcessSearch()
    try:
        out = search(job(db_url, dataclasses.replace(FAST, trials=4)))  # exact
        # the worker runs at the lowest priority, so a search yields the CPU to serving
        assert search._pool.submit(os.nice, 0).result() == min(19, os.nice(0) + 19)
    finally:
        search.close()
    # the optimum is the one trial: the serving policy (NEVER) is not a point of the space
    assert out.trials == [0] and out.method == "exact" and out.best is not None and out.per_batch
    assert isinstance(out.best, TunedPolicy) and out.best.source == "tuner"  # a value, not a dict


def test_the_traffic_optimized_for_is_the_recent_one() -> None:
    """An hour of batch-16 steps, then the traffic window's batch-1 steps: the objective
    averages over batch 1 only; with too few recent steps, over everything."""
    gen = synth.Synth(seed=5)
    old = gen.serve(NEVER, 200, start=synth.T0, batches=(16,))
    new = gen.serve(NEVER, 50, start=synth.T0 + 3600, batches=(1,))
    recent = observe_recent(old + new, [], synth.T0 + 3000, 0.95)
    assert recent.batch_weights == {1: 1.0} and recent.steps == 50
    thin = observe_recent(old + new[:3], [], synth.T0 + 3000, 0.95)
    assert thin.batch_weights.keys() == {1, 16} and thin.steps == 203


def test_a_technique_the_window_never_ran_keeps_its_tenants_acceptance(
        db: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy tenant drafted with n-gram at batch 1-2, then a stretch decoded plainly (as a
    busy phase is): the fit window holds no n-gram step. When its traffic is the copy tenant
    at batch 4, the search still knows n-gram pays for it (tuner.acceptance.remembered);
    fitted on the window alone, n-gram has no rates there and plain decoding wins."""
    gen, now = synth.Synth(seed=11), time.time()
    copy = lambda steps: [dataclasses.replace(s, tenants=("copy",)) for s in steps]
    ngram = TunedPolicy((BatchRule(2, "ngram", 4), BatchRule(64)), crossover=2)
    synth.write(db, copy(gen.serve(ngram, 300, start=now - 200.0, batches=(1, 2))))
    synth.write(db, copy(gen.serve(NEVER, 300, start=now - 60.0, every_s=0.1, batches=(4,))))
    config = dataclasses.replace(FAST, trials=4, exact=True, cost_window_s=600.0,
                                 fit_window_s=60.0, traffic_window_s=60.0)
    run = lambda: run_search(SearchJob(db_url, config, CAPACITY, NEVER, since=now - 61.0,
                                       until=now + 1))
    out = run()
    assert "ngram|copy" in out.model.acceptance and out.best.choose(4)[0] == "ngram", out.model
    assert out.predicted.goodput > 1.2 * out.incumbent.goodput
    monkeypatch.setattr("tuner.model.PerfModel.remembering", lambda self, *a: self)
    forgot = run()
    assert not any(k.startswith("ngram") for k in forgot.model.acceptance)
    assert forgot.best is None or forgot.best.choose(4)[0] == "none"
