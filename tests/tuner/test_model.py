"""The performance model against known ground truth: step time, acceptance, tenants."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sqlalchemy import Engine

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import BatchRule, Exploration, TunedPolicy
from engine.types import Request, SamplingParams, StepStats
from store.db import session_scope
from tests.tuner import synth
from tuner.acceptance import NEUTRAL_RATE, PRIOR_OFFERS
from tuner.data import RequestRow, read_requests, read_steps
from tuner.model import NotEnoughTelemetry, PerfModel
from tuner.stepfit import MIN_SHAPE_STEPS, cost_history

STATED_MEDIAN_APE = 0.10
"""The stated bound: median absolute % error of step time on held-out steps."""


def test_fit_on_recorded_steps_predicts_within_the_stated_error(db: Engine) -> None:
    gen = synth.Synth(seed=11, noise=0.05)
    synth.write(db, gen.explore(2000), gen.requests(200))
    with session_scope(db) as s:
        steps, requests = read_steps(s, 0.0), read_requests(s, 0.0)
    assert len(steps) == 2000
    model, report = PerfModel.fit_with_report(steps, requests)
    assert report.rows == 400
    assert report.step_ms_median_ape < STATED_MEDIAN_APE
    assert report.step_ms_median_ape < 0.04  # noise is uniform +-5%: median |err| ~2.5%
    assert report.step_ms_p90_ape < 0.08
    assert report.goodput_median_ape < 0.15
    for technique, depth, batch in [("none", 0, 1), ("ngram", 3, 4), ("mtp", 4, 32), ("ngram", 1, 17)]:
        truth = synth.true_step_ms(technique, depth, batch)[0]
        assert model.predict_step_ms(technique, depth, batch) == pytest.approx(truth, rel=0.03)


def test_acceptance_is_conditional_per_position_and_mixes_depths() -> None:
    gen = synth.Synth(seed=3)
    model = PerfModel.fit(gen.explore(3000))
    for technique, truth in synth.ACCEPT.items():
        assert model.acceptance[technique][:-1] == pytest.approx(truth, abs=0.04), technique
        assert model.acceptance[technique][-1] == 0.0  # deeper than any step: no credit
        assert model.rates(technique, 6)[4:] == [0.0, 0.0]
    e = model.expected_tokens_per_seq("ngram", 3)
    a = synth.ACCEPT["ngram"]
    assert e == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2], rel=0.04)
    assert model.expected_tokens_per_seq("none", 0) == 1.0
    assert model.expected_tokens_per_seq("draft", 4) == 1.0  # never measured: no credit


def test_position_counts_by_hand() -> None:
    # depth 2: 4 sequences, 3 accept position 0, 1 of those accepts position 1;
    # depth 1: 4 sequences, 2 accept. Position 0: 5/8; position 1: 1/3 (reached by 3 only).
    rows = [StepStats(batch_size=4, decode_tokens=8, technique="ngram", depth=2, proposed=8,
                      accepted_per_pos=(3, 1), propose_ms=0.1, step_ms=10.0),
            StepStats(batch_size=4, decode_tokens=6, technique="ngram", depth=1, proposed=4,
                      accepted_per_pos=(2,), propose_ms=0.1, step_ms=9.0)]
    rows += [StepStats(batch_size=b, decode_tokens=b, step_ms=5.0 + b) for b in range(1, 9)]
    rows[0:2] = [r for r in rows[0:2] for _ in range(5)]  # 5 copies each: 25 of 40, 5 of 15
    model = PerfModel.fit(rows)

    def shrink(a: float, r: float, prior: float) -> float:  # the beta posterior mean
        return (a + PRIOR_OFFERS * prior) / (r + PRIOR_OFFERS)

    # "ngram" shrinks toward every technique pooled (here the same counts), which shrinks
    # toward NEUTRAL_RATE at position 0 and toward its own position 0 at position 1
    every0 = shrink(25, 40, NEUTRAL_RATE)
    every1 = shrink(5, 15, every0)
    assert model.acceptance["ngram"] == pytest.approx(
        (shrink(25, 40, every0), shrink(5, 15, every1), 0.0))
    # many more of the same steps: the counts win
    many = PerfModel.fit([r for r in rows[:10] for _ in range(200)] + rows[10:])
    assert many.acceptance["ngram"] == pytest.approx((5 / 8, 1 / 3, 0.0), abs=0.003)


def test_tenant_factors_come_from_requests() -> None:
    reqs = [RequestRow(r.tenant, 40, 60, r.arrival_time, r.finish_time, r.proposed_tokens,
                       r.accepted_tokens) for r in synth.Synth(seed=2).requests(200)]
    model = PerfModel.fit(synth.Synth(seed=2).explore(400), reqs)
    ratio = model.tenant_factor["code"] / model.tenant_factor["chat"]
    assert ratio == pytest.approx(synth.TENANT_RATE["code"] / synth.TENANT_RATE["chat"], rel=0.1)
    assert (model.expected_tokens_per_seq("ngram", 3, "code")
            > model.expected_tokens_per_seq("ngram", 3) > model.expected_tokens_per_seq("ngram", 3, "chat"))


def test_a_tenant_not_yet_measured_earns_nothing_once_others_are() -> None:
    # the busy phase's first retune: the fit window's drafts and finished requests are all
    # the copy tenant's; chat and prose arrive unmeasured and must not inherit copy's rates
    rows = [StepStats(batch_size=2, decode_tokens=2 + 7, technique="ngram", depth=4, proposed=8,
                      accepted_per_pos=(2, 2, 2, 1), propose_ms=0.1, step_ms=20.0, tenants=("copy",))] * 200
    rows += [StepStats(batch_size=b, decode_tokens=b, step_ms=5.0 + b) for b in range(1, 9)]
    copy = [RequestRow("copy", 40, 60, 0.0, 1.0, 40, 35)]
    model = PerfModel.fit(rows, copy)
    # 4.5 measured; copy's own rates are shrunk once less than the pooled ones the depth
    # factor was fitted against, hence not exactly 4.5
    copy_tokens = model.expected_tokens_per_seq("ngram", 4, "copy")
    assert copy_tokens == pytest.approx(4.5, rel=0.01)
    assert model.expected_tokens_per_seq("ngram", 4, "chat") == 1.0
    mix = {"copy": 0.25, "chat": 0.25, "prose": 0.5}
    assert model.tokens_per_seq_mix("ngram", 4, mix) == pytest.approx(0.25 * copy_tokens + 0.75)
    # before any tenant is measured, the pooled rates are all there is about anyone
    assert PerfModel.fit(rows).expected_tokens_per_seq("ngram", 4, "chat") == pytest.approx(4.5, rel=0.01)


def test_single_tenant_steps_give_that_tenant_its_own_rates() -> None:
    # n-gram accepts 9 of 10 first drafts on "copy", 1 of 10 on "prose"; steps mixing both
    # tenants count only in the pooled rates, which every other tenant falls back to.
    def spec(tenants: tuple[str, ...], accepted: int) -> StepStats:
        return StepStats(batch_size=10, decode_tokens=10 + accepted, technique="ngram", depth=1, proposed=10,
                         accepted_per_pos=(accepted,), propose_ms=0.1, step_ms=20.0, tenants=tenants)
    rows = [spec(("copy",), 9), spec(("prose",), 1), spec(("copy", "prose"), 5)] * 3
    rows += [StepStats(batch_size=b, decode_tokens=b, step_ms=5.0 + b) for b in range(1, 9)]
    model = PerfModel.fit(rows)
    # 27 of 30 and 3 of 30, each shrunk toward the pooled 0.5 by PRIOR_OFFERS offers
    assert model.rates("ngram", 2, "copy") == pytest.approx(  # never drafted 2 deep
        [(27 + PRIOR_OFFERS * 0.5) / (30 + PRIOR_OFFERS), 0.0])
    assert model.rates("ngram", 1, "prose") == pytest.approx([(3 + PRIOR_OFFERS * 0.5) / (30 + PRIOR_OFFERS)])
    assert model.rates("ngram", 1, "chat") == pytest.approx([0.5])  # pooled: 45 of 90
    assert model.rates("ngram", 1) == pytest.approx([0.5])
    # one step of a tenant (10 offers < MIN_REACHED... exactly 10 reach it) is evidence;
    # fewer offers than MIN_REACHED are not
    thin = PerfModel.fit(rows[:3] * 3 + [spec(("rare",), 5)] + rows[9:])
    assert "ngram|rare" in thin.acceptance
    sparse = [StepStats(batch_size=4, decode_tokens=4, technique="ngram", depth=1, proposed=4,
                        accepted_per_pos=(4,), propose_ms=0.1, step_ms=9.0, tenants=("few",))]
    assert "ngram|few" not in PerfModel.fit(rows + sparse).acceptance


def test_rows_that_find_no_draft_emit_one_token() -> None:
    # batch 10 at depth 2: on "copy" every row drafts, on "prose" 5 rows of 10 do; the
    # drafts that are offered are accepted alike (first 0.8, second 0.5), so the rates
    # agree and only the share of drafting rows tells the tenants apart.
    def spec(tenants: tuple[str, ...], drafting: int) -> StepStats:
        first, second = 8 * drafting // 10, 4 * drafting // 10
        return StepStats(batch_size=10, decode_tokens=10 + first + second, technique="ngram", depth=2,
                         proposed=2 * drafting, accepted_per_pos=(first, second), propose_ms=0.1,
                         step_ms=20.0, tenants=tenants)
    copy, prose = spec(("copy",), 10), spec(("prose",), 5)
    rows = [copy, prose] * 10
    rows += [StepStats(batch_size=b, decode_tokens=b, step_ms=5.0 + b) for b in range(1, 9)]
    model = PerfModel.fit(rows)
    # (shrunk toward the pooled rates, equal here: off by less than 1e-4 over 100+ offers)
    assert model.rates("ngram", 2, "copy") == pytest.approx([0.8, 0.5], abs=1e-4)
    assert model.rates("ngram", 2, "prose") == pytest.approx([0.8, 0.5], abs=1e-4)
    assert model.share("ngram", "copy") == 1.0 and model.share("ngram", "prose") == 0.5
    assert model.share("ngram") == pytest.approx(0.75)  # pooled: 150 drafting rows of 200
    assert model.share("ngram", "chat") == pytest.approx(0.75)  # unmeasured tenant: pooled
    assert model.share("mtp") == 1.0  # never measured: drafting rows are not discounted
    # the tokens each step emitted, predicted per tenant (to the shrinkage's 1e-4)
    assert 10 * model.expected_tokens_per_seq("ngram", 2,
                                              "copy") == pytest.approx(copy.decode_tokens, rel=1e-4)
    assert 10 * model.expected_tokens_per_seq("ngram", 2,
                                              "prose") == pytest.approx(prose.decode_tokens, rel=1e-4)
    # a step that is prefilling counts its prefill rows in batch_size: left out of the share
    prefilling = StepStats(batch_size=10, prefill_tokens=64, decode_tokens=10, technique="ngram", depth=2,
                           accepted_per_pos=(0, 0), propose_ms=0.1, step_ms=30.0, tenants=("copy",))
    assert PerfModel.fit(rows + [prefilling] * 5).share("ngram", "copy") == 1.0


def test_each_measured_depth_is_predicted_as_measured_not_from_pooled_rates() -> None:
    # A deep draft eats a copyable stretch in few steps, so more of its steps fall where
    # drafts fail: at depth 2 every row drafts and accepts 0.8 then 0.875; at depth 8 only
    # 5 rows of 10 draft and 3 of those accept position 0 (and the rest). Pooled per
    # position, the depth-2 steps lift position 0 and the draft share, and the depth-8
    # prediction with them (~1.45x what it measured), and the depth-8 steps lower depth 2.
    shallow = StepStats(batch_size=10, decode_tokens=10 + 8 + 7, technique="ngram", depth=2, proposed=20,
                        accepted_per_pos=(8, 7), propose_ms=0.1, step_ms=20.0)
    deep = StepStats(batch_size=10, decode_tokens=10 + 3 * 8, technique="ngram", depth=8, proposed=40,
                     accepted_per_pos=(3,) * 8, propose_ms=0.1, step_ms=40.0)
    rows = [shallow, deep] * 200  # a factor is shrunk toward 1 until its depth is well measured
    rows += [StepStats(batch_size=b, decode_tokens=b, step_ms=5.0 + b) for b in range(1, 9)]
    model = PerfModel.fit(rows)
    for step in (shallow, deep):
        assert 10 * model.expected_tokens_per_seq("ngram", step.depth) == pytest.approx(
            step.decode_tokens, rel=0.03)
    pooled = dataclasses.replace(model, depth_factor={})
    assert 10 * pooled.expected_tokens_per_seq("ngram", 8) > 1.3 * deep.decode_tokens
    assert 10 * pooled.expected_tokens_per_seq("ngram", 2) < 0.9 * shallow.decode_tokens
    # a depth not measured takes the nearest measured depth's factor (the deeper on a tie)
    factors = model.depth_factor["ngram"]
    assert factors[2] > 1.0 > factors[8]
    assert model.factor_at("ngram", 3) == factors[2] and model.factor_at("ngram", 5) == factors[8]
    assert model.factor_at("mtp", 4) == 1.0
    # never more accepted than drafted
    assert model.expected_tokens_per_seq("ngram", 1) <= 2.0


def test_step_time_follows_the_rows_each_row_ran() -> None:
    # Each decode row runs 1 + the drafts it verified (engine/step/ragged_step.py): a row whose
    # proposer found nothing runs one. Steps cost 10 + 2 ms per token row; half the rows of
    # each n-gram step drafted. Fitted on the rows they ran the model is exact, and prices a
    # depth at its draft share (0.5 here); read as every row at the step's depth (the padded
    # engine's shape) the fit is off.
    def step(b: int, d: int, drafting: int) -> StepStats:
        return StepStats(batch_size=b, decode_tokens=b, technique="ngram" if d else "none", depth=d,
                         proposed=drafting * d, accepted_per_pos=(0,) * d,
                         step_ms=10.0 + 2.0 * (b + drafting * d))

    rows = [step(b, d, b // 2 if d else 0) for b in (2, 4, 6, 8, 12, 16, 24, 32) for d in (0, 1, 2, 3, 4)]
    model = PerfModel.fit(rows)
    assert model.error_report(rows).step_ms_mape < 1e-6
    assert model.share("ngram") == pytest.approx(0.5)
    assert model.predict_step_ms("ngram", 4, 8) == pytest.approx(10.0 + 2.0 * 8 * (1 + 4 * 0.5), rel=1e-6)
    assert model.predict_step_ms("ngram", 4, 8, drafts=4.0) == pytest.approx(10.0 + 2.0 * 8 * 5, rel=1e-6)
    padded = [dataclasses.replace(s, proposed=s.batch_size * s.depth) for s in rows]
    assert PerfModel.fit(padded).error_report(rows).step_ms_mape > 0.05


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(NotEnoughTelemetry, match="at least"):
        PerfModel.fit(synth.Synth().explore(3))


def test_fit_on_the_fake_engines_own_telemetry(monkeypatch) -> None:
    """The fake's cost and acceptance are exact, so the fitted model recovers them (the
    profile's depth-4 turns at every batch size measure both draft positions)."""
    from engine.step import chooser

    monkeypatch.setattr(chooser, "PROFILE_MAX_BATCH", 8)
    cost = FakeCost()
    proposer = FakeProposer("ngram", (0.8, 0.6))
    engine = FakeEngine(proposers={"ngram": proposer}, cost=cost, max_batch=8)
    base = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4)
    engine.set_policy(dataclasses.replace(base, explore=Exploration(
        0.3, ("ngram",), (1, 2, 3, 4), profile=(("ngram", 4),), profile_steps=80)))
    for i in range(24):
        engine.add_request(Request(f"r{i}", engine.tokenizer.encode("abcdefghij" * 3),
                                   SamplingParams(max_tokens=40, ignore_eos=True)))
    stats = []
    while engine.has_work():
        out = engine.step()
        if out.stats is not None:
            stats.append(out.stats)
    rows = stats  # what the engine records is what the tuner reads
    assert {r.technique for r in rows} == {"none", "ngram"}
    model, report = PerfModel.fit_with_report(rows)
    assert report.step_ms_median_ape < 0.01  # the fake's step time is exactly linear
    assert model.predict_step_ms("ngram", 3, 5) == pytest.approx(cost.times(5, 3)[0], rel=0.01)
    # drafts past max_tokens count as rejected (StepStats.accepted): the 24 requests' last steps
    # take about 0.02 off the rates measured here, position 1's most
    assert model.acceptance["ngram"][:2] == pytest.approx((0.8, 0.6), abs=0.1)


def test_a_few_slow_collinear_steps_cannot_fit_negative_costs() -> None:
    """A busy minute leaves few steps, almost all at batch 32 and one depth: an unconstrained
    fit found negative per-row costs and predicted deep drafts far faster than plain decoding.
    Every fitted cost is >= 0, so predicted step time never falls as batch or depth grows."""
    rng = np.random.default_rng(0)

    def row(b: int, d: int, ms: float) -> StepStats:
        return StepStats(batch_size=b, decode_tokens=b, technique="ngram" if d else "none", depth=d,
                         proposed=b * d, accepted_per_pos=(0,) * d, propose_ms=0.3 + 0.05 * b * d,
                         step_ms=ms * rng.uniform(0.9, 1.1))

    rows = [row(32, 8, 2350.0)] * 12 + [row(32, 0, 405.0)] * 10 + [row(b, 0, 60.0 + 11 * b)
                                                                   for b in (5, 9, 22)]
    model = PerfModel.fit(rows)
    assert min(model.target) >= 0.0 and min(model.propose["ngram"]) >= 0.0
    for depth in (0, 1, 4, 8):
        times = [model.predict_step_ms("ngram" if depth else "none", depth, b) for b in (1, 2, 4, 8, 16, 32)]
        assert times == sorted(times)
    deep = [model.predict_step_ms("ngram", d, 32) for d in (1, 2, 4, 8)]
    assert deep == sorted(deep) and deep[-1] > model.predict_step_ms("none", 0, 32)
    assert model.error_report(rows).step_ms_median_ape < 0.25


def test_older_steps_fill_the_shapes_a_busy_window_lacks() -> None:
    """A busy fit window holds one shape (batch 32, depth 2): alone, it cannot tell a step's
    fixed cost from its cost per row, and the fit finds a constant step time (as a real busy
    minute did), so a depth-8 verify looks as cheap as a depth-2 one. The copy phase before
    it measured batches 1-2 at every depth; those shapes join the step-time fit."""
    def ms(b: int, q: int) -> float:  # this CPU's form: 200 ms fixed at batch 32, 6.5 a row
        return 30 + 5.3 * b + 6.5 * b * q

    def row(t: float, b: int, d: int) -> StepStats:
        return StepStats(time=t, batch_size=b, decode_tokens=b, technique="ngram" if d else "none", depth=d,
                         proposed=b * d, accepted_per_pos=(0,) * d,
                         step_ms=ms(b, 1 + d) * (1 + (int(t) % 5 - 2) / 100))

    busy = [row(100.0 + i, 32, 2) for i in range(40)]
    copy_phase = [row(float(i), b, d) for i, (b, d) in
                  enumerate([(b, d) for b in (1, 2) for d in (0, 1, 2, 4, 8)] * 6)]
    alone = PerfModel.fit(busy)
    assert alone.predict_step_ms("ngram", 8, 32) < 0.5 * ms(32, 9)
    history = cost_history(busy, copy_phase)
    assert len(history) == 60 and all(s.batch_size <= 2 for s in history)
    model = PerfModel.fit(busy, history=history)
    for depth in (0, 1, 4, 8):
        assert model.predict_step_ms("ngram", depth, 32) == pytest.approx(ms(32, 1 + depth), rel=0.1)


def test_the_cost_window_is_read_as_the_newest_steps_of_each_shape(db: Engine) -> None:
    """The search reads the 6 h cost window per_shape (see tuner.search._read): what it
    returns is what cost_history would take from the whole window."""
    gen = synth.Synth(seed=8)
    synth.write(db, gen.explore(600, max_batch=4, max_depth=2, techniques=("none", "ngram", "mtp")))
    with session_scope(db) as s:
        whole = read_steps(s, 0.0)
        newest = read_steps(s, 0.0, per_shape=3)
        enough = read_steps(s, 0.0, per_shape=MIN_SHAPE_STEPS)
    # per technique too: the remembered acceptance (tuner.acceptance.remembered) reads its
    # steps from here, and another technique's steps of the same shape must not crowd them out
    shapes = {(r.batch_size, r.depth, r.technique) for r in whole}
    assert {t for _, d, t in shapes if d} == {"ngram", "mtp"}
    assert len(newest) == 3 * len(shapes) < len(whole)
    for shape in shapes:
        assert [r for r in newest if (r.batch_size, r.depth, r.technique) == shape] == \
            [r for r in whole if (r.batch_size, r.depth, r.technique) == shape][-3:]
    assert newest == sorted(newest, key=lambda r: r.time)
    assert cost_history([], enough) == cost_history([], whole)
    assert cost_history(whole[-50:], enough) == cost_history(whole[-50:], whole)


def test_a_depth_factor_from_few_drafting_sequences_stays_near_one() -> None:
    """One explored step at batch 32 (32 drafting rows) accepting 0.67 of what the rates
    predict says little about the depth: its factor is shrunk toward 1, and reaches the
    measured ratio only as such steps accumulate (a single step's 0.68 once kept the tuner
    off depth 2 for a whole busy phase)."""
    from tuner.acceptance import DEPTH_PRIOR_SEQUENCES, fit_depth_factors

    rates, share = {"ngram": (0.7, 0.8, 0.0)}, {"ngram": 1.0}
    step = StepStats(batch_size=32, decode_tokens=32 + 27, technique="ngram", depth=2, proposed=64,
                     accepted_per_pos=(16, 11), propose_ms=0.1, step_ms=400.0)
    raw = 27 / (32 * (0.7 + 0.7 * 0.8))
    one = fit_depth_factors([step], {}, rates, share)["ngram"][2]
    assert one == pytest.approx((32 * raw + DEPTH_PRIOR_SEQUENCES) / (32 + DEPTH_PRIOR_SEQUENCES))
    assert one > raw + 0.15
    many = fit_depth_factors([step] * 40, {}, rates, share)["ngram"][2]
    assert raw < many < raw + 0.02
