"""Segmented verifies in the tuner: the fit counts the rows a step ran, the pricer the rows a
batch would run (plain rows beside the drafting rows' verify, engine.types.segment_split)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np
import pytest

from engine.policy import BatchRule, TenantRule, TunedPolicy
from engine.types import RowClass, StepStats, segment_split
from tuner.config import TunerConfig
from tuner.mixed import Pricer
from tuner.model import PerfModel
from tuner.objective import Capacity, evaluate, padding_of
from tuner.shapes import Padding
from tuner.space import SearchSpace
from tuner.tenants import add_tenant_rules
from tuner.traffic import Traffic

PAD = Padding(batch=(1, 2, 4, 8), query=(1, 2, 3, 5))
T0, T1, T3 = 12.0, 0.4, 1.5
"""The synthetic target: T0 a call, T1 a cache row read, T3 a row run."""


def _step(batch: int, plain: int, rng: np.random.Generator) -> StepStats:
    """A depth-4 step of `batch` decode rows, `plain` of them drafting nothing; segmented
    (plain_rows = plain) where the engine would run it so with every shape compiled."""
    drafting = batch - plain
    classes = tuple(c for c in (RowClass("copy", "ngram", 4, drafting, 4 * drafting),
                                RowClass("prose", "none", 0, plain)) if c.rows)
    every = {(p, v, 5) for p in PAD.batch for v in PAD.batch}
    segmented = segment_split(plain, drafting, 5, PAD.batch, every) is not None
    read, rows = PAD.ran(StepStats(batch_size=batch, depth=4, row_classes=classes,
                                   plain_rows=plain if segmented else 0))
    ms = (T0 + T1 * read + T3 * rows) * rng.uniform(0.99, 1.01)
    return StepStats(batch_size=batch, decode_tokens=batch, technique="ngram", depth=4,
                     proposed=4 * drafting, accepted_per_pos=(0,) * 4, step_ms=ms,
                     row_classes=classes, plain_rows=plain if segmented else 0)


def _steps() -> list[StepStats]:
    rng = np.random.default_rng(5)
    plain = [StepStats(batch_size=b, decode_tokens=b, step_ms=(T0 + (T1 + T3) * PAD.pad(b, 1)[0])
                       * rng.uniform(0.99, 1.01)) for b in range(1, 9) for _ in range(3)]
    return plain + [_step(b, k, rng) for b in range(2, 9) for k in range(b) for _ in range(2)]


def test_ran_counts_the_rows_each_segment_ran() -> None:
    classes = (RowClass("copy", "ngram", 4, 3), RowClass("prose", "none", 0, 3))
    segmented = StepStats(batch_size=6, depth=4, row_classes=classes, plain_rows=3)
    assert PAD.ran(segmented) == (8, 4 + 4 * 5)  # plain 3 -> 4, drafting 3 -> 4
    assert PAD.ran(dataclasses.replace(segmented, plain_rows=0)) == (8, 8 * 5)


def test_the_fit_recovers_the_cost_per_row_run_from_segmented_steps() -> None:
    """Steps cost T0 + T1 per cache row + T3 per row run; segmented ones ran fewer rows than
    their batch at the verify depth. Counting the rows they ran recovers T3 and predicts every
    step; reading them as padded verifies (plain_rows ignored, as before segments) does not."""
    steps = _steps()
    assert sum(s.plain_rows > 0 for s in steps) >= 30
    model = PerfModel.fit(steps, buckets=PAD)
    assert model.target[3] == pytest.approx(T3, rel=0.03)
    assert model.target[0] == pytest.approx(T0, rel=0.1)
    assert model.error_report(steps).step_ms_p90_ape < 0.02
    assert model.max_rows == 8 * 5

    naive_steps = [dataclasses.replace(s, plain_rows=0) for s in steps]
    naive = PerfModel.fit(naive_steps, buckets=PAD)
    assert abs(naive.target[3] - T3) / T3 > 0.1
    assert naive.error_report(naive_steps).step_ms_p90_ape > 0.1


def test_predictions_run_plain_rows_in_a_segment_where_one_is_compiled() -> None:
    model = PerfModel(target=(T0, T1, 0.0, T3, 0.0), padding=dataclasses.replace(
        PAD, segments=frozenset({(4, 4, 5)})))
    padded = T0 + T1 * 8 + T3 * 8 * 5
    assert model.predict_step_ms("none", 4, 6) == pytest.approx(padded)
    assert model.predict_step_ms("none", 4, 6, plain=3) == pytest.approx(T0 + T1 * 8 + T3 * 24)
    assert model.predict_step_ms("none", 4, 6, plain=1) == pytest.approx(padded)  # (1, 5): no shape
    assert model.predict_step_ms("none", 2, 6, plain=3) == model.predict_step_ms("none", 2, 6)  # q 3


# -- the pricer -----------------------------------------------------------------------------

MODEL = PerfModel(target=(10.0, 0.0, 0.0, 0.2, 0.0), propose={"ngram": (0.2, 0.0, 0.4)},
                  acceptance={"ngram": (0.5, 0.45, 0.45, 0.45)},
                  padding=Padding((1, 2, 4), (1, 2, 3, 5)))
SEGMENTED = dataclasses.replace(MODEL, padding=dataclasses.replace(
    MODEL.padding, segments=frozenset({(1, 1, 5), (1, 2, 5), (2, 1, 5), (2, 2, 3)})))


def test_pricer_with_segments_by_hand() -> None:
    """Batch 2, half the rows plain, half n-gram@4 (q 5), shape (1, 1, 5): a quarter of the
    steps decode 2 rows, half run 1 + 1 * 5 rows segmented, a quarter 2 * 5 padded; the
    proposer costs p0 where any row drafts and 0.4 ms per row and draft."""
    rows = [(0.5, "ngram", 4), (0.5, "none", 0)]
    plain, segmented, padded = 10 + 0.2 * 2, 10 + 0.2 * 6, 10 + 0.2 * 10
    proposer = 0.2 * 0.75 + 0.4 * 2 * 0.5 * 4
    assert Pricer(SEGMENTED).step_ms(2, rows) == pytest.approx(
        0.25 * plain + 0.5 * segmented + 0.25 * padded + proposer)
    assert Pricer(MODEL).step_ms(2, rows) == pytest.approx(0.25 * plain + 0.75 * padded + proposer)


def test_pricer_with_segments_matches_every_assignment_of_rows() -> None:
    """Batch 3 over three tenants (none, n-gram@2, n-gram@4): the binomial enumeration equals
    the sum over all 27 assignments of rows to tenants, each at the rows the engine runs."""
    rows = [(0.5, "none", 0), (0.3, "ngram", 2), (0.2, "ngram", 4)]
    target = 0.0
    for pick in itertools.product(rows, repeat=3):
        depth, plain = max(d for _, _, d in pick), sum(d == 0 for _, _, d in pick)
        target += math.prod(w for w, _, _ in pick) * SEGMENTED.predict_step_ms(
            "none", depth, 3, plain=plain)
    proposer = 0.2 * (1 - 0.5 ** 3) + 0.4 * 3 * (0.3 * 2 + 0.2 * 4)
    assert Pricer(SEGMENTED).step_ms(3, rows) == pytest.approx(target + proposer, rel=1e-12)
    assert Pricer(SEGMENTED).step_ms(3, rows) < Pricer(MODEL).step_ms(3, rows) - 0.5


def test_pricer_without_segments_is_the_padded_formula() -> None:
    """No segments, or a batch no segment shape holds: every row at the deepest row's depth,
    P(max depth <= d) = (weight of depths <= d)^B, as before segments."""
    rows = [(0.5, "none", 0), (0.3, "ngram", 2), (0.2, "ngram", 4)]
    for model, batch in ((MODEL, 1), (MODEL, 3), (MODEL, 7), (SEGMENTED, 5), (SEGMENTED, 9)):
        target = sum(((0.5 + 0.3 * (d >= 2) + 0.2 * (d >= 4)) ** batch
                      - ((0.5 if d else 0.0) + 0.3 * (d > 2)) ** batch)
                     * model.predict_step_ms("none", d, batch) for d in (0, 2, 4))
        proposer = 0.2 * (1 - 0.5 ** batch) + 0.4 * batch * (0.3 * 2 + 0.2 * 4)
        assert Pricer(model).step_ms(batch, rows) == pytest.approx(target + proposer, rel=1e-12)


# -- capacity to search ---------------------------------------------------------------------

def test_segment_shapes_reach_the_models_padding() -> None:
    cap = Capacity(64, 16, depths=(1, 2, 4), batch_buckets=(1, 2, 4),
                   segment_shapes=((1, 1, 5), (2, 2, 5)))
    assert padding_of(cap).segments == frozenset({(1, 1, 5), (2, 2, 5)})
    assert PerfModel(target=(1, 0, 0, 0, 0), padding=padding_of(cap)).summary()["segments"] == [
        [1, 1, 5], [2, 2, 5]]


def test_a_tenant_search_with_segments_stays_fast_and_prices_them() -> None:
    """Four tenants at batch 2-8 (search.py's tenant step, TPE beyond the exact limit): with
    every segment shape compiled the search takes about as long as without, and a copy tenant
    drafting deep beside prose that does not is priced cheaper."""
    cap = Capacity(total_pages=4096, page_size=16, max_depth=4, depths=(1, 2, 4),
                   spec_max_batch=32, batch_buckets=(1, 2, 4, 8, 16, 32, 64),
                   proposers={"ngram": (0, 0)})
    shapes = tuple((p, v, q) for p in (1, 2, 4) for v in (1, 2, 4) for q in (2, 3, 5))
    segmented_cap = dataclasses.replace(cap, segment_shapes=shapes)
    mix = {"copy": 0.25, "code": 0.25, "chat": 0.25, "prose": 0.25}
    traffic = Traffic(steps=1000, batch_weights={2: 0.3, 4: 0.4, 8: 0.3}, prefill_per_step={},
                      concurrency=8.0, concurrency_max=16, tenant_mix=dict(mix),
                      bucket_mix={b: dict(mix) for b in (1, 2, 4, 8, 16, 32, 64)})
    acceptance = {"ngram": (0.5, 0.45, 0.45, 0.45), "ngram|copy": (0.95, 0.9, 0.9, 0.9),
                  "ngram|code": (0.7, 0.6, 0.6, 0.6), "ngram|chat": (0.3, 0.2, 0.2, 0.2),
                  "ngram|prose": (0.1, 0.05, 0.05, 0.05)}
    base = TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8)
    space = SearchSpace.build(TunerConfig(ranges=(2, 4, 8, 16, 64)), cap)
    ruled = dataclasses.replace(base, tenants=(TenantRule("copy", "ngram", 4, 8),
                                               TenantRule("prose", "none", 0, 8)))
    seconds, goodput = {}, {}
    for name, c in (("padded", cap), ("segmented", segmented_cap)):
        model = PerfModel(target=(10.0, 0.0, 0.0, 0.2, 0.0), propose={"ngram": (0.2, 0.0, 0.4)},
                          acceptance=acceptance, padding=padding_of(c))
        start = time.perf_counter()
        _, record = add_tenant_rules(base, space, model, traffic, c, exact_limit=100, trials=24,
                                     seed=3)
        seconds[name] = time.perf_counter() - start
        assert record.method == "tpe" and record.chosen
        goodput[name] = evaluate(ruled, model, traffic, c).goodput
    assert goodput["segmented"] > 1.01 * goodput["padded"]  # prose rows beside copy@4 run plain
    assert seconds["segmented"] < 2.0 * seconds["padded"] + 0.2
