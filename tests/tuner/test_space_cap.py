"""The search space never offers speculation above the largest batch the engine verifies
(Capacity.spec_max_batch, engine.loader.SPEC_MAX_BATCH): the engine would serve it clamped."""

from __future__ import annotations

import dataclasses

import optuna

from engine.policy import speculates_up_to
from tuner.capacity import Capacity
from tuner.config import TunerConfig
from tuner.exact import solve
from tuner.model import PerfModel
from tuner.space import SearchSpace
from tuner.traffic import Traffic

CAPACITY = Capacity(total_pages=4096, page_size=16, max_depth=4, depths=(1, 2, 4), spec_max_batch=16,
                    proposers={"ngram": (0, 0)})


def test_crossovers_stop_at_the_largest_verified_batch() -> None:
    assert SearchSpace.build(TunerConfig(), CAPACITY).crossovers == (0, 2, 4, 8, 16)
    straddled = dataclasses.replace(CAPACITY, spec_max_batch=12)
    assert SearchSpace.build(TunerConfig(), straddled).crossovers == (0, 2, 4, 8, 12)
    unlimited = dataclasses.replace(CAPACITY, spec_max_batch=1 << 30)
    assert SearchSpace.build(TunerConfig(), unlimited).crossovers == (0, 2, 4, 8, 16, 64)


def test_no_suggested_or_solved_policy_speculates_above_it() -> None:
    for cap in (12, 16, 32):
        capacity = dataclasses.replace(CAPACITY, spec_max_batch=cap)
        space = SearchSpace.build(TunerConfig(), capacity)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=cap), direction="maximize")
        for _ in range(60):
            trial = study.ask()
            assert speculates_up_to(space.suggest(trial)) <= cap
            study.tell(trial, 0.0)
        # speculation pays everywhere in this model: the optimum speculates as far as it may
        model = PerfModel(target=(10.0, 1.0, 0.0, 0.1, 0.0), acceptance={"ngram": (0.9, 0.9, 0.9, 0.9)})
        traffic = Traffic(steps=100, batch_weights={1: 0.4, cap: 0.3, 48: 0.3}, prefill_per_step={},
                          concurrency=48.0, concurrency_max=48)
        best = solve(space, model, traffic, capacity)
        assert best is not None and best.choose(cap)[0] == "ngram" and speculates_up_to(best) == cap
