"""Sampling: greedy, temperature, top-k, top-p, seeds and logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from engine.sampling import SamplingArrays, sample
from engine.types import Request, SamplingParams
from tests.engine.conftest import ByteTokenizer, make_engine

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005], np.float32))


def _draw(n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    s = SamplingArrays.host(n)
    s["temperature"][:] = temperature
    s["top_k"][:] = top_k
    s["top_p"][:] = top_p
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


def test_seeded_output_does_not_depend_on_batch_neighbours(tiny):
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    alone = _run(make_engine(tiny), sp)
    e = make_engine(tiny)
    e.add_request(Request("other", ByteTokenizer().encode("some other prompt"),
                          SamplingParams(max_tokens=30, temperature=1.0)))
    assert _run(e, sp) == alone


def test_engine_logprobs_are_log_probabilities(tiny):
    e = make_engine(tiny)
    e.add_request(Request("r", ByteTokenizer().encode("hi"), SamplingParams(max_tokens=5, logprobs=True, ignore_eos=True)))
    lps = []
    while e.has_work():
        for ev in e.step().events:
            lps += ev.logprobs or ()
    assert len(lps) == 5 and all(lp <= 0 for lp in lps) and any(lp < 0 for lp in lps)
