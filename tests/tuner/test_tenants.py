"""Per-tenant rules: a mixed batch priced row by row, and the search that chooses them."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.policy import BatchRule, TenantRule, TunedPolicy
from tuner.capacity import Capacity
from tuner.config import TunerConfig
from tuner.mixed import Pricer
from tuner.model import PerfModel
from tuner.objective import evaluate
from tuner.space import SearchSpace
from tuner.split import solve_splits
from tuner.tenants import add_tenant_rules, with_tenants
from tuner.traffic import Traffic

# a step costs 10 ms + 0.2 ms per row and position; drafting costs 0.4 ms per row and draft
COPY, PROSE = (0.95, 0.9, 0.9, 0.9), (0.1, 0.05, 0.05, 0.05)
MODEL = PerfModel(target=(10.0, 0.0, 0.0, 0.2, 0.0), propose={"ngram": (0.2, 0.0, 0.4)},
                  acceptance={"ngram": (0.5, 0.45, 0.45, 0.45), "ngram|copy": COPY,
                              "ngram|prose": PROSE},
                  tenant_factor={"copy": 1.5, "prose": 0.3})
CAP = Capacity(total_pages=4096, page_size=16, max_depth=4, depths=(1, 2, 4), spec_max_batch=32,
               proposers={"ngram": (0, 0)})
CONFIG = TunerConfig(ranges=(2, 4, 8, 16, 64))


def mixed(batches: dict[int, float], mix: dict[str, float]) -> Traffic:
    buckets = {b: dict(mix) for b in (1, 2, 4, 8, 16, 32, 64)}
    return Traffic(steps=1000, batch_weights=batches, prefill_per_step={}, concurrency=8.0,
                   concurrency_max=16, tenant_mix=dict(mix), bucket_mix=buckets)


def best_single(traffic: Traffic, model: PerfModel = MODEL) -> TunedPolicy:
    space = SearchSpace.build(CONFIG, CAP)
    policy = solve_splits(space, model, traffic, CAP)
    assert policy is not None
    return policy


def test_same_rule_for_every_tenant_prices_as_the_batch_rule() -> None:
    """A tenant rule equal to the batch rule changes nothing: the row-by-row price of a
    batch whose rows all draft alike is the model's step time exactly."""
    traffic = mixed({2: 0.3, 6: 0.7}, {"copy": 0.5, "prose": 0.5})
    base = TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8)
    same = dataclasses.replace(base, tenants=(TenantRule("copy", "ngram", 2, 8),
                                              TenantRule("prose", "ngram", 2, 8)))
    a, b = evaluate(base, MODEL, traffic, CAP), evaluate(same, MODEL, traffic, CAP)
    assert b.goodput == pytest.approx(a.goodput, rel=1e-9)
    assert b.per_batch[6] == pytest.approx(a.per_batch[6], rel=1e-9)


def test_each_row_runs_its_own_depth() -> None:
    """Batch 2 of copy (depth 4) and prose (no draft) rows, half each: a copy row runs 5 token
    rows, a prose row 1, so the step runs 2 * 3 on average (a padded verify ran every row of
    the three steps in four that hold a copy row at 5). The proposer costs p0 where any copy
    row drafts and 0.4 ms per copy row and draft."""
    pricer = Pricer(MODEL)
    ms = pricer.step_ms(2, [(0.5, "ngram", 4, pricer.drafts("ngram", 4, "copy")), (0.5, "none", 0, 0.0)])
    assert ms == pytest.approx(10 + 0.2 * 2 * 3 + 0.2 * 0.75 + 0.4 * 2 * 0.5 * 4)


def test_search_gives_the_copy_tenant_depth_and_prose_none() -> None:
    """Low load (batch 1-2), half copy, half prose: a single rule drafts for both or neither;
    per tenant, copy drafts deep and prose rows skip the verify and the proposer."""
    traffic = mixed({1: 0.6, 2: 0.4}, {"copy": 0.5, "prose": 0.5})
    base = best_single(traffic)
    space = SearchSpace.build(CONFIG, CAP)
    ruled, record = add_tenant_rules(base, space, MODEL, traffic, CAP, min_gain=0.03)
    assert record.chosen and record.method == "exact"
    assert ruled.choose_row(1, "copy") == ("ngram", 4)
    assert ruled.choose_row(1, "prose") == ("none", 0)
    gain = evaluate(ruled, MODEL, traffic, CAP).goodput / evaluate(base, MODEL, traffic, CAP).goodput
    assert gain == pytest.approx(1 + record.gain, rel=1e-9)
    assert gain > 1.03
    # exact: no assignment of the two tenants' options does better
    options = [None] + [(t, d, u) for t, d in [("none", 0), ("ngram", 1), ("ngram", 2),
                                               ("ngram", 4)] for u in (2,)]
    best = max(evaluate(with_tenants(base, {"copy": a, "prose": b}), MODEL, traffic, CAP).goodput
               for a, b in itertools.product(options, options))
    assert record.tenant_goodput == pytest.approx(best, rel=1e-9)


def test_no_tenant_rule_where_it_does_not_pay() -> None:
    """Tenants that draft alike: tenant rules cannot beat the single rule by the margin, so
    the single-rule optimum comes back unchanged (considering them costs nothing)."""
    alike = dataclasses.replace(MODEL, acceptance={"ngram": (0.6, 0.5, 0.5, 0.5)},
                                tenant_factor={})
    traffic = mixed({6: 0.5, 8: 0.5}, {"copy": 0.5, "prose": 0.5})
    base = best_single(traffic, alike)
    ruled, record = add_tenant_rules(base, SearchSpace.build(CONFIG, CAP), alike, traffic, CAP)
    assert ruled is base and not record.chosen
    assert record.tenant_goodput <= record.single_goodput * 1.03


def test_many_tenants_use_tpe_and_beat_the_single_rule() -> None:
    """Four tenants of different acceptance: the combinations exceed the exact limit, so
    coordinate ascent and Optuna's TPE search them; the result is at least the ascent's and
    gives the easiest tenant the deepest draft. Search time is recorded."""
    model = dataclasses.replace(MODEL, acceptance={
        **MODEL.acceptance, "ngram|code": (0.7, 0.6, 0.6, 0.6), "ngram|chat": (0.3, 0.2, 0.2, 0.2)})
    traffic = mixed({2: 0.3, 4: 0.4, 8: 0.3}, {"copy": 0.25, "code": 0.25, "chat": 0.25,
                                               "prose": 0.25})
    base = best_single(traffic, model)
    ruled, record = add_tenant_rules(base, SearchSpace.build(CONFIG, CAP), model, traffic, CAP,
                                     exact_limit=100, trials=24, seed=3)
    assert record.method == "tpe" and record.space > 100 and record.seconds > 0
    assert record.chosen and record.gain > 0.03
    copy, prose = ruled.choose_row(2, "copy"), ruled.choose_row(2, "prose")
    assert copy[1] >= prose[1]
    assert evaluate(ruled, model, traffic, CAP).goodput > evaluate(base, model, traffic, CAP).goodput


def test_with_tenants_raises_the_crossover_for_tenant_rows_only() -> None:
    base = TunedPolicy((BatchRule(2, "ngram", 2), BatchRule(8, "ngram", 1), BatchRule(64)),
                       crossover=2)
    p = with_tenants(base, {"copy": ("ngram", 4, 8)})
    assert p.crossover == 8
    assert p.choose_row(6, "copy") == ("ngram", 4)
    assert p.choose_row(6, "chat") == ("none", 0)  # rows without a rule stop where they did
    assert p.choose_row(2, "chat") == ("ngram", 2)


def _mixed_history(n: int, end: float, seed: int = 2) -> list:
    """Steps of batch 1-2 whose rows are copy (acceptance 0.9) or prose (0.1) requests, at
    random (technique, depth) cells, each step recording its row classes."""
    import random

    from engine.types import RowClass, StepStats
    from tests.tuner.synth import true_step_ms

    rng, rate, out = random.Random(seed), {"copy": 0.9, "prose": 0.1}, []
    for k in range(n):
        technique, depth = rng.choice([("none", 0), ("ngram", 1), ("ngram", 2), ("ngram", 4)])
        tenants = [rng.choice(("copy", "prose")) for _ in range(rng.choice((1, 1, 2)))]
        classes, per_pos = [], [0] * depth
        for tenant in sorted(set(tenants)):
            rows, pos = tenants.count(tenant), [0] * depth
            for _ in range(rows):
                for i in range(depth):
                    if rng.random() >= rate[tenant]:
                        break
                    pos[i] += 1
            per_pos = [a + b for a, b in zip(per_pos, pos)]
            classes.append(RowClass(tenant, technique, depth, rows, rows * depth, sum(pos), tuple(pos)))
        ms, propose = true_step_ms(technique, depth, len(tenants))
        out.append(StepStats(
            time=end - (n - k) * 0.01, batch_size=len(tenants), decode_tokens=len(tenants) + sum(per_pos),
            technique=technique, depth=depth, proposed=len(tenants) * depth, accepted=sum(per_pos),
            accepted_per_pos=tuple(per_pos), propose_ms=propose, step_ms=ms,
            tenants=tuple(sorted(set(tenants))), row_classes=tuple(classes)))
    return out


def test_a_retune_search_records_per_tenant_decisions(db, db_url: str) -> None:
    """Telemetry of mixed copy/prose batches: the search learns each tenant's acceptance from
    the row classes, gives copy a deep draft and prose none, and records the decision, its
    predicted gain over the best single-rule policy and its search time."""
    import time

    from engine.policy import NEVER
    from tests.tuner import synth
    from tests.tuner.conftest import CAPACITY, FAST
    from tuner.search import SearchJob, run_search

    now = time.time()
    synth.write(db, _mixed_history(1500, now))
    job = SearchJob(db_url, FAST, CAPACITY, NEVER, since=now - 3600, until=now + 1)
    outcome = run_search(job)
    record = outcome.tenants
    assert record is not None and record.chosen and record.gain > FAST.tenant_min_gain
    assert record.method in ("exact", "tpe") and record.seconds > 0
    assert outcome.best.choose_row(1, "copy") == ("ngram", 4)
    assert outcome.best.choose_row(1, "prose") == ("none", 0)
    assert outcome.predicted.goodput == pytest.approx(record.tenant_goodput, rel=1e-6)
    assert "prose" in {r["tenant"] for r in record.rules}  # copy may follow the batch rule
    # without tenant rules the same search keeps one rule for both
    plain = run_search(dataclasses.replace(job, config=dataclasses.replace(FAST, tenant_rules=False)))
    assert plain.tenants is None and not plain.best.tenants


def test_validation_tells_policies_apart_by_their_tenant_rules() -> None:
    """Two policies with the same batch rules but different tenant rules do not "choose the
    same": the replaced one's prediction is compared (here the candidate measured far below
    it, so it is rolled back); steps under tenant rules are the policy's own, not exploration."""
    from engine.types import StepStats
    from tuner.explore import is_exploration
    from tuner.validate import Verdict, against_replaced

    old = TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8, version=1)
    new = dataclasses.replace(old, version=2, tenants=(TenantRule("copy", "ngram", 4, 8),))
    own = [StepStats(batch_size=2, decode_tokens=2, step_ms=20.0, technique="ngram", depth=4,
                     policy_version=2) for _ in range(30)]
    verdict = against_replaced(Verdict("inconclusive", "no matched steps"), own, {2: (4.0, 10.0)},
                               {2: 1.0}, new, old)
    assert verdict.decision == "rollback" and verdict.baseline == "predicted"
    same = against_replaced(Verdict("inconclusive", "no matched steps"), own, {2: (4.0, 10.0)},
                            {2: 1.0}, new, dataclasses.replace(new, version=1))
    assert same.decision == "keep" and "chooses the same" in same.reason
    assert not is_exploration(new, 2, "ngram", 4) and is_exploration(old, 2, "ngram", 4)


def test_tenant_rules_that_need_more_verify_slots_get_a_wider_split() -> None:
    """The base lends 5 pages, enough for its depth-1 drafts of 2 sequences; a copy rule 4
    deep needs 8: the candidate is priced (and chosen) at the next split that lends them."""
    cap = dataclasses.replace(CAP, total_pages=100, page_size=1)
    base = TunedPolicy((BatchRule(2, "ngram", 1), BatchRule(64)), crossover=2, pool_split=0.05,
                       source="tuner")
    traffic = mixed({1: 0.6, 2: 0.4}, {"copy": 0.5, "prose": 0.5})
    assert evaluate(base, MODEL, traffic, cap).feasible
    ruled, record = add_tenant_rules(base, SearchSpace.build(CONFIG, cap), MODEL, traffic, cap)
    assert record.chosen and ruled.choose_row(1, "copy") == ("ngram", 4)
    assert ruled.pool_split == 0.1
    ev = evaluate(ruled, MODEL, traffic, cap)
    assert ev.feasible and ev.spec_pages_needed > 5
