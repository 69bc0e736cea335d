"""Steps as ragged calls (engine/step/ragged_step.py): a batch of prompts gives each prompt what it
gets decoded alone (a batch of one, no prefix cache, no speculation), whose greedy tokens and
logprobs are the dense reference model's: the same greedy tokens with and without the prefix
cache and with every speculation technique, the same seeded samples, logprobs and penalties;
nothing compiles after warmup and every page returns."""

from __future__ import annotations

import numpy as np
import pytest

from engine.execute.ragged_calls import token_buckets
from engine.execute.runner import RunnerConfig
from engine.policy import BatchRule, TunedPolicy
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.step import ragged_step
from engine.step.core import EngineConfig, EngineCore
from engine.types import Request, SamplingParams
from engine.warmup.warm import max_tokens
from tests.engine.conftest import SPEC_PROMPTS, SPEC_RC, TINY_RC, ByteTokenizer, run_prompts
from tests.engine.reference import dense_logits

TOK = ByteTokenizer()
EXACT = dict(fast_output=False)  # the bfloat16 output pass runs from 2 output rows on, so a sampled
# row's draws would depend on how many rows share its call in either engine
PROMPTS = SPEC_PROMPTS + ["a longer prompt: it takes more than one chunk of the step's token budget"]


def _engine(tiny, prefix_cache=True, spec=False):
    rc = RunnerConfig(**{**TINY_RC.__dict__, **EXACT, **(SPEC_RC if spec else {})})
    e = EngineCore(tiny[0], tiny[1], TOK, EngineConfig(runner=rc, token_budget=32, prefix_cache=prefix_cache))
    if spec:
        heads = DraftHeads.random(tiny[0], 8, (3, 6), 128, seed=1, scale=0.3)
        add_model_proposers(e, heads, vocab_sizes=(0,))
    e.warmup(progress=False)
    return e


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _run_alone(e, prompt: str, sp) -> list[tuple]:
    """(token ids, logprobs, top logprobs) of each event of `prompt` decoded alone on `e`."""
    e.add_request(Request("alone", TOK.encode(prompt), sp))
    events = []
    while e.has_work():
        events += [(ev.token_ids, ev.logprobs, ev.top_logprobs) for ev in e.step().events]
    return events


@pytest.fixture(scope="module")
def alone(tiny):
    """Per sampling params of `_params`, each prompt's tokens decoded alone; the greedy ones
    checked against the dense reference model's argmax."""
    e = _engine(tiny, prefix_cache=False)
    out = [[[t for ev in _run_alone(e, p, sp) for t in ev[0]] for p in PROMPTS] for sp in _params()]
    for prompt, toks in zip(PROMPTS, out[0]):
        ids = TOK.encode(prompt)
        for t in toks:
            assert t == int(np.argmax(dense_logits(tiny[0], tiny[1], ids)[-1])), prompt
            ids.append(t)
    assert e.pool.used == 0 and e.pool.free == e.pool.total
    return out


def _params():
    return [SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7, logprobs=True,
                           top_logprobs=2),
            SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5)]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_batch_gives_each_prompt_its_tokens_decoded_alone(tiny, alone, prefix_cache, monkeypatch):
    cuts, fit = [], ragged_step.fit_step

    def fit_step(decode_tokens, chunks, buckets, later=True):
        out = fit(decode_tokens, chunks, buckets, later)
        cuts.append(out != chunks)
        return out

    e = _engine(tiny, prefix_cache)
    monkeypatch.setattr(ragged_step, "fit_step", fit_step)
    mixed = 0
    for sp, want in zip(_params(), alone):
        out, stats = run_prompts(e, PROMPTS, sp, TOK)
        assert out == want
        mixed += sum(bool(s.prefill_tokens and s.decode_tokens) for s in stats)
    assert mixed  # steps with decode rows and prefill chunks in one call
    assert any(cuts)  # and steps whose chunks were cut to end on a token bucket
    ran = 0
    while e.idle():  # idle moments run each ragged call once
        ran += 1
    assert ran >= len(token_buckets(max_tokens(e))) and e.compiles_since_warmup() == 0
    assert e.pool.used == 0  # a first run writes the scratch page alone
    assert e.pool.used == 0 and e.pool.free == e.pool.total


def test_logprobs_in_a_batch_equal_those_decoded_alone_and_the_dense_models(tiny):
    """A sampled request's logprobs and top logprobs in a batch equal those it gets alone, and
    they are the dense reference model's (the model's own distribution, before temperature)."""
    sp = _params()[1]
    e = _engine(tiny)
    for i, p in enumerate(PROMPTS[1:]):
        e.add_request(Request(f"other{i}", TOK.encode(p), sp))
    e.add_request(Request("q", TOK.encode(PROMPTS[0]), sp))
    got = []
    while e.has_work():
        got += [(ev.token_ids, ev.logprobs, ev.top_logprobs) for ev in e.step().events
                if ev.request_id == "q"]
    want = _run_alone(_engine(tiny, prefix_cache=False), PROMPTS[0], sp)
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    for (_, lp, top), (_, wlp, wtop) in zip(got, want):
        np.testing.assert_allclose(lp, wlp, rtol=1e-3, atol=1e-3)
        assert [[t for t, _ in pos] for pos in top] == [[t for t, _ in pos] for pos in wtop]
    ids = TOK.encode(PROMPTS[0])
    for toks, lp, top in got:
        for t, x, pos in zip(toks, lp, top, strict=True):
            ref = _log_softmax(dense_logits(tiny[0], tiny[1], ids)[-1])
            assert x == pytest.approx(ref[t], abs=1e-3)
            assert [i for i, _ in pos] == list(np.argsort(-ref)[: len(pos)])
            ids.append(t)


@pytest.mark.parametrize("technique,depth", [("ngram", 3), ("mtp", 2), ("early_exit", 4), ("draft", 5)])
def test_speculation_in_ragged_steps_equals_plain_decoding(tiny, alone, technique, depth):
    e = _engine(tiny, spec=True)
    e.set_policy(TunedPolicy(rules=(BatchRule(64, technique, depth),), crossover=64, pool_split=0.2,
                             version=1))
    out, stats = run_prompts(e, PROMPTS, _params()[0], TOK)
    assert out == alone[0]
    steps = [s for s in stats if s.technique == technique]
    assert steps and sum(s.proposed for s in steps) > 0
    assert sum(s.accepted for s in steps) > 0  # drafts were verified and kept, not only decoded past
    assert all(sum(s.accepted_per_pos) == s.accepted and len(s.accepted_per_pos) == s.depth for s in steps)
    while e.idle():
        pass
    assert e.compiles_since_warmup() == 0
    assert e.pool.used == 0 and e.pool.free == e.pool.total


@pytest.mark.parametrize("spec", [False, True])
def test_rows_with_penalties_beside_rows_without_get_what_each_gets_alone(tiny, alone, spec, monkeypatch):
    """A call's slots with logit adjustments are drawn again in heads calls of their own
    (ragged_calls._adjusted_heads), here two slots a call: greedy and penalized rows in one
    batch, verifying n-gram drafts or not, each get their tokens decoded alone."""
    from engine.execute import ragged_calls

    monkeypatch.setattr(ragged_calls, "ADJUST_OUTPUTS", 2)
    e = _engine(tiny, spec=spec)
    if spec:
        e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 3),), crossover=64, version=1))
    params = _params()
    for i, p in enumerate(PROMPTS):
        e.add_request(Request(f"r{i}", TOK.encode(p), params[0 if i % 2 else 2]))
    got: dict[str, list[int]] = {}
    stats = []
    while e.has_work():
        out = e.step()
        stats.append(out.stats)
        for ev in out.events:
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    for i in range(len(PROMPTS)):
        assert got[f"r{i}"] == alone[0 if i % 2 else 2][i], i
    assert any(alone[2][i] != alone[0][i] for i in range(0, len(PROMPTS), 2))  # the penalties bite
    assert not spec or any(s is not None and s.technique == "ngram" and s.accepted for s in stats)
    assert e.compiles_since_warmup() == 0
    assert e.pool.used == 0 and e.pool.free == e.pool.total
