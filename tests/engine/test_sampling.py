"""Sampling: greedy, temperature, top-k, top-p, seeds and logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from engine.execute.sampling import (
    CANDIDATES,
    TOP_BLOCK,
    SamplingArrays,
    greedy,
    kept,
    sample,
    top_candidates,
    top_logprobs,
    verify,
)
from engine.types import Request, SamplingParams
from tests.engine.conftest import ByteTokenizer, make_engine


def filtered_probs(logits, s: SamplingArrays):
    """The distribution each sampled row draws from: p [N, V] summing to 1 (0 outside the kept set)."""
    k = kept(logits, s)
    p = k.weights(k.scaled)
    return p / jnp.sum(p, axis=-1, keepdims=True)


LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005], np.float32))


def _draw(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, min_p=0.0):
    s = SamplingArrays.host(n)
    s["temperature"][:] = temperature
    s["top_k"][:] = top_k
    s["top_p"][:] = top_p
    s["min_p"][:] = min_p
    s["key"][:] = np.random.SeedSequence(seed).generate_state(2, np.uint32)
    lg = jnp.asarray(np.tile(LOGITS, (n, 1)))
    tok, _ = jax.jit(sample)(lg, SamplingArrays(**s), jnp.arange(n, dtype=jnp.int32))
    return np.bincount(np.asarray(tok), minlength=len(LOGITS)) / n


def test_temperature_one_matches_the_distribution():
    freq = _draw(20000)
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.015)


def test_temperature_sharpens():
    freq = _draw(20000, temperature=0.5)
    p = np.exp(LOGITS / 0.5)
    np.testing.assert_allclose(freq, p / p.sum(), atol=0.015)


def test_top_k_keeps_only_k_renormalized():
    freq = _draw(20000, top_k=3)
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(freq[:3], np.exp(LOGITS[:3]) / np.exp(LOGITS[:3]).sum(), atol=0.015)


def test_top_p_keeps_the_smallest_nucleus():
    freq = _draw(20000, top_p=0.7)  # 0.4 + 0.25 = 0.65 < 0.7, so the third token is needed
    assert freq[3:].sum() == 0 and freq[2] > 0
    np.testing.assert_allclose(freq[:3], np.exp(LOGITS[:3]) / 0.8, atol=0.015)


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_best():
    # p = [0.4, 0.25, 0.15, 0.1, ...]: min_p 0.3 keeps p >= 0.12, the first three
    freq = _draw(20000, min_p=0.3)
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(freq[:3], np.exp(LOGITS[:3]) / 0.8, atol=0.015)
    # after temperature (p ~ e^(2 logit) at 0.5: 0.16/0.0625 ... relative 1, 0.39, 0.14, 0.0625)
    freq = _draw(20000, temperature=0.5, min_p=0.1)
    p = np.exp(LOGITS / 0.5)
    assert freq[3:].sum() == 0 and freq[2] > 0
    np.testing.assert_allclose(freq[:3], p[:3] / p[:3].sum(), atol=0.015)


def test_min_p_then_top_p_takes_the_nucleus_of_what_min_p_kept():
    # min_p 0.3 keeps 0.4, 0.25, 0.15 (renormalized 0.5, 0.3125, 0.1875); top_p 0.8 then needs
    # the first two (0.8125), where top-p alone (0.4 + 0.25 = 0.65 < 0.8) would need three
    freq = _draw(20000, min_p=0.3, top_p=0.8)
    assert freq[2:].sum() == 0
    np.testing.assert_allclose(freq[:2], [0.4 / 0.65, 0.25 / 0.65], atol=0.015)


def test_min_p_verification_is_lossless():
    """Rejection sampling of a draft under min-p: the output is distributed as the min-p
    distribution, and a draft min-p cut away is never accepted."""
    n = 40000
    s = SamplingArrays.host(n)
    s["temperature"][:] = 1.0
    s["min_p"][:] = 0.3
    s["key"][:] = np.random.SeedSequence(9).generate_state(2, np.uint32)
    rows = jnp.asarray(np.tile(LOGITS, (n, 1)))
    counter = jnp.arange(n, dtype=jnp.int32)
    for draft in (1, 4):  # kept (p 0.3125 after min-p) / cut away
        tok, acc, _ = jax.jit(verify)(rows, jnp.full(n, draft, jnp.int32), SamplingArrays(**s), counter)
        tok, acc = np.asarray(tok), np.asarray(acc)
        freq = np.bincount(tok, minlength=LOGITS.size) / n
        assert freq[3:].sum() == 0
        np.testing.assert_allclose(freq[:3], np.exp(LOGITS[:3]) / 0.8, atol=0.012)
        assert abs(acc.mean() - (0.25 / 0.8 if draft == 1 else 0.0)) < 0.01


def test_greedy_and_logprobs():
    s = SamplingArrays.host(2)
    s["want_logprobs"][:] = True
    lg = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]))
    tok, lp = jax.jit(sample)(lg, SamplingArrays(**s), jnp.zeros(2, jnp.int32))
    assert list(np.asarray(tok)) == [0, 7]
    np.testing.assert_allclose(np.asarray(lp), [LOGITS[0], LOGITS[0]], atol=1e-5)


def _run(engine, sp: SamplingParams, prompt="hello", rid="r"):
    engine.add_request(Request(rid, ByteTokenizer().encode(prompt), sp))
    toks = []
    while engine.has_work():
        for ev in engine.step().events:
            if ev.request_id == rid:
                toks += ev.token_ids
    return toks


def test_same_seed_same_output_different_seed_differs(tiny):
    e = make_engine(tiny)
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    a, b = _run(e, sp, rid="a"), _run(e, sp, rid="b")
    c = _run(e, SamplingParams(max_tokens=24, temperature=1.0, seed=8, ignore_eos=True), rid="c")
    assert a == b
    assert a != c


def test_any_64_bit_seed_runs_and_negatives_are_their_unsigned_twins(tiny):
    """seed -1 once raised inside a step (SeedSequence takes no negatives) and took the engine
    down; now it is read as 2**64 - 1."""
    e = make_engine(tiny)
    def run(seed, rid):
        return _run(e, SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True), rid=rid)

    minus_one, twin, lowest = run(-1, "a"), run(2**64 - 1, "b"), run(-(2**63), "c")
    assert len(minus_one) == len(lowest) == 12 and minus_one == twin
    assert run(-(2**63), "d") == lowest != minus_one


def test_top_k_minus_one_is_off(tiny):
    e = make_engine(tiny)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    off = _run(e, sp, rid="zero")
    assert _run(e, SamplingParams(**{**sp.__dict__, "top_k": -1}), rid="minus") == off
    assert _draw(20000, top_k=-1).tolist() == _draw(20000, top_k=0).tolist()


def test_seeded_output_does_not_depend_on_batch_neighbours(tiny):
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    alone = _run(make_engine(tiny), sp)
    e = make_engine(tiny)
    e.add_request(Request("other", ByteTokenizer().encode("some other prompt"),
                          SamplingParams(max_tokens=30, temperature=1.0)))
    assert _run(e, sp) == alone


def test_engine_logprobs_are_log_probabilities(tiny):
    e = make_engine(tiny)
    e.add_request(Request("r", ByteTokenizer().encode("hi"),
                          SamplingParams(max_tokens=5, logprobs=True, ignore_eos=True)))
    lps = []
    while e.has_work():
        for ev in e.step().events:
            lps += ev.logprobs or ()
    assert len(lps) == 5 and all(lp <= 0 for lp in lps) and any(lp < 0 for lp in lps)


def _wide_logits(seed=3):
    """8 TOP_BLOCK blocks; the mass lies in scattered tokens, some alone in their block."""
    V = 8 * TOP_BLOCK
    lg = np.full(V, -30.0, np.float32)
    hot = np.array([5, 300, 301, 777, 1100, 1535, 1536, 2047])
    lg[hot] = np.log(np.array([0.3, 0.2, 0.1, 0.1, 0.1, 0.08, 0.07, 0.05], np.float32))
    return lg, hot


def test_blocked_draw_matches_the_distribution_across_blocks():
    """The two-level inverse CDF (block by mass, then token in the block) is exact."""
    lg, hot = _wide_logits()
    n = 40000
    s = SamplingArrays.host(n)
    s["temperature"][:] = 1.0
    s["key"][:] = np.random.SeedSequence(5).generate_state(2, np.uint32)
    tok, _ = jax.jit(sample)(jnp.asarray(np.tile(lg, (n, 1))), SamplingArrays(**s),
                             jnp.arange(n, dtype=jnp.int32))
    freq = np.bincount(np.asarray(tok), minlength=lg.size) / n
    p = np.exp(lg) / np.exp(lg).sum()
    assert freq[np.setdiff1d(np.arange(lg.size), hot)].sum() < 0.002  # the -30 tail: ~2e-10 total
    np.testing.assert_allclose(freq[hot], p[hot], atol=0.01)


def test_verification_draws_what_plain_sampling_draws_and_accepts_a_matching_draft():
    """A sampled row's verified token is the token plain sampling draws at that position
    (same key, same counter), whatever the draft: the draft is accepted exactly when it is
    that token, so with probability p(draft) (token 5 is alone in block 0)."""
    lg, hot = _wide_logits()
    n = 40000
    s = SamplingArrays.host(n)
    s["temperature"][:] = 1.0
    s["key"][:] = np.random.SeedSequence(6).generate_state(2, np.uint32)
    rows = jnp.asarray(np.tile(lg, (n, 1)))
    counter = jnp.arange(n, dtype=jnp.int32)
    plain, _ = jax.jit(sample)(rows, SamplingArrays(**s), counter)
    plain = np.asarray(plain)
    p = np.exp(lg) / np.exp(lg).sum()
    for d in (5, hot[1], hot[-1], -1):
        tok, acc, _ = jax.jit(verify)(rows, jnp.full(n, d, jnp.int32), SamplingArrays(**s), counter)
        tok, acc = np.asarray(tok), np.asarray(acc)
        assert (tok == plain).all()
        assert (acc == (tok == d)).all()
        assert abs(acc.mean() - (p[d] if d >= 0 else 0.0)) < 0.01
    np.testing.assert_allclose(np.bincount(plain, minlength=lg.size)[hot] / n, p[hot], atol=0.01)


def test_top_candidates_are_the_top_k_and_greedy_takes_the_lowest_id_on_ties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 64 * TOP_BLOCK)).astype(np.float32)
    x[2, [7, 9000, 12000]] = 50.0  # a three-way tie for the max
    got = np.sort(np.asarray(jax.jit(top_candidates, static_argnums=1)(jnp.asarray(x), 16)), axis=-1)
    want = np.sort(np.argsort(-x, axis=-1, kind="stable")[:, :16], axis=-1)
    np.testing.assert_array_equal(got, want)
    assert list(np.asarray(greedy(jnp.asarray(x)))) == list(np.argmax(x, axis=-1))
    assert int(greedy(jnp.asarray(x))[2]) == 7


def test_top_p_beyond_the_candidates_falls_back_to_bisection():
    """A flat row whose nucleus needs more than CANDIDATES tokens still keeps the right set."""
    V = 4 * TOP_BLOCK
    lg = np.zeros((1, V), np.float32)
    lg[0, : V // 2] = 1.0  # the top half holds e/(e+1) = 0.731 of the mass
    s = SamplingArrays.host(1)
    s["temperature"][:] = 1.0
    s["top_p"][:] = 0.7
    p = np.asarray(filtered_probs(jnp.asarray(lg), SamplingArrays(**s)))[0]
    assert V // 2 > CANDIDATES
    np.testing.assert_allclose(p[: V // 2], 2 / V, rtol=1e-4)
    assert p[V // 2 :].sum() == 0


def test_top_logprobs_are_the_most_likely_tokens_best_first():
    s = SamplingArrays.host(2)
    s["want_logprobs"][:] = True
    lg = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]) + np.float32(3.0))  # unnormalized
    ids, lps = jax.jit(top_logprobs, static_argnums=2)(lg, SamplingArrays(**s), 5)
    assert np.asarray(ids).tolist() == [[0, 1, 2, 3, 4], [7, 6, 5, 4, 3]]
    np.testing.assert_allclose(np.asarray(lps), [LOGITS[:5], LOGITS[:5]], atol=1e-5)


def test_engine_lists_top_logprobs_with_and_without_speculation(tiny):
    """top_logprobs=5: five (id, logprob) pairs per token, best first; greedy's token is the
    first; the same lists when n-gram drafts are verified."""
    from engine.policy import BatchRule, TunedPolicy
    from tests.engine.conftest import SPEC_RC

    sp = SamplingParams(max_tokens=10, logprobs=True, top_logprobs=5, ignore_eos=True)
    runs = []
    for depth in (0, 4):
        e = make_engine(tiny, **SPEC_RC)
        if depth:
            e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", depth),), crossover=64, version=1))
        e.add_request(Request("r", ByteTokenizer().encode("abcabcabcabc abc"), sp))
        toks, tops = [], []
        while e.has_work():
            for ev in e.step().events:
                toks += ev.token_ids
                tops += ev.top_logprobs or ()
        runs.append((toks, tops))
        assert len(tops) == len(toks) == 10
        for t, top in zip(toks, tops, strict=True):
            lps = [lp for _, lp in top]
            assert len(top) == 5 and top[0][0] == t and lps == sorted(lps, reverse=True)
            assert all(lp <= 0 for lp in lps) and sum(np.exp(lps)) <= 1 + 1e-4
    (plain, plain_tops), (spec, spec_tops) = runs
    assert spec == plain
    assert [[i for i, _ in t] for t in spec_tops] == [[i for i, _ in t] for t in plain_tops]
