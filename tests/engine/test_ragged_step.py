"""Steps as ragged calls (EngineConfig.ragged_steps, engine/ragged_step.py) give what the padded
steps give: the same greedy tokens with and without the prefix cache and with every
speculation technique, the same seeded samples, logprobs and penalties; nothing compiles after
warmup and every page returns."""

from __future__ import annotations

import numpy as np
import pytest

from engine import ragged_step
from engine.core import EngineConfig, EngineCore
from engine.drafting import add_model_proposers
from engine.heads import DraftHeads
from engine.policy import BatchRule, TunedPolicy
from engine.ragged_calls import token_buckets
from engine.runner import RunnerConfig
from engine.types import Request, SamplingParams
from engine.warm import max_tokens
from tests.engine.conftest import SPEC_PROMPTS, SPEC_RC, TINY_RC, ByteTokenizer, make_engine, run_prompts

TOK = ByteTokenizer()
EXACT = dict(fast_output=False)  # the bfloat16 output pass runs from 2 output rows on, so a sampled
# row's draws would depend on how many rows share its call in either engine
PROMPTS = SPEC_PROMPTS + ["a longer prompt: it takes more than one chunk of the step's token budget"]


def _engine(tiny, prefix_cache=True, spec=False):
    rc = RunnerConfig(**{**TINY_RC.__dict__, **EXACT, **(SPEC_RC if spec else {})})
    e = EngineCore(tiny[0], tiny[1], TOK, EngineConfig(runner=rc, token_budget=32, prefix_cache=prefix_cache,
                                                       ragged_steps=True))
    if spec:
        heads = DraftHeads.random(tiny[0], 8, (3, 6), 128, seed=1, scale=0.3)
        add_model_proposers(e, heads, vocab_sizes=(0,))
    e.warmup(progress=False)
    return e


@pytest.fixture(scope="module")
def padded(tiny):
    sps = _params()
    e = make_engine(tiny, ragged_steps=False, **EXACT)
    return [run_prompts(e, PROMPTS, sp, TOK)[0] for sp in sps]


def _params():
    return [SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7, logprobs=True,
                           top_logprobs=2),
            SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5)]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_ragged_steps_give_the_padded_steps_tokens(tiny, padded, prefix_cache, monkeypatch):
    cuts, fit = [], ragged_step.fit_step

    def fit_step(decode_tokens, chunks, buckets):
        out = fit(decode_tokens, chunks, buckets)
        cuts.append(out != chunks)
        return out

    e = _engine(tiny, prefix_cache)
    monkeypatch.setattr(ragged_step, "fit_step", fit_step)
    mixed = 0
    for sp, want in zip(_params(), padded):
        out, stats = run_prompts(e, PROMPTS, sp, TOK)
        assert out == want
        mixed += sum(bool(s.prefill_tokens and s.decode_tokens) for s in stats)
    assert mixed  # steps with decode rows and prefill chunks in one call
    assert any(cuts)  # and steps whose chunks were cut to end on a token bucket
    ran = 0
    while e.idle():  # idle moments run each ragged call once (none of the padded calls: never compiled)
        ran += 1
    assert ran >= len(token_buckets(max_tokens(e))) and e.compiles_since_warmup() == 0
    assert e.pool.used == 0  # a first run writes the scratch page alone
    assert e.pool.used == 0 and e.pool.free == e.pool.total


def test_logprobs_of_ragged_steps_equal_the_padded_steps(tiny):
    sp = _params()[1]
    got, want = [], []
    for e, into in ((_engine(tiny), got), (make_engine(tiny, ragged_steps=False, **EXACT), want)):
        e.add_request(Request("q", TOK.encode(PROMPTS[0]), sp))
        while e.has_work():
            for ev in e.step().events:
                into.append((ev.token_ids, ev.logprobs, ev.top_logprobs))
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    for (_, lp, top), (_, wlp, wtop) in zip(got, want):
        np.testing.assert_allclose(lp, wlp, rtol=1e-3, atol=1e-3)
        assert [[t for t, _ in pos] for pos in top] == [[t for t, _ in pos] for pos in wtop]


@pytest.mark.parametrize("technique,depth", [("ngram", 3), ("mtp", 2), ("early_exit", 4), ("draft", 5)])
def test_speculation_in_ragged_steps_equals_plain_decoding(tiny, padded, technique, depth):
    e = _engine(tiny, spec=True)
    e.set_policy(TunedPolicy(rules=(BatchRule(64, technique, depth),), crossover=64, pool_split=0.2,
                             version=1))
    out, stats = run_prompts(e, PROMPTS, _params()[0], TOK)
    assert out == padded[0]
    steps = [s for s in stats if s.technique == technique]
    assert steps and sum(s.proposed for s in steps) > 0
    assert sum(s.accepted for s in steps) > 0  # drafts were verified and kept, not only decoded past
    assert all(sum(s.accepted_per_pos) == s.accepted and len(s.accepted_per_pos) == s.depth for s in steps)
    while e.idle():
        pass
    assert e.compiles_since_warmup() == 0
    assert e.pool.used == 0 and e.pool.free == e.pool.total
