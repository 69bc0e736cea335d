"""Exploration and the fake engine's speculation, which the daemon tests build on."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import NEVER, BatchRule, Exploration, PolicyError, TunedPolicy
from engine.step.chooser import StepChooser
from engine.types import Request, SamplingParams, StepStats
from tuner.capacity import Capacity
from tuner.config import TunerConfig
from tuner.explore import ExplorationPlan, is_exploration
from tuner.validate import own_steps

POLICY = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4, version=3)


def chooser(policy: TunedPolicy, seed: int = 1) -> StepChooser:
    c = StepChooser(np.random.default_rng(seed))
    c.start(policy)
    return c


def explored(share: float, depths: tuple[int, ...] = (1, 2, 3, 4), **kw: object) -> TunedPolicy:
    return dataclasses.replace(POLICY, explore=Exploration(share, ("ngram",), depths, **kw))


def test_a_share_of_decisions_explores_other_depths() -> None:
    served = explored(0.1)
    steps = chooser(served)
    picks = [steps.choose(2) for _ in range(2000)]
    departed = [p for p in picks if p != ("ngram", 2)]
    assert 150 < len(departed) < 250
    assert {d for _, d in departed} == {1, 3}  # the neighbours of depth 2, never a far one
    big = [steps.choose(32) for _ in range(2000)]  # above the crossover: try speculation there
    assert 150 < sum(p != ("none", 0) for p in big) < 250
    assert {p for p in big if p != ("none", 0)} == {("ngram", 1)}  # the shallowest draft
    verified = chooser(explored(1.0, depths=(1, 2, 4, 8)))
    assert {verified.choose(2) for _ in range(200)} == {("ngram", 1), ("ngram", 4)}
    plain = chooser(explored(0.0))
    assert {plain.choose(2) for _ in range(200)} == {("ngram", 2)}


def test_a_technique_with_a_cache_to_catch_up_is_explored_only_up_to_the_crossover() -> None:
    """The draft model's first drafts for a row prefill its whole context into the draft's
    cache: 2.7-3.7 s at batch 28-32. Where the policy says none, exploration tries it only up
    to the crossover (4 here); the other techniques are still tried at batch 32."""
    served = dataclasses.replace(POLICY, explore=Exploration(
        1.0, ("ngram", "draft"), (1, 2, 4), catch_up=("draft",)))
    steps = chooser(served)
    assert {steps.choose(32) for _ in range(50)} == {("ngram", 1)}
    assert {steps.choose(4) for _ in range(50)} == {("ngram", 1), ("ngram", 4)}  # ngram@2's neighbours
    low = TunedPolicy((BatchRule(2), BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4,
                      explore=served.explore)  # plain at batch 1-2, within the crossover
    within = chooser(low)
    assert {within.choose(2) for _ in range(50)} == {("ngram", 1), ("draft", 1)}
    alone = chooser(dataclasses.replace(served, explore=Exploration(1.0, ("draft",), (1,),
                                                                    catch_up=("draft",))))
    assert {alone.choose(32) for _ in range(20)} == {("none", 0)}
    loose = chooser(dataclasses.replace(POLICY, explore=Exploration(1.0, ("ngram", "draft"), (1, 2, 4))))
    assert {loose.choose(32) for _ in range(50)} == {("ngram", 1), ("draft", 1)}
    with pytest.raises(PolicyError, match="catch_up"):
        Exploration(1.0, ("ngram",), (1,), catch_up=("draft",))
    cap = Capacity(4096, 16, proposers={"ngram": (0, 0), "draft": (1 << 20, 100)},
                   lent_kv={"draft": 1.0})
    plan = ExplorationPlan(cap, TunerConfig(explore_share=0.05))
    lending = dataclasses.replace(POLICY, pool_split=0.25)
    assert plan(lending).explore.catch_up == ("draft",)
    assert TunedPolicy.from_dict(plan(lending).to_dict()).explore.catch_up == ("draft",)
    # a policy that lends no pages: the draft model cannot draft, so exploration leaves it out
    assert (plan(POLICY).explore.techniques, plan(POLICY).explore.catch_up) == (("ngram",), ())


def test_a_profile_of_the_draft_model_is_served_with_pages_to_draft_in() -> None:
    """The first policy's profile includes the draft model's cell; a policy lending no pages is
    served with the search's smallest split while it profiles, so those turns draft (the
    engine's draft model drafts only in lent pages), and recorded as it is."""
    cap = Capacity(4096, 16, max_depth=8, depths=(1, 2, 4, 8),
                   proposers={"ngram": (0, 0), "draft": (1 << 20, 100)}, lent_kv={"draft": 1.0})
    plan = ExplorationPlan(cap, TunerConfig(explore_share=0.05, pool_split_step=0.05))
    plan.gaps = plan.gaps_of({})
    served = plan(POLICY)
    assert served.explore.profile == (("ngram", 8), ("draft", 8)) and served.pool_split == 0.05
    assert POLICY.pool_split == 0.0  # what the keeper records
    assert plan(POLICY).pool_split == 0.0  # no profile after the first policy: nothing lent
    unlent = ExplorationPlan(cap, TunerConfig(explore_share=0.05, max_pool_split=0.0, pool_split_step=0.01))
    unlent.gaps = unlent.gaps_of({})
    assert unlent(POLICY).explore.profile == (("ngram", 8),) and unlent(POLICY).pool_split == 0.0


def test_exploration_is_a_field_of_an_immutable_policy() -> None:
    served = explored(0.1, depths=(1, 2, 4, 8), profile=(("ngram", 8),), profile_steps=10)
    assert (served.version, served.crossover, served.rules) == (3, 4, POLICY.rules)
    assert served.choose(2) == POLICY.choose(2) and served.max_depth == 8  # exploration counts
    assert served.techniques() == {"ngram"} and POLICY.max_depth == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        served.explore.share = 0.5  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(served)) == served  # crosses a process boundary as is
    assert TunedPolicy.from_dict(served.to_dict()) == served
    assert "explore" not in POLICY.to_dict()  # a stored policy's body is unchanged
    with pytest.raises(ValueError, match="share"):
        Exploration(1.5)
    with pytest.raises(ValueError, match="depth"):
        Exploration(0.1, ("ngram",), ())


def test_the_startup_profile_visits_every_gap_then_stops() -> None:
    gaps = (("ngram", 1), ("ngram", 3), ("mtp", 2))
    steps = chooser(dataclasses.replace(NEVER, explore=Exploration(
        0.0, ("ngram", "mtp"), (1, 2, 3, 4), profile=gaps, profile_steps=12)))
    picks = [steps.choose(1) for _ in range(40)]
    assert set(picks[:12]) == {("none", 0), *gaps} and picks[:12].count(("none", 0)) == 6
    assert set(picks[12:]) == {("none", 0)}


def test_the_profile_waits_for_small_batches() -> None:
    """Above PROFILE_MAX_BATCH rows a step takes the policy's choice and leaves the profile's
    turns for later: a turn at batch 8 would draft every row at the cell's depth."""
    from engine.step.chooser import PROFILE_MAX_BATCH

    gaps = (("ngram", 1), ("mtp", 2))
    steps = chooser(dataclasses.replace(POLICY, explore=Exploration(
        0.0, ("ngram", "mtp"), (1, 2, 3, 4), profile=gaps, profile_steps=4)))
    assert {steps.choose(PROFILE_MAX_BATCH + 1) for _ in range(20)} == {POLICY.choose(PROFILE_MAX_BATCH + 1)}
    assert {steps.choose(PROFILE_MAX_BATCH) for _ in range(4)} == {("ngram", 2), *gaps}
    assert {steps.choose(1) for _ in range(20)} == {("ngram", 2)}  # the profile is over


def test_steps_that_prefill_take_the_policys_choice_and_no_exploration_turn() -> None:
    gaps = (("ngram", 1), ("mtp", 2))
    steps = chooser(dataclasses.replace(POLICY, explore=Exploration(
        1.0, ("ngram", "mtp"), (1, 2, 3, 4), profile=gaps, profile_steps=4)))
    assert {steps.choose(2, prefill=True) for _ in range(50)} == {("ngram", 2)}
    assert [steps.choose(2) for _ in range(4)].count(("ngram", 2)) == 2  # the profile still whole
    assert steps.choose_rows(["a", "b"], prefill=True) == [("ngram", 2)] * 2
    assert {steps.choose(2) for _ in range(50)} == {("ngram", 1), ("ngram", 3)}  # share 1.0 after it


def _profiled(profile_steps: int = 60, depth: int = 8) -> TunedPolicy:
    return dataclasses.replace(POLICY, explore=Exploration(
        0.0, ("ngram", "early_exit"), (1, 2, 4, 8)[:3 + (depth == 8)],
        profile=(("ngram", depth), ("early_exit", depth)), profile_steps=profile_steps))


@pytest.mark.parametrize("rate, after", [(1 / 140, 2), (3 / 140, 4), (3.2 / 50, None)])
def test_the_profile_retires_a_cell_that_cannot_pay_next_to_the_policy(rate: float,
                                                                       after: int | None) -> None:
    """A profile cell whose steps emit tokens at under a quarter of the rate of the policy's own
    steps (interleaved with them) is retired after PROFILE_FIRST_STEPS steps each, one under
    half after PROFILE_MIN_STEPS, and the profile's turns go to the other cells; one at 0.8x
    the policy's rate stays. (The policy's n-gram@2 emits 4 tokens in 50 ms.)"""
    from engine.step.chooser import PROFILE_FIRST_STEPS, PROFILE_MIN_STEPS

    assert (after or 2) in (PROFILE_FIRST_STEPS, PROFILE_MIN_STEPS)
    steps = chooser(_profiled())
    picks = []
    for _ in range(60):
        t, d = steps.choose(1)
        picks.append((t, d))
        tokens, ms = (3, 3 / rate) if t == "early_exit" else (4 if d == 2 else 5, 50.0)
        steps.observe(t, d, tokens, ms)
    assert (steps.retired == [("early_exit", 8)]) == (after is not None)
    n = picks.count(("early_exit", 8))
    if after:
        assert n == after and picks.count(("ngram", 8)) == 30 - n
    else:
        assert n == 15 == picks.count(("ngram", 8))
    assert picks.count(("ngram", 2)) == 30  # the policy's own turns are untouched


def test_steps_that_prefilled_or_fell_back_do_not_count_toward_retiring() -> None:
    steps = chooser(_profiled())
    for _ in range(60):
        t, d = steps.choose(1)
        if t == "early_exit":  # its steps either prefilled too or ran plain (a proposer fallback)
            steps.observe(t, d, 1, 500.0, prefill_tokens=32)
            continue
        steps.observe(t, d, 4, 50.0)
    assert steps.retired == []
    steps = chooser(_profiled())
    for _ in range(60):
        t, d = steps.choose(1)
        steps.observe(*(("none", 0) if t == "early_exit" else (t, d)), 1 if t == "early_exit" else 4,
                      500.0 if t == "early_exit" else 50.0)
    assert steps.retired == []


def test_when_every_profile_cell_is_retired_the_profile_ends() -> None:
    steps = chooser(dataclasses.replace(POLICY, explore=Exploration(
        0.0, ("early_exit",), (1, 2, 4, 8), profile=(("early_exit", 8),), profile_steps=60)))
    picks = []
    for _ in range(40):
        t, d = steps.choose(1)
        picks.append((t, d))
        steps.observe(t, d, 1 if t == "early_exit" else 4, 150.0 if t == "early_exit" else 50.0)
    assert steps.retired == [("early_exit", 8)] and set(picks[10:]) == {("ngram", 2)}
    steps.start(_profiled())  # a new policy starts a new profile with nothing retired
    assert steps.retired == [] and [steps.choose(1) for _ in range(2)] == [("ngram", 2), ("ngram", 8)]


def test_the_fake_engine_retires_a_poor_proposer_from_its_profile() -> None:
    """The engine calls `observe` after each step: with a proposer that never gets a draft
    accepted (a third of the policy's rate), the profile stops trying it after
    PROFILE_MIN_STEPS steps."""
    from engine.step.chooser import PROFILE_MIN_STEPS

    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.95,)),
                                   "early_exit": FakeProposer("early_exit", (0.0,))},
                        cost=FakeCost(), seed=1)
    engine.set_policy(_profiled(profile_steps=80, depth=4))  # the fake verifies up to depth 4
    engine.add_request(Request("r", engine.tokenizer.encode("abcdefghijkl" * 3),
                               SamplingParams(max_tokens=400, ignore_eos=True)))
    stats = []
    while engine.has_work():
        stats += [s] if (s := engine.step().stats) else []
    cells = [(s.technique, s.depth) for s in stats[:80]]
    assert cells.count(("early_exit", 4)) == PROFILE_MIN_STEPS
    assert cells.count(("ngram", 4)) > 2 * PROFILE_MIN_STEPS


def test_exploration_backs_off_a_technique_far_slower_than_plain_steps_at_that_batch() -> None:
    """Where the policy says none, a technique whose exploration steps emit under EXPLORE_WORSE
    of the plain steps' token rate at their batch size skips its next turns (more after each
    miss in a row) but is still tried; one that keeps up is tried at every turn."""
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.95,)),
                                   "early_exit": FakeProposer("early_exit", (0.0,))},
                        cost=FakeCost(per_token_ms=2.0, per_draft_ms=1.0), seed=1)
    engine.set_policy(TunedPolicy((BatchRule(64),), crossover=0, explore=Exploration(
        0.5, ("ngram", "early_exit"), (1, 2, 4))))
    for i in range(8):
        engine.add_request(Request(f"r{i}", engine.tokenizer.encode("abcdefghijkl" * 3),
                                   SamplingParams(max_tokens=300, ignore_eos=True)))
    stats = []
    while engine.has_work():
        stats += [s] if (s := engine.step().stats) else []
    full = [s.technique for s in stats if s.batch_size == 8 and not s.prefill_tokens]
    assert full.count("early_exit") >= 2
    assert full.count("ngram") > 4 * full.count("early_exit")


def test_the_engine_applies_exploration_with_its_own_seeded_stream() -> None:
    """Steps are stamped with the cell they ran and the policy's version; the engine's random
    stream is seeded once, so the same seed explores the same steps."""
    def stamps(seed: int) -> list[tuple[str, int, int]]:
        engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.9, 0.8))},
                            cost=FakeCost(), seed=seed)
        engine.set_policy(explored(0.3))
        stats = run(engine, n=4, prompt="abcdefghijkl" * 3)[1]
        return [(s.technique, s.depth, s.policy_version) for s in stats]

    first = stamps(1)
    assert {v for _, _, v in first} == {3}
    cells = {(t, d) for t, d, _ in first}  # the rule's cell and some of its neighbours
    assert ("ngram", 2) in cells and len(cells) > 1 and cells <= {("ngram", d) for d in (1, 2, 3)}
    assert stamps(1) == first and stamps(2) != first


def test_validation_leaves_exploration_steps_out() -> None:
    def row(technique: str, depth: int) -> StepStats:
        return StepStats(batch_size=2, decode_tokens=2, technique=technique, depth=depth, proposed=2 * depth,
                         accepted_per_pos=(0,) * depth, step_ms=10.0, policy_version=3)

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
    draft; exploration tries the searched depths (the engine verifies every depth up to its
    max_depth, each row at its own), here the policy's neighbours 1 and 3."""
    proposers = {"draft": FakeProposer("draft", resident=5 << 20),
                 "mtp": FakeProposer("mtp", resident=1 << 20, max_depth=4),
                 "ngram": FakeProposer("ngram")}
    engine = FakeEngine(proposers=proposers, cost=FakeCost(), max_depth=8)
    capacity = Capacity.from_engine(dataclasses.replace(engine.capacity(), spec_max_batch=8))
    plan = ExplorationPlan(capacity, TunerConfig())
    assert plan.techniques == ["ngram", "mtp", "draft"] and plan.max_depth == 8
    assert plan.depths == tuple(range(1, 9))
    gaps = [("ngram", 8), ("mtp", 4), ("draft", 8)]
    plan.measure_gaps(db, 3600.0)  # an empty telemetry database
    assert plan.gaps == gaps
    served = plan(POLICY)
    assert served.explore is not None and list(served.explore.profile) == gaps and not plan.gaps
    assert plan(POLICY).explore.profile == ()  # only the first policy profiles
    steps = chooser(served)
    picks = [steps.choose(2) for _ in range(3000)]
    # the profile's deepest cells (8; 4 for MTP), the policy's depth 2 and its neighbours 1 and 3
    assert {d for _, d in picks} == {1, 2, 3, 4, 8} and set(gaps) <= set(picks)
    assert capacity.depths == () and capacity.proposer_depths["mtp"] == 4
    assert ExplorationPlan(capacity, TunerConfig(enabled=False))(POLICY) is POLICY
