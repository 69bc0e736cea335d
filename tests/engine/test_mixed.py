"""Mixed steps: decode rows and prefill chunks in one forward (engine/mixed.py, engine/step.py)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np

import engine.step as step_mod
from engine.kv import Batch, KVState, cache_reader
from engine.model import forward, forward_segments, unstack_layers
from engine.scheduler import mix_chunk
from engine.types import Request, SamplingParams
from tests.engine.conftest import ByteTokenizer
from tests.engine.conftest import make_engine as _make_engine

TOK = ByteTokenizer()
MIX = dict(mix_tokens_per_row=4)


def make_engine(tiny, tokenizer=None, **rc):
    """The padded steps' engine (EngineConfig.ragged_steps off): what this module tests."""
    return _make_engine(tiny, tokenizer, ragged_steps=False, **rc)


def _count_mixed(monkeypatch, sizes: list | None = None) -> list[int]:
    """Counts calls of engine.step's run_mixed (the chunks each carried); `sizes` gets each
    call's (decode rows, prefill tokens)."""
    seen: list[int] = []
    real = step_mod.run_mixed

    def spy(runner, calls):
        seen.append(int((calls[1].n_new > 0).sum()))
        if sizes is not None:
            sizes.append((int((calls[0].n_new > 0).sum()), int(calls[1].n_new.sum())))
        return real(runner, calls)

    monkeypatch.setattr(step_mod, "run_mixed", spy)
    return seen


def _staggered(engine, prompts: list[list[int]], sp, every: int = 3):
    """Send one prompt every `every` steps (so prompts arrive while others decode); tokens per
    request and the step stats."""
    out = {f"r{i}": [] for i in range(len(prompts))}
    stats, i, n = [], 0, 0
    while i < len(prompts) or engine.has_work():
        if i < len(prompts) and n % every == 0:
            engine.add_request(Request(f"r{i}", prompts[i], sp))
            i += 1
        o = engine.step()
        n += 1
        stats += [o.stats] if o.stats else []
        for ev in o.events:
            out[ev.request_id] += ev.token_ids
    return [out[f"r{k}"] for k in range(len(prompts))], stats


PROMPTS = [TOK.encode(("the quick brown fox %d " % i) * (1 + i % 4)) for i in range(8)]


def test_mixed_steps_keep_greedy_output_and_carry_chunks(tiny, monkeypatch):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    plain, _ = _staggered(make_engine(tiny), PROMPTS, sp)
    sizes: list[tuple[int, int]] = []
    seen = _count_mixed(monkeypatch, sizes)
    engine = make_engine(tiny, **MIX)
    mixed, _ = _staggered(engine, PROMPTS, sp)
    assert mixed == plain
    assert len(seen) >= 5 and all(k == 1 for k in seen)
    # a decode call carries at most mix_chunk prefill tokens
    assert all(0 < n <= mix_chunk(d, 4, (4, 8, 16)) for d, n in sizes if d)
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total


def test_without_mixing_chunks_run_apart(tiny, monkeypatch):
    seen = _count_mixed(monkeypatch)
    _staggered(make_engine(tiny), PROMPTS[:4], SamplingParams(max_tokens=6, ignore_eos=True))
    assert seen == []


def test_mixed_serving_compiles_nothing_after_warmup_and_leaks_no_page(tiny, monkeypatch):
    seen = _count_mixed(monkeypatch)
    engine = make_engine(tiny, global_pages=60, local_pages=60, **MIX)
    engine.warmup(progress=False)
    rng = random.Random(3)
    live: set[str] = set()
    sent, n = 0, 0
    while sent < 30 or engine.has_work():
        if sent < 30 and rng.random() < 0.5:
            sp = SamplingParams(max_tokens=rng.randint(1, 25), temperature=rng.choice([0.0, 1.0]),
                                logprobs=rng.random() < 0.3, top_logprobs=rng.choice([0, 2]),
                                repetition_penalty=rng.choice([1.0, 1.3]), seed=sent, ignore_eos=True)
            engine.add_request(Request(f"q{sent}", TOK.encode("w " * rng.randint(1, 30)), sp))
            live.add(f"q{sent}")
            sent += 1
        if live and rng.random() < 0.03:
            engine.abort(rng.choice(sorted(live)))
        out = engine.step()
        n += 1
        for res in out.finished:
            live.discard(res.request_id)
    assert seen, "no step mixed"
    assert engine.compiles_since_warmup() == 0
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total


def test_forward_segments_matches_forward_per_segment(tiny):
    cfg, params = tiny
    params = unstack_layers(params)
    kv = KVState.create(cfg, 16, 16, 4, jnp.float32)
    kv = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(1), a.shape, a.dtype), kv)
    rng = np.random.default_rng(0)

    def batch(B, T, start):
        n = np.full(B, T, np.int32)
        return Batch(rng.integers(3, 200, (B, T)).astype(np.int32), np.full(B, start, np.int32), n,
                     rng.integers(1, 16, (B, 8)).astype(np.int32), rng.integers(1, 16, (B, 6)).astype(np.int32))

    segs = [batch(3, 1, 9), batch(1, 8, 5)]
    args = [(b.tokens, b.positions(), cache_reader(kv, b, 6)) for b in segs]
    hs, kvs = forward_segments(cfg, params, args)
    for (tok, pos, read), h, nk in zip(args, hs, kvs):
        h1, nk1, _ = forward(cfg, params, tok, pos, read)
        np.testing.assert_allclose(np.asarray(h), np.asarray(h1), rtol=2e-5, atol=2e-5)
        for kind in ("global", "local"):
            np.testing.assert_allclose(np.asarray(nk[kind][0]), np.asarray(nk1[kind][0]), rtol=2e-5, atol=2e-5)


def test_a_long_prompt_is_cut_at_buckets_instead_of_padded_up(tiny):
    engine = make_engine(tiny)  # prefill buckets (4, 8, 16)
    engine.add_request(Request("a", list(range(3, 3 + 10)), SamplingParams(max_tokens=1)))
    engine.step()  # 10 tokens: padding to 16 wastes 6 >= 4, so 8 now and 2 next
    assert engine._seqs["a"].num_cached == 8


def test_only_long_prompts_are_capped_while_others_decode(tiny, monkeypatch):
    """A prompt longer than the largest chunk (16 here) is prefilled mix_chunk tokens a step in
    the decode call; a short one that arrives with it is prefilled whole in the same step."""
    seen = _count_mixed(monkeypatch)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = {"s0": TOK.encode("ab cd ef"), "s1": TOK.encode("gh ij kl"), "long": TOK.encode("the lazy dog " * 5),
               "short": TOK.encode("the quick fox")}
    outputs = {}
    for mix in ({}, MIX):
        engine = make_engine(tiny, **mix)
        out = {k: [] for k in prompts}
        for k in ("s0", "s1"):
            engine.add_request(Request(k, prompts[k], sp))
        while not (out["s0"] and out["s1"]):  # both streams decoding
            for ev in engine.step().events:
                out[ev.request_id] += ev.token_ids
        engine.add_request(Request("long", prompts["long"], SamplingParams(max_tokens=4, ignore_eos=True)))
        engine.add_request(Request("short", prompts["short"], SamplingParams(max_tokens=4, ignore_eos=True)))
        first = engine.step()
        for ev in first.events:
            out[ev.request_id] += ev.token_ids
        if mix:
            cap = mix_chunk(2, 4, (4, 8, 16))
            assert first.stats.prefill_tokens == cap + len(prompts["short"])
            assert out["short"], "the short prompt was not prefilled whole in the step it arrived in"
            assert engine._seqs["long"].num_cached == cap
        while engine.has_work():
            o = engine.step()
            if mix and "long" in engine._seqs and engine._seqs["long"].remaining > 1 and o.stats.decode_tokens:
                assert o.stats.prefill_tokens <= cap
            for ev in o.events:
                out[ev.request_id] += ev.token_ids
        assert engine.pool.used == 0
        outputs[bool(mix)] = out
    assert outputs[True] == outputs[False]
    assert len(seen) >= 3 and all(k == 1 for k in seen)
