"""Sampled rows (temperature > 0) in the step-time model: recorded, fitted, priced."""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import BatchRule, Exploration, TunedPolicy
from engine.types import Request, SamplingParams, StepStats
from tests.tuner import synth
from tuner.capacity import Capacity
from tuner.model import PerfModel
from tuner.objective import evaluate
from tuner.traffic import observe

PER_SAMPLED_ROW_MS = 0.4
"""Known cost of one sampled row per verified position (the top-k / top-p filter)."""
WHOLE_BATCH_MS = 0.3
"""Known cost per row and position of a step whose sampler runs over the whole batch."""


def _steps(n: int, seed: int, per_row: float = 0.0, whole: float = 0.0,
           share: float = 0.5, noise: float = 0.03) -> list[StepStats]:
    """Steps of synth's ground truth plus a sampling cost; each row samples with `share`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        batch = rng.choice((1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
        technique, depth = rng.choice((("none", 0), ("ngram", 1), ("ngram", 2), ("ngram", 4)))
        sampled = sum(rng.random() < share for _ in range(batch))
        ms, propose = synth.true_step_ms(technique, depth, batch)
        q = 1 + depth
        ms += per_row * sampled * q + whole * (sampled > 0) * batch * q
        ms *= 1 + rng.uniform(-noise, noise)
        out.append(StepStats(step_id=i, time=synth.T0 + i, batch_size=batch, decode_tokens=batch,
                             technique=technique, depth=depth, proposed=batch * depth,
                             accepted_per_pos=(0,) * depth,
                             propose_ms=propose, step_ms=ms, sampled_rows=sampled))
    return out


def _greedy_view(steps: list[StepStats]) -> list[StepStats]:
    """The same steps as a model without the count sees them (every row greedy)."""
    return [dataclasses.replace(s, sampled_rows=0) for s in steps]


def test_fit_recovers_a_known_per_sampled_row_cost() -> None:
    steps = _steps(1500, seed=5, per_row=PER_SAMPLED_ROW_MS)
    model = PerfModel.fit(steps)
    assert model.sampling[0] == pytest.approx(PER_SAMPLED_ROW_MS, rel=0.1)
    assert model.sampling[1] < 0.05 * PER_SAMPLED_ROW_MS  # no whole-batch cost was injected
    assert model.target[3] == pytest.approx(synth.TARGET[3], rel=0.1)  # the row cost stays greedy's
    # an all-sampled batch of 16 at depth 2, and an all-greedy one: both unbiased
    truth_sampled = synth.true_step_ms("ngram", 2, 16)[0] + PER_SAMPLED_ROW_MS * 16 * 3
    truth_greedy = synth.true_step_ms("ngram", 2, 16)[0]
    assert model.predict_step_ms("ngram", 2, 16, sampled=16) == pytest.approx(truth_sampled, rel=0.03)
    assert model.predict_step_ms("ngram", 2, 16) == pytest.approx(truth_greedy, rel=0.03)
    # without the count, the sampling cost is smeared over every row: sampled traffic is
    # predicted too fast and greedy traffic too slow
    blind = PerfModel.fit(_greedy_view(steps))
    assert blind.sampling == (0.0, 0.0)
    assert blind.predict_step_ms("ngram", 2, 16, sampled=16) < 0.9 * truth_sampled
    assert blind.predict_step_ms("ngram", 2, 16) > 1.1 * truth_greedy


def test_fit_recovers_a_whole_batch_sampler_cost() -> None:
    """An engine that runs its sampler over every row once any row samples (engine.execute.sampling's
    lax.cond): the cost follows the padded batch, not the count, and the fit tells them apart."""
    steps = _steps(1500, seed=6, whole=WHOLE_BATCH_MS, share=0.15)
    model = PerfModel.fit(steps)
    assert model.sampling[1] == pytest.approx(WHOLE_BATCH_MS, rel=0.1)
    assert model.sampling[0] < 0.05 * WHOLE_BATCH_MS
    truth = synth.true_step_ms("none", 0, 8)[0]
    assert model.predict_step_ms("none", 0, 8, sampled=1) == pytest.approx(
        truth + WHOLE_BATCH_MS * 8, rel=0.03)
    assert model.predict_step_ms("none", 0, 8, sampled=1.2, any_sampled=0.5) == pytest.approx(
        truth + 0.5 * WHOLE_BATCH_MS * 8, rel=0.03)  # traffic: mean rows and chance of any


def test_greedy_telemetry_fits_as_before() -> None:
    steps = _steps(400, seed=7)  # no row samples
    model = PerfModel.fit(steps)
    assert model.sampling == (0.0, 0.0)
    assert model.summary()["sampling"] == [0.0, 0.0]


def test_traffic_and_objective_price_the_sampled_share() -> None:
    # fitted on mixed telemetry (all-sampled steps alone cannot tell a sampled row from a row)
    model = PerfModel.fit(_steps(1500, seed=5, per_row=PER_SAMPLED_ROW_MS))
    steps = _steps(800, seed=8, per_row=PER_SAMPLED_ROW_MS, share=1.0)
    sampled = observe(steps, [])
    assert sampled.sampled_rows == {b: float(b) for b in sampled.batch_weights}  # every row
    assert set(sampled.sampled_steps.values()) == {1.0}
    greedy = dataclasses.replace(sampled, sampled_rows={}, sampled_steps={})
    assert observe(_greedy_view(steps), []).sampled_rows == {}
    cap = Capacity(total_pages=4096, page_size=16, max_depth=4, proposers={"ngram": (0, 0)})
    policy = TunedPolicy((BatchRule(64, "ngram", 2),), crossover=64)
    slow, fast = evaluate(policy, model, sampled, cap), evaluate(policy, model, greedy, cap)
    for batch, (tokens, ms) in slow.per_batch.items():
        extra = ms - fast.per_batch[batch][1]
        assert extra == pytest.approx(PER_SAMPLED_ROW_MS * batch * 3, rel=0.1), batch
    assert slow.goodput < fast.goodput


def test_fake_engine_records_sampled_rows_and_the_fit_recovers_their_cost() -> None:
    cost = FakeCost(per_sampled_ms=0.3)
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.8, 0.6))}, cost=cost,
                        max_batch=8)
    base = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4)
    engine.set_policy(dataclasses.replace(base, explore=Exploration(
        0.3, ("ngram",), (1, 2, 3, 4), profile=(("ngram", 4),), profile_steps=80)))
    for i in range(24):  # every third request samples
        engine.add_request(Request(f"r{i}", engine.tokenizer.encode("abcdefghij" * (1 + i % 3)),
                                   SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True,
                                                  temperature=0.7 if i % 3 == 0 else 0.0)))
    stats = []
    while engine.has_work():
        out = engine.step()
        if out.stats is not None:
            stats.append(out.stats)
    assert all(0 <= s.sampled_rows <= s.batch_size for s in stats)
    assert {s.sampled_rows for s in stats} >= {0, 1, 2}  # mixes of greedy and sampled rows
    first = stats[0]
    assert first.step_ms == pytest.approx(cost.times(first.batch_size, first.depth,
                                                     first.sampled_rows)[0])
    model, report = PerfModel.fit_with_report(stats)
    assert report.step_ms_median_ape < 0.01
    assert model.sampling[0] == pytest.approx(0.3, rel=0.05)
    assert model.predict_step_ms("ngram", 2, 4, sampled=2) == pytest.approx(
        cost.times(4, 2, 2)[0], rel=0.02)
