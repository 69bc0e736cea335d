"""Per-tenant rules of a TunedPolicy: validated, round-tripped, chosen per row, refused by both
engines when they cannot serve them; and the fake engine's per-row speculation."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import (
    BatchRule,
    Exploration,
    PolicyError,
    TenantRule,
    TunedPolicy,
    check_servable,
    speculates_up_to,
)
from engine.step.chooser import StepChooser
from engine.types import Request, RowClass, SamplingParams

GOOD = {"rules": [{"max_batch": 8, "technique": "ngram", "depth": 2}, {"max_batch": 64}], "crossover": 8,
        "tenants": [{"tenant": "copy", "technique": "mtp", "depth": 4},
                    {"tenant": "chat", "technique": "none", "depth": 0, "max_batch": 4}]}


def tenant(i: int, **changes: object) -> dict:
    body = copy.deepcopy(GOOD)
    body["tenants"][i].update(changes)
    return body


@pytest.mark.parametrize(("body", "field"), [
    (tenant(1, depth=2), "tenants[1].depth"),  # depth with technique "none"
    (tenant(0, depth=0), "tenants[0].depth"),  # a technique with no depth
    (tenant(0, depth=2.5), "tenants[0].depth"),
    (tenant(0, depth=9), "tenants[0].depth"),
    (tenant(0, technique="magic"), "tenants[0].technique"),
    (tenant(1, max_batch=0), "tenants[1].max_batch"),
    (tenant(0, tenant=""), "tenants[0].tenant"),
    (tenant(0, tenant=7), "tenants[0].tenant"),
    (tenant(0, tenant="x" * 129), "tenants[0].tenant"),
    (tenant(1, tenant="copy"), "tenants[1].tenant"),  # one rule per tenant
    (tenant(0, speed=3), "tenants[0].speed"),
    ({**GOOD, "tenants": [{"technique": "ngram", "depth": 1}]}, "tenants[0].tenant"),
    ({**GOOD, "tenants": "copy"}, "tenants"),
    ({**GOOD, "tenants": [3]}, "tenants[0]"),
])
def test_bad_tenant_rules_are_refused_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(PolicyError) as refused:
        TunedPolicy.from_dict(body)
    assert refused.value.field == field, str(refused.value)


def test_tenant_rules_round_trip_and_a_policy_without_them_keeps_its_body() -> None:
    policy = TunedPolicy.from_dict(GOOD)
    assert policy.tenants == (TenantRule("copy", "mtp", 4), TenantRule("chat", max_batch=4))
    body = policy.to_dict()
    assert body["tenants"] == [{"tenant": "copy", "technique": "mtp", "depth": 4, "max_batch": 1 << 30},
                               {"tenant": "chat", "technique": "none", "depth": 0, "max_batch": 4}]
    assert TunedPolicy.from_dict(body) == policy
    assert TunedPolicy.from_dict({**body, "tenants": tuple(body["tenants"])}) == policy
    assert "tenants" not in TunedPolicy().to_dict()
    with pytest.raises(PolicyError, match="tenants"):
        TunedPolicy(tenants=({"tenant": "a"},))
    with pytest.raises(PolicyError, match="depth"):
        TenantRule("a", "ngram", 0)


def test_choose_row_follows_the_tenant_rule_within_its_batch_sizes_and_the_crossover() -> None:
    policy = TunedPolicy.from_dict(GOOD)
    assert policy.choose_row(3, "copy") == ("mtp", 4)
    assert policy.choose_row(3, "chat") == ("none", 0)  # its rule: no drafts
    assert policy.choose_row(6, "chat") == ("ngram", 2)  # above its max_batch: the batch rule
    assert policy.choose_row(3, "prose") == ("ngram", 2) == policy.choose(3)
    assert policy.choose_row(9, "copy") == ("none", 0)  # above the crossover nothing drafts
    assert policy.techniques() == {"ngram", "mtp"} and policy.max_depth == 4
    only_tenants = TunedPolicy((BatchRule(64),), crossover=4, tenants=(TenantRule("copy", "ngram", 3, 2),))
    assert speculates_up_to(only_tenants) == 2 and only_tenants.choose(2) == ("none", 0)


def test_both_engines_refuse_tenant_rules_they_cannot_serve_naming_the_rule() -> None:
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram")}, max_depth=4)
    for body, field in [(tenant(0, technique="ngram", depth=6), "tenants[0].depth"),
                        (GOOD, "tenants[0].technique")]:  # mtp is not loaded
        policy = TunedPolicy.from_dict(body)
        with pytest.raises(PolicyError) as refused:
            check_servable(policy, engine.capacity())
        assert refused.value.field == field, str(refused.value)
        with pytest.raises(PolicyError):
            engine.set_policy(policy)
    engine.set_policy(TunedPolicy.from_dict(tenant(0, technique="ngram", depth=4)))


def test_the_chooser_explores_only_rows_without_a_tenant_rule() -> None:
    chooser = StepChooser(np.random.default_rng(0), spec_max_batch=6)
    rules = (BatchRule(8, "ngram", 2), BatchRule(64))
    chooser.start(TunedPolicy(rules, crossover=8, tenants=(TenantRule("copy", "mtp", 4),),
                              explore=Exploration(1.0, ("ngram",), (1, 2, 3))))
    rows = [chooser.choose_rows(["copy", "chat", "copy"]) for _ in range(100)]
    assert all(r[0] == r[2] == ("mtp", 4) for r in rows)
    assert {r[1] for r in rows} == {("ngram", 1), ("ngram", 3)}  # always a neighbour of depth 2
    assert chooser.choose_rows(["copy"] * 7) == [("none", 0)] * 7  # above spec_max_batch
    chooser.ready = lambda technique: technique != "mtp"  # its shapes still compiling
    assert chooser.choose_rows(["copy", "chat"])[0] == ("none", 0)


def _fake_step(engine: FakeEngine, tenants: list[str]):
    for i, t in enumerate(tenants):
        engine.add_request(Request(f"{t}{i}", engine.tokenizer.encode("abcdefgh"),
                                   SamplingParams(max_tokens=40, ignore_eos=True), tenant=t))
    return engine.step()


def test_fake_rows_draft_each_with_their_tenants_choice() -> None:
    cost = FakeCost()
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (1.0,)),
                                   "mtp": FakeProposer("mtp", (1.0,))},
                        cost=cost, max_depth=4)
    engine.set_policy(TunedPolicy.from_dict(GOOD))
    out = _fake_step(engine, ["copy", "chat", "prose", "prose"])
    stats = out.stats
    assert stats.row_classes == (RowClass("chat", "none", 0, 1),
                                 RowClass("copy", "mtp", 4, 1, 4, 4, (1, 1, 1, 1)),
                                 RowClass("prose", "ngram", 2, 2, 4, 4, (2, 2)))
    assert [len(e.token_ids) for e in out.events] == [5, 1, 3, 3]  # every draft accepted
    assert (stats.technique, stats.depth) == ("ngram", 4)  # the most drafting rows; the deepest
    assert (stats.proposed, stats.accepted, stats.accepted_per_pos) == (8, 8, (3, 3, 1, 1))
    assert (stats.step_ms, stats.propose_ms) == cost.times(4, 4, 0, drafts=8)
    assert stats.decode_tokens == 12
    while engine.has_work():
        engine.step()
    assert engine.pages_used == 0


def test_fake_above_the_crossover_no_row_drafts() -> None:
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram"), "mtp": FakeProposer("mtp")}, max_depth=4)
    engine.set_policy(TunedPolicy.from_dict({**GOOD, "crossover": 2}))
    stats = _fake_step(engine, ["copy", "copy", "chat"]).stats
    assert stats.row_classes == (RowClass("chat", "none", 0, 1), RowClass("copy", "none", 0, 2))
    assert (stats.technique, stats.depth, stats.proposed) == ("none", 0, 0)
