"""The objective on hand-checkable numbers; the KV and TPOT constraints."""

from __future__ import annotations

import dataclasses

import pytest

from engine.policy import NEVER, BatchRule, TunedPolicy
from tuner.capacity import Capacity
from tuner.model import PerfModel
from tuner.objective import evaluate
from tuner.traffic import Traffic

# step_ms = 10 + 1 * B * q; ngram accepts every position with 0.5
MODEL = PerfModel(target=(10.0, 0.0, 0.0, 1.0, 0.0), acceptance={"ngram": (0.5,)})
CAP = Capacity(total_pages=1000, page_size=16, max_depth=4, proposers={"ngram": (0, 0)})


def traffic(concurrency: float = 2.0, tokens: float = 160.0) -> Traffic:
    """Half the steps at batch 2, half at batch 8; sequences of `tokens` tokens."""
    return Traffic(steps=100, batch_weights={2: 0.5, 8: 0.5}, prefill_per_step={},
                   concurrency=concurrency, concurrency_max=int(concurrency),
                   mean_prompt_tokens=tokens / 2, mean_output_tokens=tokens / 2)


def spec(split: float = 0.1, depth: int = 1, crossover: int = 4) -> TunedPolicy:
    return TunedPolicy((BatchRule(4, "ngram", depth), BatchRule(64)), crossover=crossover,
                       pool_split=split)


def test_goodput_by_hand() -> None:
    # plain: B=2 -> 12 ms, 2 tokens; B=8 -> 18 ms, 8 tokens: 1000 * 5 / 15
    assert evaluate(NEVER, MODEL, traffic(), CAP).goodput == pytest.approx(1000 * 5 / 15)
    # ngram depth 1 at B=2: 10 + 2*2 = 14 ms, 2 * 1.5 tokens; B=8 unchanged (above crossover).
    # Token shares (one token per sequence and step as observed): B=2 0.2, B=8 0.8; each
    # takes its step time per token emitted there
    ev = evaluate(spec(), MODEL, traffic(), CAP)
    assert ev.goodput == pytest.approx(1000 / (0.2 * 14 / 3 + 0.8 * 18 / 8))
    assert ev.feasible
    measured = dataclasses.replace(traffic(), token_weights={2: 0.5, 8: 0.5})
    assert evaluate(spec(), MODEL, measured, CAP).goodput == pytest.approx(
        1000 / (0.5 * 14 / 3 + 0.5 * 18 / 8))


def test_each_batch_size_favours_its_own_fastest_cell() -> None:
    """Mostly batch-1 steps with some at batch 32 (a shift in load, inside one window). At
    batch 1 depth 1 is faster per token (1.5 tokens in 12 ms vs 1 in 11); at batch 32 slower
    (48 in 74 ms vs 32 in 42) although it emits more per step. The best policy speculates at
    batch 1 only; weighting by the share of steps would have preferred the opposite."""
    from tuner.config import TunerConfig
    from tuner.exact import solve
    from tuner.space import SearchSpace

    mix = Traffic(steps=100, batch_weights={1: 0.9, 32: 0.1}, prefill_per_step={},
                  concurrency=8.0, concurrency_max=32)
    small = TunedPolicy((BatchRule(1, "ngram", 1), BatchRule(64)), crossover=1)
    large = TunedPolicy((BatchRule(1), BatchRule(64, "ngram", 1)), crossover=64)
    both = TunedPolicy((BatchRule(64, "ngram", 1),), crossover=64)
    score = {name: evaluate(p, MODEL, mix, CAP).goodput
             for name, p in (("small", small), ("large", large), ("both", both), ("never", NEVER))}
    assert max(score, key=score.get) == "small"
    steps_weighted = {name: (0.9 * a + 0.1 * b) / (0.9 * c + 0.1 * d) for name, (a, b, c, d) in
                      (("small", (1.5, 32, 12, 42)), ("large", (1, 48, 11, 74)))}
    assert steps_weighted["large"] > steps_weighted["small"]  # the bias this weighting avoids
    best = solve(SearchSpace.build(TunerConfig(ranges=(1, 64), max_depth=1), CAP), MODEL, mix, CAP)
    assert best is not None and (best.choose(1), best.choose(32)) == (("ngram", 1), ("none", 0))


def test_kv_constraint_excludes_a_split_that_cannot_hold_the_observed_concurrency() -> None:
    # 50 sequences of 160 tokens: 10 pages each = 500 tenant pages needed
    busy = traffic(concurrency=50)
    ok, starved = evaluate(spec(split=0.1), MODEL, busy, CAP), evaluate(spec(split=0.5), MODEL, busy, CAP)
    assert (ok.tenant_pages, ok.tenant_pages_needed) == (900, 500) and ok.feasible
    assert starved.tenant_pages == 500 and starved.feasible  # exactly fits
    too_busy = traffic(concurrency=51)
    ev = evaluate(spec(split=0.5), MODEL, too_busy, CAP)
    assert not ev.feasible and ev.constraints()[0] == 10  # 510 needed, 500 left
    assert "KV capacity" in ev.violations()[0]
    assert evaluate(spec(split=0.45), MODEL, too_busy, CAP).feasible
    # more than the whole pool holds (101 x 10 pages): requests wait at any split, so the
    # constraint keeps one sequence and the objective prices the smaller batch a split leaves
    overloaded = dataclasses.replace(traffic(concurrency=101), pages_per_sequence=10.0,
                                     queue_per_step={8: 200.0})
    half, tenth = (evaluate(spec(split=s, crossover=0), MODEL, overloaded, CAP) for s in (0.5, 0.1))
    assert half.tenant_pages_needed == 10 and half.feasible and tenth.feasible
    assert (half.admitted, tenth.admitted) == (50, 90) and half.goodput < tenth.goodput


def test_speculation_must_fit_in_its_share() -> None:
    # a draft model holding 300 pages of weights: needs split >= 0.3 (plus verify slots)
    cap = Capacity(total_pages=1000, page_size=16, page_bytes=1000, max_depth=4,
                   proposers={"ngram": (300_000, 0)})
    assert not evaluate(spec(split=0.2), MODEL, traffic(), cap).feasible
    ev = evaluate(spec(split=0.35), MODEL, traffic(), cap)
    assert ev.feasible and ev.spec_pages_needed == 300 + 1  # 2 sequences x 1 slot: one page
    assert evaluate(spec(split=0.0, crossover=0), MODEL, traffic(), cap).spec_pages_needed == 0


def test_tpot_target_is_a_constraint() -> None:
    deep = spec(depth=4)
    ev = evaluate(deep, MODEL, traffic(), CAP, tpot_target_ms=5.0)
    assert ev.p95_tpot_ms == pytest.approx(18.0)  # batch 8, plain: 18 ms per token
    assert ev.tpot_excess_ms == pytest.approx(13.0) and not ev.feasible
    assert evaluate(deep, MODEL, traffic(), CAP, tpot_target_ms=20.0).feasible


def test_depths_between_verify_sizes_are_not_offered_and_a_technique_drafts_no_deeper_than_it_can() -> None:
    import optuna

    from tuner.config import TunerConfig
    from tuner.space import SearchSpace

    cap = dataclasses.replace(CAP, max_depth=8, depths=(1, 2, 4, 8),
                              proposers={"ngram": (0, 0), "mtp": (0, 0)}, proposer_depths={"mtp": 4})
    space = SearchSpace.build(TunerConfig(), cap)
    assert space.depths == (1, 2, 4, 8)
    assert SearchSpace.build(TunerConfig(max_depth=4), cap).depths == (1, 2, 4)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {r.depth for _ in range(60) for r in space.suggest(study.ask()).rules if r.depth}
    assert seen == {1, 2, 4, 8}
    assert space.params_of(TunedPolicy((BatchRule(64, "ngram", 3),), crossover=64)) is None
    # mtp asked for 8 drafts gets 4 (its heads): predicted like depth 4, not like 8
    model = PerfModel(target=(10.0, 0.0, 0.0, 1.0, 0.0), acceptance={"mtp": (0.5,)})
    at = {d: evaluate(TunedPolicy((BatchRule(64, "mtp", d),), crossover=64), model, traffic(), cap)
          for d in (4, 8)}
    assert at[8].goodput == pytest.approx(at[4].goodput)


def test_the_tenant_mix_is_what_the_steps_served_not_only_what_finished() -> None:
    """In a busy minute the window's requests are still running: the mix comes from the steps'
    batches (each split over its tenants), and from finished requests only without them."""
    from engine.types import StepStats
    from tuner.data import RequestRow
    from tuner.traffic import observe

    def step(n: int, *tenants: str) -> StepStats:
        return StepStats(batch_size=n, decode_tokens=n, step_ms=100.0, tenants=tenants)

    finished = [RequestRow("copy", 50, 200, 0.0, 10.0, 0, 0)]  # the previous phase's
    busy = [step(32, "chat", "code", "copy", "prose")] * 9 + [step(2, "prose")]
    mix = observe(busy, finished).tenant_mix
    assert set(mix) == {"chat", "code", "copy", "prose"} and sum(mix.values()) == pytest.approx(1.0)
    assert mix["prose"] == pytest.approx((9 * 8 + 2) / (9 * 32 + 2)) and mix["prose"] > mix["copy"]
    assert observe([step(4)] * 3, finished).tenant_mix == {"copy": 1.0}  # steps name none
    assert observe([step(4)] * 3, []).tenant_mix == {}


def test_each_batch_size_is_scored_on_the_tenants_it_served() -> None:
    """A window at the turn of a copy phase into a busy mixed one: most steps serve the copy
    tenant at batch 2, a few at batch 24 serve four tenants. Batch 24 is scored on its own
    mix, where deep n-gram drafts do not pay; the window's mix would say they do."""
    from engine.types import StepStats
    from tuner.traffic import observe

    def row(b: int, *tenants: str) -> StepStats:
        return StepStats(batch_size=b, decode_tokens=b, step_ms=10.0, tenants=tenants)

    steps = [row(2, "copy")] * 60 + [row(24, "copy", "code", "chat", "prose")] * 3
    seen = observe(steps, [])
    assert seen.mix_at(2) == {"copy": 1.0}
    assert seen.mix_at(24) == pytest.approx({t: 0.25 for t in ("chat", "code", "copy", "prose")})
    assert seen.tenant_mix["copy"] > 0.6
    model = PerfModel(target=(20.0, 0.0, 0.0, 0.4, 0.0),
                      acceptance={"ngram": (0.05, 0.0), "ngram|copy": (0.95,) * 8 + (0.0,)})
    deep = TunedPolicy((BatchRule(64, "ngram", 8),), crossover=64)

    def rate(policy: TunedPolicy, on: Traffic) -> float:  # tokens per ms at batch 24
        tokens, ms = evaluate(policy, model, on, CAP).per_batch[24]
        return tokens / ms

    one_mix = dataclasses.replace(seen, bucket_mix={})
    assert rate(deep, one_mix) > 1.3 * rate(NEVER, one_mix)  # the window's mix: deep pays
    assert rate(deep, seen) < 0.85 * rate(NEVER, seen)  # batch 24's own mix: it does not


def test_the_observed_prefill_is_paid_per_output_token_not_per_step() -> None:
    """Busy-phase steps at batch 32 each admit ~500 prompt tokens (1.5 s of prefill). A
    policy that emits more per step takes fewer steps for the same prompts, so it saves no
    prefill: charged per step, n-gram@8 (3.2 tokens a sequence, 1.85 s of decode) would have
    looked 1.5x faster than plain decoding; per output token it is slower."""
    model = PerfModel(target=(40.0, 0.0, 0.0, 6.3, 3.0), acceptance={"ngram": (0.7,) * 8 + (0.0,)})
    busy = Traffic(steps=100, batch_weights={32: 1.0}, prefill_per_step={32: 500.0},
                   concurrency=32, concurrency_max=32, tokens_per_step={32: 32.0})
    deep = TunedPolicy((BatchRule(64, "ngram", 8),), crossover=64)
    cap = dataclasses.replace(CAP, max_depth=8)
    tokens, ms = evaluate(deep, model, busy, cap).per_batch[32]
    per_seq = model.expected_tokens_per_seq("ngram", 8)
    assert tokens == pytest.approx(32 * per_seq)
    assert ms == pytest.approx(40 + 6.3 * 32 * 9 + 1500 * per_seq)  # prefill scales with tokens
    assert tokens / (40 + 6.3 * 32 * 9 + 1500) > 1.5 * 32 / (40 + 6.3 * 32 + 1500)  # per step
    assert evaluate(deep, model, busy, cap).goodput < evaluate(NEVER, model, busy, cap).goodput
