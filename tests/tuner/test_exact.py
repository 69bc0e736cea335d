"""The exact solve (tuner.exact, per pool split in tuner.split) against brute force over a
small space, and the search's use of it: the optimum and the serving policy are the only
trials told."""

from __future__ import annotations

import dataclasses
import itertools
import time

import optuna
import pytest
from sqlalchemy import Engine

from engine.policy import NEVER, BatchRule, TunedPolicy
from tests.tuner import synth
from tests.tuner.conftest import CAPACITY, FAST, history
from tuner.capacity import Capacity
from tuner.config import TunerConfig
from tuner.exact import solve
from tuner.model import PerfModel
from tuner.objective import evaluate
from tuner.search import SearchJob, make_storage, run_search
from tuner.space import SearchSpace
from tuner.split import solve_splits
from tuner.traffic import Traffic, observe

SMALL = TunerConfig(ranges=(2, 8, 64), max_depth=4, max_pool_split=0.2, pool_split_step=0.05,
                    draft_vocabs=(8192, 32768))
LOOSE = Capacity(total_pages=4096, page_size=16, page_bytes=1 << 16, max_depth=4, depths=(1, 2, 4),
                 spec_max_batch=32, proposer_depths={"mtp": 2},
                 proposers={"ngram": (0, 1 << 15), "mtp": (40 << 16, 1 << 14)})
TIGHT = dataclasses.replace(LOOSE, total_pages=360)
"""Tenants need 340 of the 360 pages, so speculation may borrow 18 (split 0.05): never MTP's
40 resident pages, and n-gram at depth 4 only up to batch 8 (20 sequences at depth 2 need
20 pages of drafts and 3 of verify slots). The pool admits 21 sequences of 17 pages at split
0 and 20 at 0.05, so the steps at larger batches run smaller (tuner.capacity)."""


def brute_force(space: SearchSpace, model: PerfModel, traffic: Traffic,
                capacity: Capacity) -> tuple[float, int]:
    """The best feasible goodput over every policy of the space, and how many were feasible."""
    cells = [("none", 0)] + [(t, d) for t in space.techniques if t != "none" for d in space.depths]
    best, feasible = 0.0, 0
    for rules in itertools.product(cells, repeat=len(space.ranges)):
        for crossover in space.crossovers:
            for split in space.pool_splits():
                for vocab in space.draft_vocabs or (0,):
                    policy = TunedPolicy(tuple(BatchRule(u, *c) for u, c in zip(space.ranges, rules)),
                                         crossover, split, draft_vocab=vocab)
                    ev = evaluate(policy, model, traffic, capacity)
                    if ev.feasible:
                        best, feasible = max(best, ev.goodput), feasible + 1
    return best, feasible


def fitted(seed: int, mean_batch: float) -> tuple[PerfModel, Traffic]:
    gen = synth.Synth(seed=seed)
    steps = gen.explore(600, mean_batch=mean_batch)
    traffic = dataclasses.replace(observe(steps, []), concurrency=20.0, mean_prompt_tokens=200.0,
                                  mean_output_tokens=60.0)  # 17 pages per sequence, 340 in all
    return PerfModel.fit(steps), traffic


@pytest.mark.parametrize("capacity", [LOOSE, TIGHT], ids=["loose", "tight"])
@pytest.mark.parametrize("seed, mean_batch", [(1, 2.0), (2, 8.0), (3, 20.0)])
def test_the_solve_matches_brute_force(capacity: Capacity, seed: int, mean_batch: float) -> None:
    model, traffic = fitted(seed, mean_batch)
    space = SearchSpace.build(SMALL, capacity)
    best, feasible = brute_force(space, model, traffic, capacity)
    policy = solve_splits(space, model, traffic, capacity)
    assert feasible > 0 and policy is not None
    ev = evaluate(policy, model, traffic, capacity)
    assert ev.feasible, ev.violations()
    assert ev.goodput == pytest.approx(best, rel=1e-9)
    assert space.params_of(policy) is not None  # a point of the space, so the study can hold it
    # the smallest split that holds it: one step less would not (nor score as high)
    if policy.pool_split > 0:
        less = evaluate(dataclasses.replace(
            policy, pool_split=round(policy.pool_split - SMALL.pool_split_step, 6)), model, traffic, capacity)
        assert not less.feasible or less.goodput < ev.goodput * (1 - 1e-9)
    if capacity is LOOSE:  # where the pool holds every batch, one solve at any split is as good
        plain = evaluate(solve(space, model, traffic, capacity), model, traffic, capacity)
        assert plain.goodput == pytest.approx(best, rel=1e-9)


def test_the_tight_pool_binds() -> None:
    """In the tight pool the unconstrained optimum does not fit, so the constraint mattered."""
    model, traffic = fitted(2, 8.0)
    space = SearchSpace.build(SMALL, TIGHT)
    free = solve_splits(space, model, traffic, dataclasses.replace(TIGHT, total_pages=1 << 20))
    tight = solve_splits(space, model, traffic, TIGHT)
    assert free is not None and tight is not None
    assert not evaluate(dataclasses.replace(free, pool_split=0.2), model, traffic, TIGHT).feasible
    assert evaluate(tight, model, traffic, TIGHT).goodput < evaluate(free, model, traffic, TIGHT).goodput


def test_nothing_fits_gives_none() -> None:
    """Not even one sequence of 17 pages fits: no policy. A pool too small for the observed
    concurrency (100 pages for 340) binds at any split: the best policy lends only what its
    speculation needs, the rest priced as a smaller batch (tuner.capacity)."""
    model, traffic = fitted(1, 2.0)
    tiny = dataclasses.replace(TIGHT, total_pages=16)
    assert solve_splits(SearchSpace.build(SMALL, tiny), model, traffic, tiny) is None
    crowded = dataclasses.replace(TIGHT, total_pages=100)
    best = solve_splits(SearchSpace.build(SMALL, crowded), model, traffic, crowded)
    ev = evaluate(best, model, traffic, crowded)
    assert (ev.feasible and ev.tenant_pages_needed == 17
            and ev.admitted == (100 - int(100 * best.pool_split)) // 17)


def solve_at_batch_1(ranges: tuple[int, ...], rate: float = 0.5, max_batch: int = 1 << 30,
                     incumbent: TunedPolicy | None = None,
                     **fitted: object) -> tuple[TunedPolicy, PerfModel, Traffic, Capacity]:
    """The fill tests' case: t0 = 10 ms a step, 1 ms a row, every draft position accepted at
    `rate` (PerfModel fields `fitted`, e.g. its batch span); n-gram at depths 1, 2, 4; only
    batch 1 observed. The solved policy and what it was solved on."""
    model = PerfModel(target=(10.0, 0.0, 0.0, 1.0, 0.0), acceptance={"ngram": (rate,) * 4}, **fitted)
    capacity = Capacity(total_pages=4096, page_size=16, max_depth=4, depths=(1, 2, 4),
                        proposers={"ngram": (0, 0)}, max_batch=max_batch)
    traffic = Traffic(steps=100, batch_weights={1: 1.0}, prefill_per_step={}, concurrency=1.0,
                      concurrency_max=1)
    space = SearchSpace.build(TunerConfig(ranges=ranges, max_depth=4), capacity)
    return solve(space, model, traffic, capacity, incumbent), model, traffic, capacity


def test_ranges_without_traffic_take_their_fastest_cell() -> None:
    """Only batch 1 observed. The ranges above hold no steps, so the objective cannot tell
    their cells apart; each takes the cell with the fewest predicted ms per token at its probe
    batch (tuner.exact, module doc 5). With t0 = 10 ms a step, 1 ms a row and every draft
    position accepted at 0.5, per token: batch 3 (range (2, 4]) plain 4.33, depth 1 3.56,
    depth 2 3.62; batch 6 ((4, 8]) 2.67, 2.44, 2.67; batch 12 ((8, 16]) 1.83, 1.89; batch 32
    1.31, 1.54. So depth 1 up to batch 8 and nothing above, where before the fill every
    range but the observed one stayed "none" and the crossover was 2."""
    policy, model, traffic, capacity = solve_at_batch_1((2, 4, 8, 16, 64))
    assert policy is not None
    assert [(r.technique, r.depth) for r in policy.rules] == [
        ("ngram", 2), ("ngram", 1), ("ngram", 1), ("none", 0), ("none", 0)]
    assert policy.crossover == 8
    # the fill does not move the goodput predicted on the observed traffic
    bare = TunedPolicy((BatchRule(2, "ngram", 2), *(BatchRule(u, "none", 0) for u in (4, 8, 16, 64))), 2)
    assert evaluate(policy, model, traffic, capacity).goodput == pytest.approx(
        evaluate(bare, model, traffic, capacity).goodput, rel=1e-12)


def test_a_busy_window_keeps_speculation_for_the_drain_when_splits_are_solved() -> None:
    """A draft model makes every pool split a solve of its own (tuner.split). Only batch 29
    observed, where plain wins (t0 = 10 ms, 1 ms a row: 1.34 ms a token against 1.60 at
    n-gram depth 1); the ranges below take n-gram, as one solve fills them. Speculating
    needs verify-slot pages, so the solve at split 0 fills nothing and ties on goodput with
    the one at 0.05; the tie went to split 0 and the drain ran plain."""
    model = PerfModel(target=(10.0, 0.0, 0.0, 1.0, 0.0),
                      acceptance={"ngram": (0.5,) * 4, "draft": (0.1,) * 4},
                      propose={"draft": (5.0, 0.5, 0.5)})
    capacity = Capacity(total_pages=4096, page_size=16, max_depth=4, depths=(1, 2, 4), max_batch=32,
                        proposers={"ngram": (0, 0), "draft": (0, 0)}, lent_kv={"draft": 1.0})
    traffic = Traffic(steps=100, batch_weights={29: 1.0}, prefill_per_step={}, concurrency=29.0,
                      concurrency_max=29)
    space = SearchSpace.build(TunerConfig(ranges=(2, 4, 8, 16, 64), max_depth=4, max_pool_split=0.5,
                                          pool_split_step=0.05), capacity)
    policy = solve_splits(space, model, traffic, capacity)
    assert policy is not None and policy.choose(29) == ("none", 0)
    assert policy.choose(1)[0] == "ngram" and policy.choose(3)[0] == "ngram"
    assert policy.pool_split == 0.05  # the smallest split that speculates, no more
    assert evaluate(policy, model, traffic, capacity).goodput == pytest.approx(
        evaluate(NEVER, model, traffic, capacity).goodput, rel=1e-9)


def test_no_range_is_filled_beyond_the_batch_sizes_the_fit_saw() -> None:
    """The same model fitted on steps of batch 1-4 only (`batch_span`): the (2, 4] range is
    filled, the ones whose probes (6, 12, 32) lie beyond stay "none", the crossover at 4."""
    policy, *_ = solve_at_batch_1((2, 4, 8, 16, 64), batch_span=(1, 4))
    assert [(r.technique, r.depth) for r in policy.rules] == [
        ("ngram", 2), ("ngram", 1), ("none", 0), ("none", 0), ("none", 0)]
    assert policy.crossover == 4


def test_a_range_beyond_the_fit_keeps_the_serving_policys_cell() -> None:
    """Fitted on batch 1-4 only, with the batch-size table serving (n-gram@4 up to batch 8,
    @1 up to 16, nothing above): the ranges beyond the fit keep the table's cells, the
    observed and filled ones are solved as before, the predicted goodput unchanged. A cell
    the space lacks (depth 3) is not kept."""
    table = TunedPolicy((BatchRule(8, "ngram", 4), BatchRule(16, "ngram", 1), BatchRule(64)), 16)
    policy, model, traffic, capacity = solve_at_batch_1((2, 4, 8, 16, 64), batch_span=(1, 4),
                                                        incumbent=table)
    assert [(r.technique, r.depth) for r in policy.rules] == [
        ("ngram", 2), ("ngram", 1), ("ngram", 4), ("ngram", 1), ("none", 0)]
    assert policy.crossover == 16
    bare, *_ = solve_at_batch_1((2, 4, 8, 16, 64), batch_span=(1, 4))
    assert evaluate(policy, model, traffic, capacity).goodput == pytest.approx(
        evaluate(bare, model, traffic, capacity).goodput, rel=1e-12)
    odd = TunedPolicy((BatchRule(64, "ngram", 3),), 64)
    kept, *_ = solve_at_batch_1((2, 4, 8, 16, 64), batch_span=(1, 4), incumbent=odd)
    assert [(r.technique, r.depth) for r in kept.rules][2:] == [("none", 0)] * 3


def test_no_range_is_filled_with_a_step_larger_than_the_fit_saw() -> None:
    """Every draft accepted at 0.9: at batch 3 depth 4 runs fastest per token (2.03 ms against
    2.34 at depth 2), but its step runs 15 rows and the fit saw at most 9 (`max_rows`), so the
    unobserved (2, 4] range takes depth 2. The observed range is not bounded."""
    policy, *_ = solve_at_batch_1((2, 4), rate=0.9, max_rows=9)
    assert [(r.technique, r.depth) for r in policy.rules] == [("ngram", 4), ("ngram", 2)]
    unbounded, *_ = solve_at_batch_1((2, 4), rate=0.9)
    assert unbounded.choose(3) == ("ngram", 4)


def test_a_fitted_model_knows_its_batch_span() -> None:
    gen = synth.Synth(seed=4)
    steps = gen.explore(200, mean_batch=3.0)
    model = PerfModel.fit(steps)
    sizes = [s.batch_size for s in steps]
    assert model.batch_span == (min(sizes), max(sizes))
    assert model.summary()["batch_span"] == [min(sizes), max(sizes)]
    assert model.max_rows == max(s.batch_size * (1 + s.depth) for s in steps)  # unpadded
    assert model.summary()["max_rows"] == model.max_rows


def test_an_unobserved_range_beyond_the_engine_stays_plain() -> None:
    """A range whose batch sizes the engine never runs (above its max_batch) is not probed."""
    policy, *_ = solve_at_batch_1((2, 4, 8), max_batch=4)
    assert [(r.technique, r.depth) for r in policy.rules] == [("ngram", 2), ("ngram", 1), ("none", 0)]


def job(db_url: str, config: TunerConfig, incumbent: TunedPolicy = NEVER) -> SearchJob:
    now = time.time()
    return SearchJob(db_url, config, CAPACITY, incumbent, since=now - 3600, until=now + 1)


def test_an_exact_search_tells_the_optimum_and_the_serving_policy(db: Engine, db_url: str) -> None:
    history(db)
    tpe = run_search(job(db_url, dataclasses.replace(FAST, exact=False, trials=24, study_name="tpe")))
    serving = tpe.best
    exact = run_search(job(db_url, FAST, serving))
    assert exact.method == "exact" and tpe.method == "tpe"
    assert exact.predicted.goodput >= tpe.predicted.goodput * (1 - 1e-9)
    study = optuna.load_study(study_name=exact.study_name, storage=make_storage(db_url))
    told = [study.trials[n] for n in exact.trials]
    policies = [TunedPolicy.from_dict(t.user_attrs["policy"]) for t in told]
    assert exact.trials == list(range(len(told)))  # a fresh study, and nothing else asked
    assert exact.best == TunedPolicy.from_dict(told[0].user_attrs["policy"])  # the optimum first
    same = (serving.rules, serving.crossover, serving.pool_split) == (
        policies[0].rules, policies[0].crossover, policies[0].pool_split)
    assert len(told) == (1 if same else 2)
    if not same:
        assert (policies[1].rules, policies[1].crossover) == (serving.rules, serving.crossover)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in told)
    assert 0 < exact.seconds < tpe.seconds


def test_a_missed_tpot_target_falls_back_to_tpe(db: Engine, db_url: str) -> None:
    """A TPOT target the optimum misses: TPE searches, starting from that optimum."""
    history(db)
    free = run_search(job(db_url, FAST))
    tpot = free.predicted.p95_tpot_ms
    config = dataclasses.replace(FAST, tpot_p95_ms=tpot * 0.9, study_name="tpot")
    out = run_search(job(db_url, config))
    assert out.method == "tpe" and len(out.trials) == FAST.trials
    study = optuna.load_study(study_name=out.study_name, storage=make_storage(db_url))
    first = [study.trials[n].params for n in out.trials[:3]]
    assert SearchSpace.build(FAST, CAPACITY).params_of(free.best) in first
    if out.best is not None:
        assert out.predicted.p95_tpot_ms <= tpot * 0.9


@pytest.mark.parametrize("spec_max_batch", [16, 32])
def test_the_crossover_reaches_the_largest_verified_batch(spec_max_batch: int) -> None:
    """Speculation pays at batch 32 in this model: an engine verifying up to batch 32 gets it
    there (crossover 32: the last range speculates, no further than the engine verifies); one
    verifying up to 16 gets none above 16 (the objective cannot tell the cells of (16, 64]
    apart, so that range stays "none")."""
    model = PerfModel(target=(10.0, 1.0, 0.0, 0.1, 0.0), acceptance={"ngram": (0.9, 0.9, 0.9, 0.9)})
    traffic = Traffic(steps=100, batch_weights={1: 0.5, 32: 0.5}, prefill_per_step={},
                      concurrency=32.0, concurrency_max=32)
    capacity = dataclasses.replace(LOOSE, spec_max_batch=spec_max_batch, proposers={"ngram": (0, 0)})
    policy = solve(SearchSpace.build(TunerConfig(), capacity), model, traffic, capacity)
    assert policy is not None and policy.choose(1)[0] == "ngram"
    if spec_max_batch == 32:
        assert policy.choose(32)[0] == "ngram" and policy.crossover == 32
    else:
        assert policy.rules[-1].technique == "none" and policy.crossover <= 16


def test_a_search_leaves_no_trial_waiting(db: Engine, db_url: str) -> None:
    """With fewer trials than policies to re-score (the optimum, the serving policy, ...), only
    as many are queued as are asked: a trial left waiting would be the next run's first."""
    history(db)
    ranges = SearchSpace.build(FAST, CAPACITY).ranges
    serving = TunedPolicy(tuple(BatchRule(upper) for upper in ranges), draft_vocab=8192)  # in the space
    for config in (dataclasses.replace(FAST, trials=1, study_name="one"),
                   dataclasses.replace(FAST, trials=1, exact=False, study_name="tpe")):
        assert SearchSpace.build(config, CAPACITY).params_of(serving) is not None
        out = run_search(job(db_url, config, serving))
        study = optuna.load_study(study_name=out.study_name, storage=make_storage(db_url))
        states = [t.state for t in study.trials]
        assert len(out.trials) == config.trials and states.count(optuna.trial.TrialState.WAITING) == 0


def test_when_nothing_fits_the_pool_nothing_is_asked(db: Engine, db_url: str) -> None:
    """A pool too small for one sequence of the observed length at any split: the exact solve
    finds no policy, so the search asks no trial and chooses none; TPE over the same space (exact off)
    finds no feasible trial either, so asking it could never decide."""
    history(db)
    now = time.time()
    starved = dataclasses.replace(CAPACITY, total_pages=1)

    def run(config: TunerConfig):
        return run_search(SearchJob(db_url, config, starved, NEVER, since=now - 3600, until=now + 1))
    exact = run(dataclasses.replace(FAST, study_name="starved"))
    assert exact.method == "exact" and exact.trials == [] and exact.best is None
    assert exact.predicted is None and not exact.incumbent.feasible and exact.details()["trials"] == 0
    tpe = run(dataclasses.replace(FAST, exact=False, trials=24, study_name="starved-tpe"))
    assert tpe.method == "tpe" and len(tpe.trials) == 24 and tpe.best is None
