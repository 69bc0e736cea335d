"""Model-based proposers (MTP heads, early exit, draft model) are lossless and leak-free.

Tiny random model, random heads: acceptance is whatever it is; what must hold
is that greedy output equals plain decoding at every depth, sampled output
follows the target distribution, serving compiles nothing, and pages return.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

from engine.execute.runner import Scores, _verify
from engine.execute.sampling import SamplingArrays
from engine.policy import BatchRule, TunedPolicy
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.types import Request, SamplingParams
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.engine.conftest import (
    SPEC_RC,
    ByteTokenizer,
    LetterTokenizer,
    churn_with_aborts,
    make_engine,
    run_prompts,
)
from tests.engine.reference import dense_logits
from tests.engine.tiny import init_random_params, tiny_config

TOK = ByteTokenizer()
TECHNIQUES = ("mtp", "early_exit", "draft")


def _heads(cfg, scale=0.3):
    return DraftHeads.random(cfg, 8, (3, 6), 128, seed=1, scale=scale)


def _engine(tiny, heads=None, warm=True, **kw):
    """A tiny engine with every technique's proposer; `warm`: every shape compiled first, else
    each compiles on first use (a test of pages, not compiles, skips shapes it never runs)."""
    e = make_engine(tiny, **{**SPEC_RC, **kw})
    add_model_proposers(e, heads or _heads(tiny[0]), vocab_sizes=(0, 128))
    if warm:
        e.warmup(progress=False)
    return e


def _policy(technique, depth, split=0.2, vocab=0):
    return TunedPolicy(rules=(BatchRule(64, technique, depth),), crossover=64, pool_split=split,
                       draft_vocab=vocab, version=depth)


def _run(engine, prompts, sp):
    return run_prompts(engine, prompts, sp, TOK)


@pytest.fixture(scope="module")
def plain(tiny):
    return _run(make_engine(tiny, **SPEC_RC), PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))[0]


@pytest.fixture(scope="module")
def spec_engine(tiny):
    return _engine(tiny)


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("depth", range(1, 9))
def test_greedy_drafts_equal_plain_decoding(spec_engine, plain, technique, depth):
    e = spec_engine
    e.set_policy(_policy(technique, depth, vocab=128 if depth % 2 else 0))
    out, stats = _run(e, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert out == plain
    steps = [s for s in stats if s.technique == technique]
    assert steps and max(s.depth for s in steps) == depth and all(s.depth <= depth for s in steps)
    assert sum(s.proposed for s in steps) > 0
    assert e.compiles_since_warmup() == 0
    assert e.pool.used == 0 and e.pool.free == e.pool.total  # lent pages returned too
    assert e.proposers["draft"].held_pages() == 0


def test_a_policy_deeper_than_the_heads_verifies_only_what_they_draft(tiny, plain):
    """Two MTP heads under an mtp@8 policy: every step verifies depth 2 (no padded slots
    counted as rejected drafts), output still equal to plain decoding."""
    e = _engine(tiny, warm=False, heads=DraftHeads.random(tiny[0], 2, (3,), 128, seed=4, scale=0.3))
    e.set_policy(_policy("mtp", 8))
    out, stats = _run(e, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert out == plain
    steps = [s for s in stats if s.technique == "mtp"]
    # 2 drafts per drafting sequence, fewer only where max_tokens leaves room for 1
    assert steps and max(s.depth for s in steps) == 2
    assert all(len(s.accepted_per_pos) == s.depth <= 2 and 0 < s.proposed <= 2 * s.batch_size for s in steps)


def test_chained_mtp_drafts_of_each_depth_equal_the_heads_applied_in_turn(tiny):
    """One executable drafts every depth: depth k gives the chain's first k tokens, each the
    argmax over the draft vocabulary after head j saw the state and the token before it."""
    from engine.speculation.drafting import MtpProposer
    from engine.speculation.heads import apply_chain_head, token_features

    cfg, params = tiny
    heads = _heads(cfg, scale=1.0)
    p = MtpProposer(heads, params["embed"], sizes=(0,))
    rng = np.random.default_rng(3)
    h = rng.standard_normal((2, cfg.d_model)).astype(np.float32)
    last = np.array([5, 9], np.int32)
    emb, ids = p.slices.get(0)
    want, s, tok = [], jnp.asarray(h), jnp.asarray(last)
    for hd in heads.mtp:
        s = apply_chain_head(hd, s, token_features(params["embed"], tok))
        tok = jnp.asarray(ids)[jnp.argmax(s @ emb.T, axis=-1)]
        want.append(np.asarray(tok))
    want = np.stack(want, axis=1)
    for k in range(1, p.max_depth + 1):
        got = np.asarray(p._draft(k, jnp.asarray(h), last, emb, ids))
        np.testing.assert_array_equal(got[:, :k], want[:, :k])
        assert (got[:, k:] == 0).all()


@pytest.mark.parametrize("technique,layers", [("early_exit", 6), ("draft", 3)])
def test_layer_drafts_equal_a_dense_truncated_model(tiny, technique, layers):
    """With identity adapters and the full vocabulary, each draft is the argmax of the
    first `layers` layers run densely on the context plus the earlier drafts."""
    cfg, params = tiny
    e = make_engine(tiny, **SPEC_RC)
    add_model_proposers(e, _heads(cfg, scale=0.0), vocab_sizes=(0,))
    e.set_policy(_policy(technique, 5, split=0.25))
    e.add_request(Request("q", TOK.encode(PROMPTS[1]), SamplingParams(max_tokens=30, ignore_eos=True)))
    while "q" not in e._seqs or e._seqs["q"].num_output < 9:  # past the 8-token window and a few steps in
        e.step()
    seq = e._seqs["q"]
    drafts = e.proposers[technique].propose([seq], 5)[0]
    short = {**params, "layers": {k: v[:layers] for k, v in params["layers"].items()}}
    ctx = seq.tokens[: seq.num_cached + 1]
    want = []
    for _ in range(5):
        want.append(int(np.argmax(dense_logits(cfg.replace(n_layers=layers), short, ctx + want)[-1])))
    assert drafts == want


def test_draft_model_pool_follows_the_split(tiny):
    """No split, no draft KV: the draft model proposes nothing; with a split it drafts, in pages
    of the engine's own pools (it has no KV arrays of its own)."""
    e = _engine(tiny, warm=False)
    d = e.proposers["draft"]
    assert d.lends and d.pool is e.pool and d.runner is e.runner
    e.set_policy(_policy("draft", 3, split=0.0))
    _, stats = _run(e, PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert sum(s.proposed for s in stats) == 0 and e.pool.reserved == 0
    e.set_policy(_policy("draft", 3, split=0.25))
    _, stats = _run(e, PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert sum(s.proposed for s in stats) > 0 and e.pool.reserved > 0
    assert d.held_pages() == 0 and not e.pool.global_alloc.lent and not e.pool.local_alloc.lent


def test_leak_with_model_drafts_and_random_aborts(tiny):
    def policy_at(i):
        if i % 30 == 0:
            technique = TECHNIQUES[i // 30 % 3]
            return TunedPolicy(rules=(BatchRule(2, technique, 8), BatchRule(64, technique, 3)),
                               crossover=6, pool_split=0.2, version=i)
        return None

    e = _engine(tiny, warm=False, global_pages=60, local_pages=60)  # other pool shapes: other executables
    done = churn_with_aborts(e, 90, seed=7, policy_at=policy_at)
    assert len(done) == 90
    assert e.pool.used == 0 and e.pool.free == e.pool.total
    assert e.proposers["draft"].held_pages() == 0 and not e.proposers["draft"]._state
    assert not e.pool.global_alloc.lent and not e.pool.local_alloc.lent


# -- sampling is lossless with every technique's own drafts -------------------

TOY_VOCAB = 48
N_SAMPLES = 100_000


@pytest.fixture(scope="module")
def toy():
    cfg = tiny_config(vocab_size=TOY_VOCAB)
    return cfg, init_random_params(cfg, jax.random.PRNGKey(3))


@pytest.mark.parametrize("technique", ("ngram", *TECHNIQUES))
def test_sampling_with_drafts_matches_the_target_distribution(toy, technique):
    """Chi-square on 1e5 samples: the first emitted token follows p(.|ctx); given
    the first draft accepted, the second follows p(.|ctx, d1)."""
    cfg, params = toy
    e = make_engine(toy, LetterTokenizer(), **SPEC_RC)
    add_model_proposers(e, DraftHeads.random(cfg, 4, (2, 5), 32, seed=2, scale=0.0), vocab_sizes=(0, 32))
    e.set_policy(TunedPolicy(pool_split=0.25))  # plain decoding; the draft model gets its pool
    prompt = [2] + [5, 9, 11, 5, 9, 11, 5, 9] * 2
    e.add_request(Request("q", prompt, SamplingParams(max_tokens=100, ignore_eos=True)))
    drafts: list[int] = []
    for _ in range(90):  # until the proposer has three drafts (n-gram needs a match)
        e.step()
        seq = e._seqs["q"]
        if seq.num_output and len(drafts := e.proposers[technique].propose([seq], 3)[0]) >= 2:
            break
    assert len(drafts) >= 2, f"{technique} proposed {drafts}"
    drafts = drafts[:2]
    ctx = seq.tokens[: seq.num_cached + 1]
    lg = dense_logits(cfg, params, ctx + drafts)[-3:].astype(np.float32)  # [3, V]: after b, d1, d2
    s = SamplingArrays.host(N_SAMPLES)
    s["temperature"][:] = 1.0
    s["key"][:] = np.random.SeedSequence(11).generate_state(2, np.uint32)
    cand = np.tile(np.array(drafts + [-1], np.int32), (N_SAMPLES, 1))
    counter = np.tile(np.arange(3, dtype=np.int32), (N_SAMPLES, 1)) + 10_000 * np.arange(N_SAMPLES)[:, None]
    full = jnp.asarray(np.broadcast_to(lg, (N_SAMPLES, 3, TOY_VOCAB)))
    tok, acc, *_ = _verify(Scores(full, jnp.argmax(full, axis=-1).astype(jnp.int32)), jnp.asarray(cand),
                          SamplingArrays(**s), jnp.asarray(counter, jnp.int32))
    tok, acc = np.asarray(tok), np.asarray(acc)
    first = np.where(acc[:, 0], drafts[0], tok[:, 0])
    _chi_square(first, lg[0])
    took_d1 = acc[:, 0]
    second = np.where(acc[took_d1, 1], drafts[1], tok[took_d1, 1])
    assert took_d1.sum() > 1000, "d1 too improbable to test the second position"
    _chi_square(second, lg[1])


def _chi_square(samples: np.ndarray, logits: np.ndarray) -> None:
    logits = logits.astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    counts = np.bincount(samples, minlength=len(p))
    expected = p * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep].astype(np.float64), exp[keep]
    stat, pval = sstats.chisquare(obs, exp * (obs.sum() / exp.sum()))
    assert pval > 1e-3, f"chi-square {stat:.1f}, p={pval:.2e}"
