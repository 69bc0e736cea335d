"""Small-sample acceptance rates shrink toward their pool; many samples give the data."""

from __future__ import annotations

import pytest

from engine.types import StepStats
from tuner.acceptance import MIN_REACHED, PRIOR_OFFERS, fit_acceptance, tenant_factors
from tuner.data import RequestRow
from tuner.model import PerfModel


def spec(tenant: str, offered: int, accepted: int, depth: int = 1,
         deeper: tuple[int, ...] = ()) -> StepStats:
    """One decode step of `offered` drafting rows of one tenant, `accepted` at position 0."""
    per_pos = (accepted, *deeper) + (0,) * (depth - 1 - len(deeper))
    return StepStats(batch_size=offered, decode_tokens=offered + sum(per_pos), technique="ngram",
                     depth=depth, proposed=offered * depth, accepted_per_pos=per_pos,
                     propose_ms=0.1, step_ms=10.0, tenants=(tenant,))


POOLED = [spec("bulk", 20, 8)] * 10  # 200 offers at 0.4


def test_a_technique_seen_three_times_is_not_credited_100_percent() -> None:
    rates = fit_acceptance([spec("a", 3, 3)], {})
    assert rates["ngram"][0] < 0.85  # the raw 3/3 was taken as MAX_RATE (0.99)
    # next to a well-measured technique, a rarely tried one shrinks toward it
    mtp = StepStats(batch_size=3, decode_tokens=6, technique="mtp", depth=1, proposed=3,
                    accepted_per_pos=(3,), propose_ms=0.1, step_ms=10.0)
    both = fit_acceptance([*POOLED, mtp], {})
    assert both["mtp"][0] < 0.7 and both["ngram"][0] == pytest.approx(0.4, abs=0.01)


def test_a_tenant_with_few_drafts_is_shrunk_toward_the_pooled_rate() -> None:
    # 3 drafts, all accepted: too few for own rates, the tenant gets the pooled ones
    few = PerfModel.fit([*POOLED, spec("rare", 3, 3)])
    assert "ngram|rare" not in few.acceptance
    assert few.rates("ngram", 1, "rare")[0] < 0.5
    # just past MIN_REACHED and all accepted: own rates, but not 100 % on 12 drafts
    some = PerfModel.fit([*POOLED, spec("rare", MIN_REACHED + 2, MIN_REACHED + 2)])
    pooled = some.acceptance["ngram"][0]
    own = some.rates("ngram", 1, "rare")[0]
    assert own == pytest.approx((12 + PRIOR_OFFERS * pooled) / (12 + PRIOR_OFFERS))
    assert pooled < own < 0.85
    # with many samples the estimate converges to the observed rate (0.9)
    many = PerfModel.fit([*POOLED, *[spec("rare", 20, 18)] * 100])
    assert many.rates("ngram", 1, "rare")[0] == pytest.approx(0.9, abs=0.005)


def test_a_rarely_reached_position_shrinks_toward_the_pooled_position() -> None:
    # the pool accepts position 1 at 0.2 (16 of 80 reached); a tenant reached position 1
    # only 3 times and accepted all three: its position-1 rate stays near the pool's
    pool = [spec("bulk", 20, 8, depth=2, deeper=(2,))] * 10
    tenant = [spec("rare", 20, 1, depth=2, deeper=(1,))] * 3
    model = PerfModel.fit([*pool, *tenant])
    pooled = model.acceptance["ngram"][1]
    own = model.rates("ngram", 2, "rare")[1]
    assert own == pytest.approx((3 + PRIOR_OFFERS * pooled) / (3 + PRIOR_OFFERS))
    assert 0.1 < own < 0.6  # not 3/3, nor position 0's 3/60 (the rule before shrinkage)


def test_tenant_factors_shrink_toward_the_overall_rate() -> None:
    def req(tenant: str, proposed: int, accepted: int) -> RequestRow:
        return RequestRow(tenant, 40, 60, 0.0, 1.0, proposed, accepted)

    base = [req("bulk", 1000, 500)]
    lucky = tenant_factors([*base, req("lucky", MIN_REACHED, MIN_REACHED)])
    overall = (500 + MIN_REACHED) / (1000 + MIN_REACHED)
    expected = (MIN_REACHED + PRIOR_OFFERS * overall) / (MIN_REACHED + PRIOR_OFFERS) / overall
    assert lucky["lucky"] == pytest.approx(expected)
    assert lucky["lucky"] < 1.75  # the raw 10/10 over ~0.5 hit the factor cap, 2.0
    big = tenant_factors([*base, req("steady", 100_000, 80_000)])
    overall = 80_500 / 101_000
    assert big["steady"] == pytest.approx(0.8 / overall, rel=0.001)
