"""Per-tenant drafting where the window holds none of a tenant's rows (tuner.tenant_fill)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.policy import BatchRule, TenantRule, TunedPolicy
from tests.tuner.test_tenants import CAP, CONFIG, COPY, MODEL, PROSE, best_single, mixed
from tuner.objective import evaluate
from tuner.space import SearchSpace
from tuner.tenant_fill import fill_tenant_rules

SPACE = SearchSpace.build(CONFIG, CAP)


def alone(tenant: str, batch: int):
    """Traffic of `tenant`'s rows only, all at `batch`."""
    return mixed({batch: 1.0}, {tenant: 1.0})


def test_a_busy_window_leaves_the_drain_to_each_tenants_own_acceptance() -> None:
    """Batch 16-24 of half copy (accepts 0.95), half prose (0.1): the batch rules fill batch
    1-8 with a draft priced on the mix; prose rows get "none" there, copy keeps drafting, and
    nothing changes at the observed sizes."""
    traffic = mixed({16: 0.5, 24: 0.5}, {"copy": 0.5, "prose": 0.5})
    base = best_single(traffic)
    assert base.choose(2)[0] == "ngram"  # the mix's fill drafts
    filled, rules = fill_tenant_rules(base, SPACE, MODEL, traffic, CAP)
    assert filled.choose_row(2, "prose") == ("none", 0)
    assert filled.choose_row(2, "copy")[0] == "ngram"
    assert rules and all(r["max_batch"] < 16 for r in rules)
    assert {r["tenant"] for r in rules} == {t.tenant for t in filled.tenants}
    assert all(filled.choose_row(b, t) == base.choose(b) for b in (16, 24) for t in ("copy", "prose"))
    assert evaluate(filled, MODEL, traffic, CAP).goodput == pytest.approx(
        evaluate(base, MODEL, traffic, CAP).goodput, rel=1e-12)
    assert (evaluate(filled, MODEL, traffic, CAP).spec_pages_needed
            <= evaluate(base, MODEL, traffic, CAP).spec_pages_needed)
    # the prose rows of the drain run faster alone, the copy rows no slower
    for b in (1, 2, 4):
        prose, copy = alone("prose", b), alone("copy", b)
        assert evaluate(filled, MODEL, prose, CAP).goodput > evaluate(base, MODEL, prose, CAP).goodput
        kept = evaluate(base, MODEL, copy, CAP).goodput
        assert evaluate(filled, MODEL, copy, CAP).goodput >= kept * (1 - 1e-9)


def test_nothing_below_the_smallest_observed_batch_size_no_rules() -> None:
    traffic = mixed({1: 0.5, 24: 0.5}, {"copy": 0.5, "prose": 0.5})
    base = best_single(traffic)
    assert fill_tenant_rules(base, SPACE, MODEL, traffic, CAP) == (base, [])


def test_a_fill_that_drafts_nothing_gets_no_rules() -> None:
    traffic = mixed({16: 0.5, 24: 0.5}, {"copy": 0.5, "prose": 0.5})
    never_below = TunedPolicy((BatchRule(8), BatchRule(64)), crossover=0)
    assert fill_tenant_rules(never_below, SPACE, MODEL, traffic, CAP) == (never_below, [])


def test_a_tenant_with_a_rule_keeps_it_and_others_get_theirs() -> None:
    traffic = mixed({16: 0.4, 24: 0.4}, {"copy": 0.4, "prose": 0.4, "chat": 0.2})
    base = best_single(traffic)
    ruled = dataclasses.replace(base, tenants=(TenantRule("prose", "ngram", 1, 2),))
    filled, rules = fill_tenant_rules(ruled, SPACE, MODEL, traffic, CAP)
    assert filled.tenants[0] == TenantRule("prose", "ngram", 1, 2)
    assert "prose" not in {r["tenant"] for r in rules}
    assert len({t.tenant for t in filled.tenants}) == len(filled.tenants)


def test_rules_stay_within_the_techniques_and_depth_the_fill_drafts_with() -> None:
    """A fill of n-gram at depth 2 (copy could go deeper): copy's rule, if any, is no deeper,
    so the policy needs no more speculation pages than its split lends."""
    traffic = mixed({16: 0.5, 24: 0.5}, {"copy": 0.5, "prose": 0.5})
    shallow = TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8)
    filled, _ = fill_tenant_rules(shallow, SPACE, MODEL, traffic, CAP)
    assert filled.choose_row(2, "prose") == ("none", 0)
    assert all(t.depth <= 2 and t.technique in ("ngram", "none") for t in filled.tenants)


@pytest.mark.parametrize("mix", [{"copy": 1.0}, {"copy": 0.995, "prose": 0.005}], ids=["none", "few"])
def test_a_known_tenant_the_window_did_not_serve_gets_its_own_cell_everywhere(mix) -> None:
    """A window at batch 1-2 of copy rows (and a few prose rows, below MIN_SHARE): the batch
    rules draft deep for copy. Prose, measured in the fit window, gets "none" there: its
    acceptance (0.1) says drafting loses. Nothing below batch 1, so copy gets no rule."""
    traffic = mixed({1: 0.5, 2: 0.5}, mix)
    base = best_single(traffic)
    assert base.choose(2) == ("ngram", 4) and base.choose_row(2, "prose") == ("ngram", 4)
    filled, rules = fill_tenant_rules(base, SPACE, MODEL, traffic, CAP)
    assert [r["tenant"] for r in rules] == ["prose"]
    assert filled.choose_row(1, "prose") == filled.choose_row(2, "prose") == ("none", 0)
    assert filled.choose_row(2, "copy") == ("ngram", 4)
    # the few prose rows the window holds now run one token row each instead of five
    assert evaluate(filled, MODEL, traffic, CAP).goodput == pytest.approx(
        evaluate(base, MODEL, traffic, CAP).goodput, rel=2e-3 if "prose" in mix else 1e-12)
    prose = alone("prose", 2)
    assert evaluate(filled, MODEL, prose, CAP).goodput > evaluate(base, MODEL, prose, CAP).goodput
    # a model that knows no prose tenant leaves the policy as it is
    blind = dataclasses.replace(MODEL, acceptance={"ngram": MODEL.acceptance["ngram"], "ngram|copy": COPY},
                                tenant_factor={"copy": 1.5})
    assert fill_tenant_rules(base, SPACE, blind, traffic, CAP) == (base, [])


def test_a_tenant_the_model_has_not_measured_gets_no_rule() -> None:
    """Chat is served (a fifth of the window) but has no acceptance of its own and no factor:
    its rates are the no-credit prior, which says "none"; a rule from that would keep its
    rows from ever drafting below the observed sizes, so it follows the batch rules."""
    traffic = mixed({16: 0.5, 24: 0.5}, {"copy": 0.4, "prose": 0.4, "chat": 0.2})
    base = best_single(traffic)
    _, rules = fill_tenant_rules(base, SPACE, MODEL, traffic, CAP)
    assert {r["tenant"] for r in rules} == {"prose", "copy"}
    measured = dataclasses.replace(MODEL, acceptance={**MODEL.acceptance, "ngram|chat": PROSE})
    _, rules = fill_tenant_rules(base, SPACE, measured, traffic, CAP)
    assert {"prose", "chat"} <= {r["tenant"] for r in rules}
