"""Penalties, min_tokens and min_p: the adjusted distribution, its per-position entries, and
speculation staying lossless with them (greedy equality; chi-square of the verified draws)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.execute.penalties import entries, fill_adjust
from engine.execute.runner import Scores, _verify
from engine.execute.sampling import Adjust, SamplingArrays, adjust_logits
from engine.policy import BatchRule, TunedPolicy
from engine.types import SamplingParams
from tests.engine.conftest import SPEC_PROMPTS, SPEC_RC, ByteTokenizer, make_engine, run_requests

TOK = ByteTokenizer()
IDS = [TOK.encode(p) for p in SPEC_PROMPTS]
INF = float("inf")


def _spec_engine(tiny, depth: int = 4):
    e = make_engine(tiny, **SPEC_RC)
    e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", depth),), crossover=64, version=1))
    return e


@pytest.fixture(scope="module")
def unpenalized(tiny):
    return run_requests(make_engine(tiny, **SPEC_RC), IDS, SamplingParams(max_tokens=24, ignore_eos=True))[0]


def test_adjust_logits_scales_then_adds_and_moves_greedy_off_a_banned_token():
    lg = jnp.asarray([[2.0, -1.0, 0.5, 0.0], [1.0, 3.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    a = Adjust.host((3, 3))
    a["ids"][0], a["scale"][0], a["add"][0] = [0, 1, 2], [2.0, 2.0, 1.0], [0.0, 0.0, -INF]
    a["ids"][1, 0], a["add"][1, 0] = 1, -INF
    out, best = adjust_logits(lg, jnp.asarray([0, 1, 3]), Adjust(**a))
    np.testing.assert_allclose(np.asarray(out), [[1.0, -2.0, -INF, 0.0], [1.0, -INF, 0.0, 0.0],
                                                 [0.0, 0.0, 5.0, 0.0]])
    assert list(np.asarray(best)) == [0, 0, 3]  # a row without entries keeps the caller's greedy


def test_each_verify_position_counts_the_drafts_before_it():
    sp = SamplingParams(max_tokens=8, frequency_penalty=1.0, min_tokens=2)
    adj = Adjust.host((1, 4, 8))
    fill_adjust(adj, 0, [2, 5, 6], 2, sp, frozenset({1}), drafts=[6, 1])  # prompt [2, 5], output [6]

    assert _written(adj, 0, 0) == {6: (1.0, -1.0), 1: (1.0, -INF)}  # one output: stop id 1 banned
    assert _written(adj, 0, 1) == {6: (1.0, -2.0)}  # after draft 6: two outputs, min_tokens met
    assert _written(adj, 0, 2) == {6: (1.0, -2.0), 1: (1.0, -1.0)}
    assert _written(adj, 0, 3) == {}  # past the drafts: unused


def _written(adj, row, j):
    """The entries at one position that change something: {id: (scale, add)}."""
    return {int(t): (float(sc), float(a)) for t, sc, a in zip(adj["ids"][row, j], adj["scale"][row, j],
                                                              adj["add"][row, j], strict=True)
            if t >= 0 and (sc != 1.0 or a != 0.0)}


def test_fill_adjust_writes_the_rules_of_entries():
    """The numpy fill equals the plain-Python rules on random requests, position by position."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        sp = SamplingParams(max_tokens=12, min_tokens=int(rng.integers(0, 8)),
                            presence_penalty=float(rng.choice([0.0, 0.5, -1.0])),
                            frequency_penalty=float(rng.choice([0.0, 0.25, 2.0])),
                            repetition_penalty=float(rng.choice([1.0, 1.3, 0.7])))
        tokens = rng.integers(0, 12, size=int(rng.integers(1, 12))).tolist()
        n_prompt = int(rng.integers(1, len(tokens) + 1))
        drafts = rng.integers(0, 12, size=int(rng.integers(0, 4))).tolist()
        stops = frozenset(rng.integers(0, 12, size=2).tolist())
        adj = Adjust.host((1, 4, 40))
        fill_adjust(adj, 0, tokens, n_prompt, sp, stops, drafts)
        for j in range(1 + len(drafts)):
            want = entries(sp, tokens[:n_prompt], tokens[n_prompt:] + drafts[:j], stops)
            assert _written(adj, 0, j) == {t: (np.float32(a), np.float32(b)) for t, (a, b) in want.items()
                                           if (a, b) != (1.0, 0.0)}, (sp, tokens, n_prompt, drafts, j)


def _rows(n, seed, **fields):
    s = SamplingArrays.host(n)
    s["temperature"][:] = 1.0
    s["key"][:] = np.random.SeedSequence(seed).generate_state(2, np.uint32)
    for k, v in fields.items():
        s[k][:] = v
    return SamplingArrays(**s)


def _chi2_matches(tok, p):
    """The draws `tok` fit the distribution p (zero where p is zero; chi-square p-value > 1e-4)."""
    obs = np.bincount(tok, minlength=p.size)
    assert obs[p == 0].sum() == 0
    keep = p > 0
    expected = p[keep].astype(np.float64) / p[keep].sum(dtype=np.float64) * tok.size
    assert stats.chisquare(obs[keep], expected).pvalue > 1e-4


def test_penalized_decode_and_verification_draw_from_the_adjusted_distribution():
    """Penalties and a ban on the logits: plain sampling and rejection sampling of a draft (one
    penalized, one banned) both give the adjusted softmax; a banned draft is never accepted;
    logprobs stay the model's."""
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005], np.float32))
    n = 40000
    a = Adjust.host((n, 1, 4))
    a["ids"][:, 0] = [0, 2, 3, 5]
    a["scale"][:, 0] = [1.0, 1.5, 1.0, 1.0]  # repetition penalty on a negative logit: times 1.5
    a["add"][:, 0] = [-1.0, 0.0, -INF, 0.5]  # frequency/presence; a banned stop id; a bonus
    adjusted = logits.copy()
    adjusted[0] -= 1.0
    adjusted[2] *= 1.5
    adjusted[3] = -np.inf
    adjusted[5] += 0.5
    p = np.exp(adjusted - adjusted[np.isfinite(adjusted)].max())
    p /= p.sum()
    sc = Scores(jnp.asarray(np.tile(logits, (n, 1, 1))), jnp.zeros((n, 1), jnp.int32))
    counter = jnp.arange(n, dtype=jnp.int32)[:, None]
    no_draft = jnp.full((n, 1), -1, jnp.int32)  # a decode: a position without a draft to check
    tok, _, lp, *_ = _verify(sc, no_draft, _rows(n, 3, want_logprobs=True), counter, Adjust(**a))
    tok = np.asarray(tok)[:, 0]
    _chi2_matches(tok, p)
    np.testing.assert_allclose(np.asarray(lp)[:, 0], logits[tok], atol=1e-5)
    for draft, seed in ((0, 4), (3, 5)):
        cand = jnp.full((n, 1), draft, jnp.int32)
        tok, acc, *_ = _verify(sc, cand, _rows(n, seed), counter, Adjust(**a))
        tok, acc = np.asarray(tok)[:, 0], np.asarray(acc)[:, 0]
        _chi2_matches(tok, p)
        assert abs(acc.mean() - p[draft]) < 0.01 and (tok[acc] == draft).all()


@pytest.mark.parametrize("pen", [dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
                                 dict(repetition_penalty=1.8),
                                 dict(frequency_penalty=0.5, repetition_penalty=1.3, presence_penalty=-0.5)],
                         ids=["presence", "frequency", "repetition", "all"])
def test_greedy_with_penalties_is_the_same_with_speculation(tiny, unpenalized, pen):
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **pen)
    plain, _ = run_requests(make_engine(tiny, **SPEC_RC), IDS, sp)
    assert plain != unpenalized  # the penalty changes the output
    spec, st = run_requests(_spec_engine(tiny), IDS, sp)
    assert spec == plain
    assert sum(s.proposed for s in st if s.technique == "ngram") > 0


def test_min_tokens_holds_off_stop_ids_with_and_without_speculation(tiny):
    """Each prompt's second greedy token is made a stop id: it ends the output at once, unless
    min_tokens=6 holds it off for six tokens; with n-gram drafts the output is the same."""
    plain, spec = make_engine(tiny, **SPEC_RC), _spec_engine(tiny)

    def one(engine, ids, **fields):
        return run_requests(engine, [ids], SamplingParams(ignore_eos=True, **fields))[0][0]

    for ids in IDS:
        stop = one(plain, ids, max_tokens=2)[1]
        assert len(one(plain, ids, max_tokens=16, stop_token_ids=(stop,))) <= 2
        held = one(plain, ids, max_tokens=16, stop_token_ids=(stop,), min_tokens=6)
        assert len(held) > 6 and stop not in held[:6]
        assert one(spec, ids, max_tokens=16, stop_token_ids=(stop,), min_tokens=6) == held


def test_min_p_one_keeps_only_the_best_token(tiny, unpenalized):
    """Sampling with min_p=1 keeps only the most likely token: greedy's output, with and
    without speculation (the core fills min_p in every row)."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=11, min_p=1.0)
    assert run_requests(make_engine(tiny, **SPEC_RC), IDS, sp)[0] == unpenalized
    assert run_requests(_spec_engine(tiny), IDS, sp)[0] == unpenalized


def test_serving_penalized_requests_compiles_nothing_after_warmup(tiny):
    e = make_engine(tiny, max_batch=2, max_context=32, verify_tokens=(3,), spec_max_batch=2)
    e.warmup(progress=False)
    e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=64, version=1))
    sp = SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.2, min_tokens=4)
    _, st = run_requests(e, [IDS[0], IDS[2]], sp)  # short prompts: the context is 32
    assert any(s.technique == "ngram" for s in st)
    assert e.compiles_since_warmup() == 0


def test_adjustments_that_do_not_fit_fail_their_request_alone(tiny, unpenalized):
    """More logit entries than the compiled width is that request's own fault: it ends with
    "error" and the others are served as if it were not there."""
    from engine.types import Request

    e = make_engine(tiny, **SPEC_RC)
    e.runner.adjust_width = 4  # the repetition penalty needs one entry per distinct prompt token
    e.add_request(Request("bad", IDS[1],
                          SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.5)))
    for i, ids in enumerate(IDS):
        e.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=24, ignore_eos=True)))
    out, reasons = {}, {}
    while e.has_work():
        o = e.step()
        for ev in o.events:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        reasons.update({r.request_id: r.finish_reason for r in o.finished})
    assert reasons.pop("bad") == "error" and set(reasons.values()) == {"length"}
    assert [out[f"r{i}"] for i in range(len(IDS))] == unpenalized and e.pool.used == 0
