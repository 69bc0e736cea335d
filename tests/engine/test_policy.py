"""TunedPolicy's checks: every path that builds a policy refuses bad types and ranges, naming
the field, and both engines refuse what they cannot serve by the same rules."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

from engine.fake import FakeEngine, FakeProposer
from engine.policy import (
    MAX_BATCH,
    NEVER,
    BatchRule,
    Exploration,
    PolicyError,
    TunedPolicy,
    check_servable,
)

GOOD = {"rules": [{"max_batch": 4, "technique": "ngram", "depth": 2}, {"max_batch": 64}],
        "crossover": 4, "pool_split": 0.1, "draft_vocab": 0}


def with_(**changes: object) -> dict:
    body = copy.deepcopy(GOOD)
    body.update(changes)
    return body


def rule(i: int, **changes: object) -> dict:
    body = copy.deepcopy(GOOD)
    body["rules"][i].update(changes)
    return body


@pytest.mark.parametrize(("body", "field"), [
    # the values of the issue: each crashed the engine's next step, at every restart
    (rule(0, depth=2.5), "rules[0].depth"),
    (rule(1, max_batch=1.5), "rules[1].max_batch"),
    (with_(crossover=1e300), "crossover"),
    (with_(draft_vocab=-5), "draft_vocab"),
    # ints are ints: no bool, no float, no string, nothing unbounded
    (rule(0, depth=True), "rules[0].depth"),
    (rule(0, depth="2"), "rules[0].depth"),
    (with_(crossover=10**300), "crossover"),
    (with_(crossover=-1), "crossover"),
    (with_(crossover=2.0), "crossover"),
    (rule(1, max_batch=MAX_BATCH + 1), "rules[1].max_batch"),
    (rule(0, depth=9), "rules[0].depth"),
    (with_(version=1 << 40), "version"),
    (with_(draft_vocab=False), "draft_vocab"),
    # floats are finite numbers in range
    (with_(pool_split=math.nan), "pool_split"),
    (with_(pool_split=math.inf), "pool_split"),
    (with_(pool_split=0.9), "pool_split"),
    (with_(pool_split=10**400), "pool_split"),  # too large for a float: no OverflowError
    (with_(explore={"share": -(10**309)}), "explore.share"),
    (with_(pool_split="0.1"), "pool_split"),
    # shapes
    (with_(rules="all of them"), "rules"),
    (with_(rules=[]), "rules"),
    (with_(rules=[{"max_batch": b} for b in range(1, 100)]), "rules"),
    (with_(rules=[7]), "rules[0]"),
    (with_(rules=[{"technique": "ngram", "depth": 1}]), "rules[0].max_batch"),
    (rule(0, technique="magic"), "rules[0].technique"),
    (rule(0, technique=["ngram"]), "rules[0].technique"),
    (rule(0, technique="none"), "rules[0].depth"),  # depth 2 with no technique
    (rule(0, heads=3), "rules[0].heads"),
    (with_(turbo=True), "turbo"),
    (with_(extra=[1, 2]), "extra"),
    (with_(source="me"), "source"),
    (with_(explore={"share": math.inf}), "explore.share"),
    (with_(explore={"share": 0.1, "techniques": ["ngram"], "depths": [1.5]}), "explore.depths[0]"),
    (with_(explore={"techniques": ["ngram"], "depths": [2, 1]}), "explore.depths"),
    (with_(explore={"techniques": ["none"], "depths": [1]}), "explore.techniques"),
    (with_(explore={"profile": [["ngram", 0]]}), "explore.profile[0]"),
    (with_(explore={"profile": "ngram"}), "explore.profile"),
    (with_(explore={"profile_steps": -1}), "explore.profile_steps"),
    (with_(explore=[0.1]), "explore"),
])
def test_from_dict_refuses_bad_types_and_ranges_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(PolicyError) as refused:
        TunedPolicy.from_dict(body)
    assert refused.value.field == field, str(refused.value)


def test_the_constructors_check_the_same_rules() -> None:
    with pytest.raises(PolicyError, match="depth=2.5 must be an integer"):
        BatchRule(4, "ngram", 2.5)
    with pytest.raises(PolicyError, match="max_batch=True"):
        BatchRule(True)
    with pytest.raises(PolicyError, match="crossover"):
        TunedPolicy(crossover=1e300)
    with pytest.raises(PolicyError, match="share"):
        Exploration(share=math.nan)
    with pytest.raises(PolicyError, match="rules"):
        TunedPolicy(rules=({"max_batch": 4},))


def test_valid_bodies_round_trip_and_numpy_values_become_python_ones() -> None:
    policy = TunedPolicy.from_dict(with_(pool_split=0, explore={
        "share": 0.05, "techniques": ["ngram"], "depths": [1, 2], "profile": [["ngram", 3]],
        "profile_steps": 10}))
    assert policy.pool_split == 0.0 and isinstance(policy.pool_split, float)
    assert policy.explore.profile == (("ngram", 3),) and policy.explore.depths == (1, 2)
    assert TunedPolicy.from_dict(policy.to_dict()) == policy
    assert TunedPolicy.from_dict({}) == NEVER
    tuned = TunedPolicy((BatchRule(np.int64(4), "ngram", np.int64(2)), BatchRule(64)),
                        crossover=np.int64(4), pool_split=np.float64(0.25), draft_vocab=np.int32(0))
    assert type(tuned.rules[0].depth) is int and type(tuned.crossover) is int
    assert type(tuned.pool_split) is float and type(tuned.draft_vocab) is int


def _bypassed(**fields: object) -> TunedPolicy:
    """A policy whose fields never met the constructor (as an unpickled one may not)."""
    policy = pickle.loads(pickle.dumps(TunedPolicy.from_dict(GOOD)))
    for name, value in fields.items():
        object.__setattr__(policy, name, value)
    return policy


def test_engines_refuse_what_they_cannot_serve_by_the_same_rules() -> None:
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram"),
                                   "mtp": FakeProposer("mtp", draft_vocabs=(8192,))}, max_depth=4)
    capacity = engine.capacity()
    engine.set_policy(TunedPolicy.from_dict(GOOD))  # fine
    refused = [
        ({"rules": [{"max_batch": 4, "technique": "mtp", "depth": 1}], "draft_vocab": 5},
         "draft_vocab"),  # not a compiled vocabulary
        ({"rules": [{"max_batch": 4, "technique": "ngram", "depth": 5}]}, "rules"),
        ({"rules": [{"max_batch": 4, "technique": "draft", "depth": 1}]}, "rules"),
    ]
    for body, field in refused:
        policy = TunedPolicy.from_dict(body)
        with pytest.raises(PolicyError) as direct:
            check_servable(policy, capacity)
        with pytest.raises(PolicyError) as fake:
            engine.set_policy(policy)
        assert direct.value.field == fake.value.field == field
    with pytest.raises(PolicyError, match="TunedPolicy"):
        engine.set_policy(GOOD)  # a dict is not a policy
    with pytest.raises(PolicyError) as bypassed:
        engine.set_policy(_bypassed(crossover=1e300))
    assert bypassed.value.field == "crossover"
    assert engine.policy.version == 0  # nothing refused ever reached a step


def test_the_real_engine_refuses_a_policy_built_around_the_constructor(tiny) -> None:
    from tests.engine.conftest import make_engine

    core = make_engine(tiny)
    with pytest.raises(PolicyError) as refused:
        core.set_policy(_bypassed(rules=(BatchRule(4, "none", 0), {"max_batch": 1.5})))
    assert refused.value.field == "rules[1].max_batch"
    with pytest.raises(PolicyError) as unservable:
        core.set_policy(TunedPolicy.from_dict(GOOD))  # the tiny engine compiled no verify depth
    assert unservable.value.field == "rules"
    core.set_policy(TunedPolicy(pool_split=0.25, version=3))
    assert core._inbox.qsize() == 1  # only the valid one was queued for the next step
