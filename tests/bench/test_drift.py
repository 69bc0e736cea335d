"""bench.drift: the machine's speed per run and phase, from the steps runs share."""

from __future__ import annotations

import doctest
import random

import pytest

from bench import drift
from bench.tuner_report import drift as report_drift
from engine.types import StepStats

SHAPES = [("none", 0, 32), ("none", 0, 4), ("ngram", 2, 4), ("ngram", 2, 8), ("none", 0, 1)]
BASE_MS = {("none", 0, 32): 210.0, ("none", 0, 4): 48.0, ("ngram", 2, 4): 70.0,
           ("ngram", 2, 8): 95.0, ("none", 0, 1): 40.0}


def _run(shapes: list[tuple], speeds: list[float], seed: int, steps: int = 60) -> dict:
    """A run of two phases (10 s each); each step one request's one token."""
    rng = random.Random(seed)
    out = []
    for phase, speed in enumerate(speeds):
        for k in range(steps):
            technique, depth, batch = shapes[k % len(shapes)]
            ms = BASE_MS[(technique, depth, batch)] * speed * rng.uniform(0.95, 1.05)
            out.append((StepStats(time=phase * 10 + k * 10 / steps, batch_size=batch, technique=technique,
                                  depth=depth, step_ms=ms, kv_pages_used=300),
                        {f"r{phase}-{k}": 1}))
    return {"bounds": [(0.0, 10.0), (10.0, 20.0)], "steps": out,
            "streams": [type("S", (), {"request_id": rid, "phase": s.time // 10})()
                        for s, per in out for rid in per]}


def test_the_fit_recovers_each_stretch_s_speed_from_shared_shapes() -> None:
    runs = {"a": _run(SHAPES[:3], [1.0, 1.0], 1), "b": _run(SHAPES[1:4], [1.3, 1.0], 2),
            "c": _run(SHAPES, [1.0, 0.8], 3)}
    fitted = drift.fit(runs)
    idx = fitted["index"]
    # relative speeds are what the fit can know: b's phase 1 ran 1.3x a's, c's phase 2 0.8x
    assert idx["b"][0] / idx["a"][0] == pytest.approx(1.3, rel=0.05)
    assert idx["c"][1] / idx["a"][1] == pytest.approx(0.8, rel=0.05)
    assert idx["b"][1] / idx["a"][0] == pytest.approx(1.0, rel=0.05)
    assert all(n >= drift.MIN_STEPS for counts in fitted["steps"].values() for n in counts)


def test_adjusted_goodputs_agree_when_only_the_machine_differed() -> None:
    """Two runs of the same policy, one on a machine 1.4x slower in phase 1: measured
    goodputs differ by 1.4x there, adjusted ones agree; a shape only one run ran does not
    count toward the index."""
    runs = {"never": _run(SHAPES[:2], [1.0, 1.0], 4), "fixed:ngram@2": _run(SHAPES[:2], [1.4, 1.0], 5)}
    runs["fixed:ngram@2"]["steps"] += [(StepStats(time=5.0, batch_size=64, technique="ngram", depth=8,
                                                  step_ms=5000.0, kv_pages_used=300), {})]
    runs["never"]["steps"] += [(StepStats(time=25.0, batch_size=32, step_ms=9e4, kv_pages_used=300), {})]
    out = report_drift(runs, ["low", "high"])  # a step after the last phase (a probe's) is no stretch's
    g = {n: [p["goodput"] for p in out["policies"][n]["phases"]] for n in runs}
    assert g["never"][0] == pytest.approx(g["fixed:ngram@2"][0], rel=0.05)
    assert g["never"][1] == pytest.approx(g["fixed:ngram@2"][1], rel=0.05)
    assert out["shared_steps"]["fixed:ngram@2"][0] == 60  # the 64-row step is nobody else's shape
    assert out["shared_steps"]["never"] == [60, 60]


def test_search_slowdown_compares_steps_inside_and_outside_retunes() -> None:
    runs = {"autotuned": _run(SHAPES[:3], [1.0, 1.0], 6), "never": _run(SHAPES[:3], [1.0, 1.0], 7)}
    for i, (s, per) in enumerate(runs["autotuned"]["steps"]):
        if 2.0 <= s.time <= 6.0 or 12.0 <= s.time <= 16.0:  # a search ran: 20 % slower steps
            runs["autotuned"]["steps"][i] = (StepStats(**{**vars(s), "step_ms": s.step_ms * 1.2}), per)
    runs["autotuned"]["history"] = {"retunes": [{"started_s": 2.0, "finished_s": 6.0},
                                                {"started_s": 12.0, "finished_s": 16.0}]}
    slow = report_drift(runs, ["low", "high"])["search_slowdown"]
    assert slow["ratio"] == pytest.approx(1.2, rel=0.05)
    assert slow["steps_in"] > 20 and slow["steps_out"] > 40


def test_docstring_examples() -> None:
    result = doctest.testmod(drift)
    assert result.attempted > 0 and result.failed == 0
