"""bench.verify_segments on the tiny model: the segmented call gives each row what the padded
verify gives it, and the bench reports every split with its own ratios."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bench.verify_segments import fill, measure
from engine.segments import run_segmented
from tests.engine.conftest import make_engine

CONTEXT, PAGES = 10, 8  # cached tokens per row; pages per row (context bucket 32 / page size 4)


def _calls(runner, tokens: np.ndarray, plain: int):
    """The padded verify call of all rows (plain rows feed one token) and the two segments."""
    B, T = tokens.shape
    padded = fill(runner.new_verify_call(B, T - 1, CONTEXT + T), tokens, CONTEXT, 1, PAGES)
    padded.n_new[:plain] = 1
    alone = fill(runner.new_call(plain, 1, CONTEXT + 1), tokens[:plain, :1], CONTEXT, 1, PAGES)
    verify = fill(runner.new_verify_call(B - plain, T - 1, CONTEXT + T), tokens[plain:], CONTEXT,
                  1 + plain * PAGES, PAGES)
    return padded, alone, verify


def test_segmented_call_gives_each_row_the_padded_calls_tokens_and_acceptance(tiny):
    runner = make_engine(tiny, verify_tokens=(3,)).runner
    runner.kv = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(2), a.shape, a.dtype), runner.kv)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 200, (4, 3)).astype(np.int32)
    plain = 2
    padded, _, _ = _calls(runner, tokens, plain)
    first = runner.run_verify(padded, np.full(padded.tokens.shape, -1, np.int32))[0]
    tokens[plain:, 1] = first[plain:, 0]  # drafts the target accepts at position 0
    padded, alone, verify = _calls(runner, tokens, plain)
    cand = np.full(padded.tokens.shape, -1, np.int32)
    cand[plain:, :2] = tokens[plain:, 1:]
    tok, acc, lp = runner.run_verify(padded, cand)
    (ptok, plp), (vtok, vacc, vlp) = run_segmented(runner, alone, verify, cand[plain:])
    assert acc[plain:, 0].all()  # the check below compares accepting rows, not only rejections
    np.testing.assert_array_equal(ptok[:, 0], tok[:plain, 0])
    np.testing.assert_array_equal(vacc, acc[plain:])
    np.testing.assert_array_equal(vtok, tok[plain:])
    np.testing.assert_allclose(plp[:, 0], lp[:plain, 0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(vlp, lp[plain:], rtol=1e-4, atol=1e-4)


def test_measure_reports_each_split_with_its_ratios(tiny):
    runner = make_engine(tiny, verify_tokens=(3,)).runner
    out = measure(runner, ((1, 1), (2, 2)), depth=2, context=CONTEXT, repeats=2, progress=False)
    assert [(r["plain_rows"], r["drafting_rows"]) for r in out] == [(1, 1), (2, 2)]
    for r in out:
        assert set(r["ms"]) == {"padded", "two_calls", "segmented", "plain_decode"}
        assert all(v > 0 for v in r["ms"].values())
        assert r["segmented_over_padded"] == pytest.approx(r["ms"]["segmented"] / r["ms"]["padded"], abs=2e-3)
