"""Speculative decoding is lossless: greedy output identical to plain decoding,
sampled output distributed as the target, pages all returned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.execute.sampling import SamplingArrays, verify
from engine.policy import BatchRule, TunedPolicy
from engine.speculation.proposers import NgramProposer
from engine.types import SamplingParams
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.engine.conftest import SPEC_RC, ByteTokenizer, churn_with_aborts, make_engine, run_prompts

TOK = ByteTokenizer()


def _policy(depth: int, technique: str = "ngram") -> TunedPolicy:
    return TunedPolicy(rules=(BatchRule(64, technique, depth),), crossover=64, version=depth)


def _run(engine, prompts, sp):
    return run_prompts(engine, prompts, sp, TOK)


def test_ngram_lookup_finds_latest_match():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.lookup([5, 6, 7, 9, 5, 6], 3) == [7, 9, 5]
    assert p.lookup([1, 2, 3], 2) == []
    assert p.lookup([4, 1, 4, 2, 4], 2) == [2, 4]  # the latest occurrence of [4] wins


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    return _run(make_engine(tiny, **SPEC_RC), PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))[0]


@pytest.mark.parametrize("depth", range(1, 9))
def test_greedy_speculation_equals_plain_decoding(tiny, plain_greedy, depth):
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = plain_greedy
    e = make_engine(tiny, **SPEC_RC)
    e.set_policy(_policy(depth))
    spec, stats = _run(e, PROMPTS, sp)
    assert spec == plain
    spec_steps = [s for s in stats if s.technique == "ngram"]
    # the policy's depth, less where a request's max_tokens leaves room for fewer drafts
    assert spec_steps and max(s.depth for s in spec_steps) == depth
    assert all(s.policy_version == depth and len(s.accepted_per_pos) == s.depth <= depth for s in spec_steps)
    assert sum(s.proposed for s in spec_steps) > 0
    assert e.pool.used == 0


def test_speculation_accepts_on_repetitive_text_and_saves_steps(tiny):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    e = make_engine(tiny, **SPEC_RC)
    _, plain_stats = _run(e, PROMPTS[:1], sp)
    e.set_policy(_policy(4))
    _, spec_stats = _run(e, PROMPTS[:1], sp)
    acc = sum(s.accepted for s in spec_stats)
    assert acc > 0
    assert len(spec_stats) < len(plain_stats)


def test_leak_with_speculation_and_random_aborts(tiny):
    e = make_engine(tiny, global_pages=60, local_pages=60, **SPEC_RC)
    e.set_policy(TunedPolicy(rules=(BatchRule(2, "ngram", 8), BatchRule(64, "ngram", 3)), crossover=6))
    done = churn_with_aborts(e, 150, seed=5)
    assert len(done) == 150
    assert e.pool.used == 0 and e.pool.free == e.pool.total


def test_sampled_verification_preserves_the_distribution():
    """Deterministic draft d: the output is p's own draw, d accepted when it is that draw."""
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))
    n = 40000
    s = SamplingArrays.host(n)
    s["temperature"][:] = 1.0
    s["key"][:] = np.random.SeedSequence(1).generate_state(2, np.uint32)
    for d in (0, 3):
        tok, acc, _ = jax.jit(verify)(jnp.asarray(np.tile(logits, (n, 1))), jnp.full(n, d, jnp.int32),
                                      SamplingArrays(**s), jnp.arange(n, dtype=jnp.int32))
        tok, acc = np.asarray(tok), np.asarray(acc)
        freq = np.bincount(tok, minlength=5) / n
        np.testing.assert_allclose(freq, np.exp(logits), atol=0.01)
        assert abs(acc.mean() - np.exp(logits[d])) < 0.01
        assert (tok[acc] == d).all() and (tok[~acc] != d).all()


@pytest.mark.parametrize("depth", (1, 3, 8))
def test_seeded_sampled_output_is_the_same_with_and_without_speculation(tiny, depth):
    """Verification draws each position with the numbers plain decoding uses there, so a
    seeded request's tokens do not depend on the policy (and drafts are still accepted)."""
    sp = SamplingParams(max_tokens=24, temperature=0.7, top_k=4, seed=11, ignore_eos=True)
    plain = _run(make_engine(tiny, **SPEC_RC), PROMPTS, sp)[0]
    e = make_engine(tiny, **SPEC_RC)
    e.set_policy(_policy(depth))
    spec, stats = _run(e, PROMPTS, sp)
    assert spec == plain
    steps = [s for s in stats if s.technique == "ngram"]
    assert steps and all(s.sampled_rows > 0 for s in steps)
    assert sum(s.accepted for s in steps) > 0
    assert e.pool.used == 0


def test_pool_split_lends_pages_to_speculation_and_tenants_see_fewer(tiny):
    e = make_engine(tiny, **SPEC_RC)
    total = e.status()["kv_pages_total"]
    e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=8, pool_split=0.25, version=3))
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    _, stats = _run(e, PROMPTS[:2], sp)
    st = e.status()
    assert st["kv_pages_reserved"] == 2 * int(199 * 0.25)
    assert st["kv_pages_total"] == total - st["kv_pages_reserved"]
    assert all(s.kv_pages_used + s.kv_pages_free == st["kv_pages_total"] for s in stats)
    assert e.pool.used == 0
    e.set_policy(TunedPolicy(version=4))
    _run(e, PROMPTS[:1], sp)
    assert e.status()["kv_pages_total"] == total


def test_capacity_names_what_the_engine_compiled_and_holds(tiny):
    e = make_engine(tiny, **SPEC_RC)
    cap = e.capacity()
    assert (cap.max_depth, cap.spec_max_batch) == (8, 8)  # every depth up to 8 verifies
    assert cap.max_batch == e.max_batch
    assert cap.total_pages == cap.usable_pages == e.status()["kv_pages_total"] and cap.page_bytes > 0
    assert set(cap.proposers) == {"ngram"} and cap.proposers["ngram"].draft_vocabs == ()
    assert cap.backend == jax.default_backend()  # the starter policy reads it (daemon/tuning.py)
    e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=8, pool_split=0.25))
    _run(e, PROMPTS[:1], SamplingParams(max_tokens=2))
    split = e.capacity()
    assert split.total_pages == cap.total_pages and split.usable_pages < cap.total_pages


def test_exploration_is_checked_and_stamped_like_the_rules(tiny):
    """A policy's exploration may not go deeper than the compiled verify sizes; its steps carry
    the depth they ran and the policy's version, and stay lossless."""
    from engine.policy import Exploration

    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = _run(make_engine(tiny, **SPEC_RC), PROMPTS, sp)[0]
    e = make_engine(tiny, verify_tokens=(2, 3, 5), spec_max_batch=8)
    with pytest.raises(ValueError, match="verify"):
        e.set_policy(TunedPolicy((BatchRule(64, "ngram", 2),), crossover=64,
                                 explore=Exploration(0.5, ("ngram",), (1, 2, 8))))
    e.set_policy(TunedPolicy((BatchRule(64, "ngram", 2),), crossover=64, version=7,
                             explore=Exploration(0.5, ("ngram",), (1, 2, 4))))
    spec, stats = _run(e, PROMPTS, sp)
    assert spec == plain
    ran = {(s.technique, s.depth) for s in stats if s.technique != "none"}
    assert ran <= {("ngram", 1), ("ngram", 2), ("ngram", 4)} and len(ran) > 1
    assert {s.policy_version for s in stats} == {7}
