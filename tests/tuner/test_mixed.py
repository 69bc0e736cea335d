"""Rows that draft differently in one step: the fit counts the token rows each row ran, the
pricer the rows a batch of several tenants' rows would run (tuner.mixed)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from engine.policy import BatchRule, TenantRule, TunedPolicy
from engine.types import RowClass, StepStats
from tuner.capacity import Capacity
from tuner.mixed import Pricer
from tuner.model import PerfModel
from tuner.objective import evaluate
from tuner.traffic import Traffic

T0, T1, T3 = 12.0, 0.4, 1.5
"""The synthetic target: T0 a call, T1 a sequence read, T3 a token row run."""


def _step(batch: int, plain: int, rng: np.random.Generator) -> StepStats:
    """A step of `batch` decode rows, `plain` of them drafting nothing and the rest 4 each at
    depth 4: the drafting rows run 5 token rows, the plain ones 1 (engine/step/ragged_step.py)."""
    drafting = batch - plain
    classes = tuple(c for c in (RowClass("copy", "ngram", 4, drafting, 4 * drafting),
                                RowClass("prose", "none", 0, plain)) if c.rows)
    ms = (T0 + T1 * batch + T3 * (plain + 5 * drafting)) * rng.uniform(0.99, 1.01)
    return StepStats(batch_size=batch, decode_tokens=batch, technique="ngram", depth=4,
                     proposed=4 * drafting, accepted_per_pos=(0,) * 4, step_ms=ms,
                     row_classes=classes, plain_rows=plain)


def _steps() -> list[StepStats]:
    rng = np.random.default_rng(5)
    plain = [StepStats(batch_size=b, decode_tokens=b, step_ms=(T0 + (T1 + T3) * b) * rng.uniform(0.99, 1.01))
             for b in range(1, 9) for _ in range(3)]
    return plain + [_step(b, k, rng) for b in range(2, 9) for k in range(b) for _ in range(2)]


def test_the_fit_recovers_the_cost_per_token_row_from_steps_of_mixed_rows() -> None:
    """Steps cost T0 + T1 per sequence + T3 per token row; their plain rows ran one row each,
    not the verify depth. Counting the rows each row ran recovers T3 and predicts every step;
    reading every row at the step's depth (the padded engine's verify) does not."""
    steps = _steps()
    model = PerfModel.fit(steps)
    assert model.target[3] == pytest.approx(T3, rel=0.03)
    assert model.target[0] == pytest.approx(T0, rel=0.1)
    assert model.error_report(steps).step_ms_p90_ape < 0.02
    assert model.max_rows == 8 * 5

    padded = [dataclasses.replace(s, proposed=4 * s.batch_size, row_classes=()) if s.depth else s
              for s in steps]
    naive = PerfModel.fit(padded)
    assert abs(naive.target[3] - T3) / T3 > 0.1
    assert naive.error_report(steps).step_ms_p90_ape > 0.1


# -- the pricer -----------------------------------------------------------------------------

MODEL = PerfModel(target=(10.0, 0.0, 0.0, 0.2, 0.0), propose={"ngram": (0.2, 0.0, 0.4)},
                  acceptance={"ngram": (0.5, 0.45, 0.45, 0.45)})


def test_pricer_by_hand() -> None:
    """Batch 2, half the rows plain, half n-gram@4: each row runs its own rows, 1 or 5, so the
    step runs 2 * (0.5 * 1 + 0.5 * 5) = 6 token rows on average; the proposer costs p0 where
    any row drafts and 0.4 ms per row and draft."""
    rows = [(0.5, "ngram", 4, 4.0), (0.5, "none", 0, 0.0)]
    proposer = 0.2 * 0.75 + 0.4 * 2 * 0.5 * 4
    assert Pricer(MODEL).step_ms(2, rows) == pytest.approx(10 + 0.2 * 6 + proposer)
    # rows that find drafts for half of them (a draft share of 0.5) run 1 + 2 on average
    half = [(0.5, "ngram", 4, 2.0), (0.5, "none", 0, 0.0)]
    assert Pricer(MODEL).step_ms(2, half) == pytest.approx(10 + 0.2 * 4 + proposer)


def test_pricer_drafts_follow_each_tenants_draft_share() -> None:
    model = dataclasses.replace(MODEL, draft_share={"ngram": 0.5, "ngram|copy": 1.0})
    pricer = Pricer(model)
    assert (pricer.drafts("ngram", 4, "copy"), pricer.drafts("ngram", 4, "chat")) == (4.0, 2.0)
    assert pricer.drafts("ngram", 4, "chat", hold=0.25) == 1.0  # a lent-KV hold replaces it
    assert pricer.drafts("none", 0, "copy") == 0.0
    # one choice for every row: the model's own prediction at its pooled share
    assert pricer.step_ms(4, [(1.0, "ngram", 4, pricer.drafts("ngram", 4, None))]) == pytest.approx(
        model.predict_step_ms("ngram", 4, 4))


def test_pricer_matches_every_assignment_of_rows() -> None:
    """Batch 3 over three tenants (none, n-gram@2, n-gram@4): the pricer equals the mean over
    all 27 assignments of rows to tenants, each at the token rows it runs, where the forward
    is linear in the rows; with t5 > 0 it prices the mean rows, t5 * B * Var(rows of a row)
    below that mean."""
    rows = [(0.5, "none", 0, 0.0), (0.3, "ngram", 2, 2.0), (0.2, "ngram", 4, 4.0)]
    proposer = 0.2 * (1 - 0.5 ** 3) + 0.4 * 3 * (0.3 * 2 + 0.2 * 4)

    def enumerated(model: PerfModel) -> float:
        total = 0.0
        for pick in itertools.product(rows, repeat=3):
            total += math.prod(w for w, *_ in pick) * model.forward_ms(3, sum(1 + n for *_, n in pick))
        return total + proposer

    assert Pricer(MODEL).step_ms(3, rows) == pytest.approx(enumerated(MODEL), rel=1e-12)
    convex = dataclasses.replace(MODEL, rows_sq=0.01)
    mean = 0.5 * 1 + 0.3 * 3 + 0.2 * 5
    var = 0.5 * 1 + 0.3 * 9 + 0.2 * 25 - mean ** 2
    assert Pricer(convex).step_ms(3, rows) == pytest.approx(enumerated(convex) - 0.01 * 3 * var, rel=1e-12)


# -- tenant rules in the objective ----------------------------------------------------------

def test_a_plain_tenant_beside_a_deep_one_costs_its_own_rows() -> None:
    """Copy rows drafting at depth 4 beside prose rows that draft nothing: the prose rows run
    one token row each, so the tenant rules beat n-gram@2 for every row, which pays the prose
    rows' drafts and emits little for them."""
    cap = Capacity(total_pages=4096, page_size=16, max_depth=4, spec_max_batch=32,
                   proposers={"ngram": (0, 0)})
    mix = {"copy": 0.5, "prose": 0.5}
    traffic = Traffic(steps=1000, batch_weights={2: 0.3, 4: 0.4, 8: 0.3}, prefill_per_step={},
                      concurrency=8.0, concurrency_max=16, tenant_mix=dict(mix),
                      bucket_mix={b: dict(mix) for b in (1, 2, 4, 8, 16, 32, 64)})
    model = dataclasses.replace(MODEL, acceptance={"ngram": (0.5, 0.45, 0.45, 0.45),
                                                   "ngram|copy": (0.95, 0.9, 0.9, 0.9),
                                                   "ngram|prose": (0.1, 0.05, 0.05, 0.05)})
    base = TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8)
    ruled = dataclasses.replace(base, tenants=(TenantRule("copy", "ngram", 4, 8),
                                               TenantRule("prose", "none", 0, 8)))
    plain_rows = evaluate(ruled, model, traffic, cap)
    batch_rule = evaluate(base, model, traffic, cap)
    assert plain_rows.goodput > 1.05 * batch_rule.goodput
    for batch, (_, ms) in plain_rows.per_batch.items():  # rows 0.5 * 1 + 0.5 * 5 a row on average
        proposer = 0.2 * (1 - 0.5 ** batch) + 0.4 * batch * 0.5 * 4
        assert ms == pytest.approx(10 + 0.2 * batch * 3 + proposer), batch
