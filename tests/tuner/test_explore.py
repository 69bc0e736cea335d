"""Exploration and the fake engine's speculation, which the daemon tests build on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import NEVER, BatchRule, TunedPolicy
from engine.types import Request, SamplingParams, StepStats
from tuner.data import StepRow
from tuner.explore import ExploringPolicy, is_exploration, unwrap
from tuner.model import Padding
from tuner.objective import padding_of
from tuner.validate import own_steps

POLICY = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4, version=3)


def test_a_share_of_decisions_explores_other_depths() -> None:
    wrapped = ExploringPolicy(POLICY, share=0.1, techniques=["ngram"], max_depth=4, seed=1)
    picks = [wrapped.choose(2) for _ in range(2000)]
    departed = [p for p in picks if p != ("ngram", 2)]
    assert 150 < len(departed) < 250 and wrapped.explored == len(departed)
    assert {d for _, d in departed} == {1, 3}  # the neighbours of depth 2, never a far one
    big = [wrapped.choose(32) for _ in range(2000)]  # above the crossover: try speculation there
    assert 150 < sum(p != ("none", 0) for p in big) < 250
    assert {p for p in big if p != ("none", 0)} == {("ngram", 1)}  # the shallowest draft
    verified = ExploringPolicy(POLICY, share=1.0, techniques=["ngram"], max_depth=8,
                               depths=(1, 2, 4, 8))
    assert {verified.choose(2) for _ in range(200)} == {("ngram", 1), ("ngram", 4)}
    assert wrapped.version == 3 and wrapped.crossover == 4 and wrapped.max_depth == 4
    assert unwrap(wrapped) is POLICY and wrapped.techniques() == {"ngram"}
    plain = ExploringPolicy(POLICY, share=0.0, techniques=["ngram"], max_depth=4)
    assert {plain.choose(2) for _ in range(200)} == {("ngram", 2)}


def test_the_startup_profile_visits_every_gap_then_stops() -> None:
    gaps = [("ngram", 1), ("ngram", 3), ("mtp", 2)]
    wrapped = ExploringPolicy(NEVER, share=0.0, techniques=["ngram", "mtp"], max_depth=4,
                              profile=gaps, profile_steps=12)
    picks = [wrapped.choose(1) for _ in range(40)]
    assert set(picks[:12]) == {("none", 0), *gaps} and picks[:12].count(("none", 0)) == 6
    assert set(picks[12:]) == {("none", 0)}


def test_validation_leaves_exploration_steps_out() -> None:
    def row(technique: str, depth: int) -> StepRow:
        return StepRow(0.0, 2, 0, 2, technique, depth, 2 * depth, (0,) * depth, 0.0, 10.0, 0, 3)

    rows = [row("ngram", 2), row("ngram", 4), row("none", 0), row("mtp", 2)]
    assert [(r.technique, r.depth) for r in own_steps(rows, POLICY)] == [("ngram", 2), ("none", 0)]
    assert is_exploration(POLICY, 2, "ngram", 4) and not is_exploration(POLICY, 2, "none", 0)


def run(engine: FakeEngine, n: int = 3, prompt: str = "abcdefghijkl") -> tuple[dict, list[StepStats]]:
    for i in range(n):
        engine.add_request(Request(f"r{i}", engine.tokenizer.encode(prompt),
                                   SamplingParams(max_tokens=64), tenant="t"))
    texts: dict[str, str] = {}
    stats: list[StepStats] = []
    while engine.has_work():
        out = engine.step()
        for e in out.events:
            texts[e.request_id] = texts.get(e.request_id, "") + e.text
        stats += [out.stats] if out.stats else []
    return texts, stats


def test_fake_speculation_emits_more_tokens_per_step_with_the_same_text() -> None:
    plain_texts, plain = run(FakeEngine(cost=FakeCost()))
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.9, 0.8))}, cost=FakeCost())
    engine.set_policy(POLICY)
    assert engine.policy.version == 0  # applied at the next step, as in EngineCore
    texts, spec = run(engine)
    assert texts == plain_texts == {f"r{i}": "lkjihgfedcba" for i in range(3)}
    assert len(spec) < len(plain)
    s = spec[0]
    assert (s.technique, s.depth, s.policy_version, s.proposed) == ("ngram", 2, 3, 6)
    assert s.decode_tokens == s.batch_size + s.accepted == 3 + sum(s.accepted_per_pos)
    assert s.step_ms == pytest.approx(FakeCost().times(3, 2)[0])
    assert engine.status()["policy_version"] == 3


def test_fake_set_policy_refuses_what_it_cannot_run() -> None:
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram")}, max_depth=2)
    with pytest.raises(ValueError, match="proposer"):
        engine.set_policy(TunedPolicy((BatchRule(4, "mtp", 1),), crossover=4))
    with pytest.raises(ValueError, match="max_depth"):
        engine.set_policy(TunedPolicy((BatchRule(4, "ngram", 3),), crossover=4))
    with pytest.raises(ValueError, match="proposer"):
        FakeEngine().set_policy(POLICY)  # the default fake has no proposers


def test_tenant_acceptance_scales_the_fakes_drafts() -> None:
    def accepted(scale: float) -> int:
        engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.5,))},
                            tenant_acceptance={"t": scale})
        engine.set_policy(POLICY)
        return sum(s.accepted for s in run(engine)[1])

    assert accepted(2.0) > accepted(1.0) > accepted(0.2)


def test_the_daemon_profiles_cheap_techniques_first_within_the_searched_depths(db) -> None:
    """The startup profile measures what costs no memory first, at depths the technique can
    draft; exploration tries only depths verified without padding (1 + depth a verify size)."""
    from types import SimpleNamespace

    from daemon.settings import Settings
    from daemon.tuning import Exploration, capacity_of

    @dataclass(frozen=True)
    class Heads(FakeProposer):
        max_depth: int = 4

    proposers = {"draft": FakeProposer("draft", resident=5 << 20),
                 "mtp": Heads("mtp", resident=1 << 20), "ngram": FakeProposer("ngram")}
    engine = FakeEngine(proposers=proposers, cost=FakeCost(), max_depth=8)
    engine.runner = SimpleNamespace(rc=SimpleNamespace(verify_tokens=(2, 3, 5, 9), spec_max_batch=8,
                                                       batch_buckets=(1, 2, 4, 8, 16)))
    exploration = Exploration(capacity_of(engine), Settings())
    assert exploration.techniques == ["ngram", "mtp", "draft"] and exploration.max_depth == 8
    assert exploration.depths == (1, 2, 4, 8)
    exploration.measure_gaps(SimpleNamespace(engine=db), 3600.0)  # an empty telemetry database
    assert exploration.gaps == [("ngram", 8), ("mtp", 4), ("draft", 8)]
    wrapped = exploration(POLICY)
    picks = [wrapped.choose(2) for _ in range(3000)]
    # the profile's deepest cells, the policy's depth 2 and its verified neighbours 1 and 4
    assert {d for _, d in picks} == {1, 2, 4, 8} and wrapped.explored > 0
    capacity = capacity_of(engine)
    assert capacity.depths == (1, 2, 4, 8) and capacity.proposer_depths["mtp"] == 4
    assert padding_of(capacity) == Padding((1, 2, 4, 8, 16), (1, 2, 3, 5, 9))
