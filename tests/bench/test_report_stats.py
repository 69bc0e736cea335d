"""The intervals, the crossover rule and the roofline model behind `crossover report`."""

from __future__ import annotations

import numpy as np
import pytest

from bench.report import roofline
from bench.report.stats import Interval, Moments, crossover, quotient_ci, ratio_ci, wilson
from engine.config import GEMMA3_1B, GEMMA3_270M
from engine.memory.sizes import weight_bytes


def test_wilson_covers_the_true_rate_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    for p, n in ((0.3, 50), (0.8, 400), (0.05, 200)):
        draws = rng.binomial(n, p, size=2000)
        covered = np.mean([wilson(k, n).contains(p) for k in draws])
        assert 0.92 <= covered <= 0.98, (p, n, covered)
    assert wilson(0, 0) is None
    w = wilson(0, 20)
    assert w.low == 0.0 and 0.1 < w.high < 0.2  # never a zero-width interval at the edge
    for n in (1, 3, 7, 33.3, 1000):  # the estimate stays inside its interval, rounding included
        for k in (0, n / 3, n):
            w = wilson(k, n)
            assert w.low <= w.value <= w.high, (k, n, w)


def test_ratio_interval_covers_the_true_goodput_about_95_percent_of_the_time():
    rng = np.random.default_rng(2)
    true_rate, covered = 50.0, 0
    trials = 1000
    for _ in range(trials):
        m = Moments()
        seconds = rng.uniform(0.01, 0.03, size=30)
        tokens = rng.poisson(true_rate * seconds * 10) / 10  # tokens ~ rate x time, with noise
        for y, x in zip(tokens, seconds):
            m.add(float(y), float(x))
        covered += ratio_ci(m).contains(true_rate)
    assert 0.92 <= covered / trials <= 0.98
    few = Moments()
    for _ in range(4):
        few.add(1.0, 1.0)
    assert ratio_ci(few) is None  # below MIN_STEPS: no interval


def test_quotient_of_intervals():
    q = quotient_ci(Interval(3.0, 2.7, 3.3), Interval(2.0, 1.9, 2.1))
    assert q.value == 1.5 and q.low < 1.5 < q.high and q.low > 1.2
    assert quotient_ci(Interval(1.0, -0.1, 2.0), Interval(1.0, 0.9, 1.1)) is None


def test_crossover_rule_edge_cases():
    flat = {b: Interval(10.0, 9.0, 11.0) for b in (1, 2, 4)}
    assert crossover(flat, flat).batch is None  # overlapping everywhere: never significantly slower
    assert "none up to B=4" in crossover(flat, flat).describe()
    low = {b: Interval(5.0, 4.0, 6.0) for b in (1, 2, 4)}
    c = crossover(low, flat)
    assert (c.batch, c.last_paying) == (1, None) and "at or below 1" in c.describe()
    assert crossover(low, {8: Interval(1, 0.5, 1.5)}).describe() == "no batch size with both measured"
    # a later batch that pays again does not move the crossover, nor count as paying before it
    wavy = {1: Interval(20, 19, 21), 2: Interval(5, 4, 6), 4: Interval(20, 19, 21)}
    c = crossover(wavy, flat)
    assert (c.batch, c.last_paying) == (2, 1)


def test_roofline_plain_decoding_at_batch_1_streams_the_weights():
    chip = roofline.CHIPS["tpu-v6e-1"]
    t = roofline.target_seconds(GEMMA3_1B, chip, 1, 1, 1)
    floor = weight_bytes(GEMMA3_1B.param_count(), "bfloat16") / chip.profile.bandwidth_bytes_per_s
    assert floor <= t < floor * 1.01
    # ngram drafts for free: memory-bound, a verify costs about a decode, so goodput scales by 1 + E
    g_plain = roofline.goodput("none", GEMMA3_1B, chip, 1, 0, [], 1024)
    g_ngram = roofline.goodput("ngram", GEMMA3_1B, chip, 1, 2, [0.6, 0.3], 1024)
    assert g_ngram / g_plain == pytest.approx(1.9, rel=0.01)
    # a model-based draft costs sequential passes, so it gains less at the same acceptance
    assert roofline.goodput("early_exit", GEMMA3_1B, chip, 1, 2, [0.6, 0.3], 1024) < g_ngram
    with pytest.raises(ValueError, match="technique"):
        roofline.propose_seconds("medusa", GEMMA3_1B, chip, 1, 2, 1024)


def test_roofline_crossover_comes_where_compute_binds_and_earlier_on_h200():
    batches = [2**i for i in range(13)]
    found = {name: roofline.predicted_crossover("ngram", GEMMA3_1B, chip, 4, [0.5, 0.3, 0.2, 0.1], 128,
                                                batches)
             for name, chip in roofline.CHIPS.items()}
    assert found["tpu-v6e-1"] is not None and found["h200"] is not None
    # H200 has fewer FLOPs per byte of bandwidth than a v6e, so compute binds at a smaller batch
    assert found["h200"] < found["tpu-v6e-1"]
    h200 = roofline.CHIPS["h200"]
    half = found["h200"] // 2  # below the crossover speculation still pays
    for batch, faster in ((found["h200"], False), (half, True)):
        spec = roofline.goodput("ngram", GEMMA3_1B, h200, batch, 4, [0.5, 0.3, 0.2, 0.1], 128)
        assert (spec > roofline.goodput("none", GEMMA3_1B, h200, batch, 0, [], 128)) == faster
    # at a long context every batch streams more KV than it computes: no crossover at all
    assert roofline.predicted_crossover("ngram", GEMMA3_270M, h200, 4, [0.5, 0.3, 0.2, 0.1], 8192,
                                        batches) is None
