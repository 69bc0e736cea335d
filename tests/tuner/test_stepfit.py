"""The step-time fit where one smooth linear surface is wrong: large verifies, odd shapes."""

from __future__ import annotations

import numpy as np
import pytest

from engine.types import StepStats
from tuner.model import PerfModel
from tuner.shapes import Padding
from tuner.stepfit import MIN_FACTOR_STEPS

PAD = Padding(batch=(1, 2, 4, 8, 16, 32), query=(1, 2, 3, 5))


def true_ms(b: int, q: int) -> float:
    """A forward whose row cost grows with its rows, as measured on this CPU (tuner/README):
    ~2 ms a row in a few-row verify, ~4.6 ms a drafted row in a 96-row one."""
    r = b * q
    return 35.0 + 3.0 * b + 2.2 * r + 0.015 * r * r


def steps_of(shapes, n: int, seed: int = 0, ms=true_ms) -> list[StepStats]:
    rng = np.random.default_rng(seed)
    return [StepStats(batch_size=b, decode_tokens=b, technique="ngram" if q > 1 else "none",
                      depth=q - 1, proposed=b * (q - 1), step_ms=ms(b, q) * rng.uniform(0.95, 1.05))
            for b, q in shapes for _ in range(n)]


SMALL = [(b, q) for b in (1, 2, 4, 8) for q in (1, 2, 3, 5)] + [(16, 1), (32, 1)]


def test_a_large_verify_is_priced_above_the_rows_of_small_ones() -> None:
    """Fitted on plain steps up to batch 32 and verifies up to batch 8, the batch-32 verify
    at depth 2 (96 rows, never run) is priced within 12% of its cost; a cost linear in the
    rows (the model before t5) priced it at ~0.8 of it, low enough for the tuner to draft at
    batch 32 where it does not pay."""
    model = PerfModel.fit(steps_of(SMALL, 12), buckets=PAD)
    assert model.rows_sq > 0
    for b, q in [(16, 3), (32, 2), (32, 3)]:
        assert model.predict_step_ms("ngram", q - 1, b) == pytest.approx(true_ms(b, q), rel=0.12)


def test_a_shape_measured_often_enough_is_priced_by_its_measurement() -> None:
    """One shape (batch 2 at depth 4) runs 1.3x what the smooth surface says, as the
    segmented verifies of one plain and one drafting row did on this CPU: once it has a few
    steps its price follows them, every other shape keeps the surface's."""
    odd = lambda b, q: true_ms(b, q) * (1.3 if (b, q) == (2, 5) else 1.0)  # noqa: E731
    model = PerfModel.fit(steps_of(SMALL, 12, ms=odd), buckets=PAD)
    assert model.predict_step_ms("ngram", 4, 2) == pytest.approx(1.3 * true_ms(2, 5), rel=0.1)
    assert model.shape_factor[(2, 10, 5)] > 1.1
    for b, q in [(1, 1), (4, 3), (8, 5), (32, 1)]:
        assert model.predict_step_ms("ngram" if q > 1 else "none", q - 1, b) == pytest.approx(
            true_ms(b, q), rel=0.06), (b, q)
    few = [s for s in steps_of(SMALL, 12, ms=odd) if (s.batch_size, s.depth) != (2, 4)]
    few += steps_of([(2, 5)], MIN_FACTOR_STEPS - 1, ms=odd)
    thin = PerfModel.fit(few, buckets=PAD)
    assert (2, 10, 5) not in thin.shape_factor  # too few steps: the surface prices it
    assert "shape_factor" in thin.summary()


def test_a_verify_shape_not_yet_measured_is_priced_above_the_terms_by_their_typical_error() -> None:
    """The terms' typical error (median |log(measured / fitted)|, ~2.5% for steps within +-5%)
    prices a verify shape with too few steps above them, and that decides a close call: at
    batch 32, a depth-1 verify the terms give a 1% edge in tokens per ms is not drafted until
    its own steps show that it pays. A plain shape is priced at the terms."""
    import dataclasses

    model = PerfModel.fit(steps_of(SMALL, 12), buckets=PAD)
    assert 1.01 < model.unmeasured_verify < 1.05
    terms = dataclasses.replace(model, unmeasured_verify=1.0)
    assert (32, 64, 2) not in model.shape_factor
    assert model.predict_step_ms("ngram", 1, 32) == pytest.approx(
        model.unmeasured_verify * terms.predict_step_ms("ngram", 1, 32))
    assert model.predict_step_ms("none", 0, 32) == terms.predict_step_ms("none", 0, 32)
    # tokens per row that give the verify a 1% edge on the terms
    edge = 1.01 * terms.predict_step_ms("ngram", 1, 32) / terms.predict_step_ms("none", 0, 32)
    assert edge / model.predict_step_ms("ngram", 1, 32) < 1 / model.predict_step_ms("none", 0, 32)
    measured = PerfModel.fit(steps_of(SMALL + [(32, 2)], 12), buckets=PAD)  # it ran: priced by its steps
    assert measured.predict_step_ms("ngram", 1, 32) == pytest.approx(true_ms(32, 2), rel=0.04)
