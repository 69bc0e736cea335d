"""Rows of one step drafting with different techniques and depths (per-tenant rules) on the tiny
random model: greedy output equals plain decoding, one verify call carries every row, a row
with no drafts still emits exactly one token, a row whose proposal fails is dropped alone, and
every page comes back."""

from __future__ import annotations

import numpy as np
import pytest

from engine.execute.sampling import SamplingArrays, verify
from engine.policy import BatchRule, TenantRule, TunedPolicy
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.types import Request, SamplingParams
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.engine.conftest import SPEC_RC, ByteTokenizer, churn_with_aborts, make_engine

TOK = ByteTokenizer()
TENANTS = ("copy", "code", "chat")
POLICY = TunedPolicy((BatchRule(64, "ngram", 2),), crossover=64, pool_split=0.2, version=7,
                     tenants=(TenantRule("copy", "ngram", 8), TenantRule("code", "mtp", 3),
                              TenantRule("chat")))
"""copy: n-gram at depth 8; code: MTP at depth 3; chat: no drafts; others: n-gram at depth 2."""
SP = SamplingParams(max_tokens=24, ignore_eos=True)


def _tenant(i: int) -> str:
    return (*TENANTS, "prose")[i % 4]


def _run(engine, prompts=PROMPTS, sp=SP):
    """Each prompt as request r<i> of tenant `_tenant(i)`: (tokens per prompt, stats, the number of
    tokens each step gave each request)."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", TOK.encode(p), sp, tenant=_tenant(i)))
    out = {f"r{i}": [] for i in range(len(prompts))}
    stats, emitted = [], []
    while engine.has_work():
        o = engine.step()
        stats += [o.stats] if o.stats else []
        emitted.append({ev.request_id: len(ev.token_ids) for ev in o.events})
        for ev in o.events:
            out[ev.request_id] += ev.token_ids
    return [out[f"r{i}"] for i in range(len(prompts))], stats, emitted


@pytest.fixture(scope="module")
def plain(tiny):
    return _run(make_engine(tiny, **SPEC_RC))[0]


@pytest.fixture(scope="module")
def engine(tiny):
    e = make_engine(tiny, **SPEC_RC)
    add_model_proposers(e, DraftHeads.random(tiny[0], 8, (3, 6), 128, seed=1, scale=0.3),
                        vocab_sizes=(0, 128))
    e.warmup(progress=False)
    return e


def test_rows_of_different_techniques_and_depths_in_one_step_equal_plain(engine, plain):
    engine.set_policy(POLICY)
    out, stats, emitted = _run(engine)
    assert out == plain
    mixed = [s for s in stats if len({(c.technique, c.depth) for c in s.row_classes if c.depth}) >= 2]
    assert mixed, "no step verified rows of two (technique, depth) classes"
    for s in stats:
        classes = s.row_classes
        assert sum(c.rows for c in classes) == s.decode_tokens - s.accepted  # every decode row
        assert s.proposed == sum(c.proposed for c in classes)
        assert s.accepted == sum(c.accepted for c in classes)
        assert s.depth == max((c.depth for c in classes if c.proposed), default=0)  # the verify depth
        assert len(s.accepted_per_pos) == s.depth
        assert s.accepted_per_pos == tuple(sum(c.accepted_per_pos[j] for c in classes if j < c.depth)
                                           for j in range(s.depth))
        for c in classes:
            assert len(c.accepted_per_pos) == c.depth and c.proposed <= c.rows * c.depth
            want = {"copy": ("ngram", 8), "code": ("mtp", 3), "chat": ("none", 0), "prose": ("ngram", 2)}
            technique, depth = want[c.tenant]  # less deep only where max_tokens leaves less room
            assert (c.technique, c.depth) == ("none", 0) or (c.technique, min(c.depth, 1)) == (technique, 1)
            assert c.depth <= depth
    step = mixed[0]
    assert step.technique in ("ngram", "mtp") and step.policy_version == 7
    # chat rows (r2) rode in verify calls without drafts: exactly one token each step
    verify_steps = [i for i, s in enumerate(stats) if s.depth]
    assert all(emitted[i].get("r2", 1) == 1 for i in verify_steps)
    assert engine.compiles_since_warmup() == 0
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total
    assert engine.proposers["draft"].held_pages() == 0


def test_a_row_whose_proposal_fails_is_dropped_alone(engine, plain, monkeypatch):
    mtp = engine.proposers["mtp"]
    real = mtp.propose

    def propose(seqs, depth):
        if any(s.request_id == "r1" for s in seqs):
            raise RuntimeError("bad hidden state")
        return real(seqs, depth)

    monkeypatch.setattr(mtp, "propose", propose)
    engine.set_policy(TunedPolicy((BatchRule(64, "ngram", 2),), crossover=64, version=8,
                                  tenants=(TenantRule("code", "mtp", 3), TenantRule("prose", "mtp", 2))))
    out, _, _ = _run(engine)
    assert out[1] == plain[1][: len(out[1])] and len(out[1]) < len(plain[1])  # r1 failed early
    assert [o for i, o in enumerate(out) if i != 1] == [o for i, o in enumerate(plain) if i != 1]
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total


def test_leak_with_tenant_rules_and_random_aborts(tiny, monkeypatch):
    e = make_engine(tiny, global_pages=60, local_pages=60, **SPEC_RC)
    e.set_policy(TunedPolicy((BatchRule(2, "ngram", 3), BatchRule(64)), crossover=6,
                             tenants=(TenantRule("copy", "ngram", 8), TenantRule("chat", max_batch=3))))
    add = e.add_request

    def with_tenant(req):
        req.tenant = _tenant(int(req.request_id[1:]))
        add(req)

    monkeypatch.setattr(e, "add_request", with_tenant)
    done = churn_with_aborts(e, 120, seed=11)
    assert len(done) == 120
    assert e.pool.used == 0 and e.pool.free == e.pool.total


def test_verify_emits_one_token_for_a_row_without_drafts():
    """cand -1 everywhere: greedy takes the argmax and accepts nothing; a sampled row draws from
    the target distribution (the bonus position's draw)."""
    logits = np.log(np.array([[0.1, 0.6, 0.3]] * 3, np.float32))
    s = SamplingArrays.host(3)
    tok, acc, _ = verify(logits, np.full(3, -1, np.int32), SamplingArrays(**s), np.zeros(3, np.int32))
    assert np.asarray(tok).tolist() == [1, 1, 1] and not np.asarray(acc).any()
    n = 20000
    s = SamplingArrays.host(n)
    s["temperature"][:] = 1.0
    s["key"][:] = np.random.SeedSequence(2).generate_state(2, np.uint32)
    p = np.array([0.1, 0.6, 0.3], np.float32)
    tok, acc, _ = verify(np.log(np.tile(p, (n, 1))), np.full(n, -1, np.int32), SamplingArrays(**s),
                         np.arange(n, dtype=np.int32))
    freq = np.bincount(np.asarray(tok), minlength=3) / n
    assert not np.asarray(acc).any() and np.abs(freq - p).max() < 0.02
