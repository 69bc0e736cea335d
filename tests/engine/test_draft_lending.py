"""The pool split lends the draft model real pages of the tenants' pools, and every one comes back.

Tiny engine: 199 usable pages per pool of 4 tokens; the draft is the first 3 of 7 layers
(one of them global), so its sequences hold global and local pages of the engine's own
arrays, taken from the reservation the split withholds from tenants.
"""

from __future__ import annotations

import pytest

from engine.memory.budget import heads_resident_bytes, memory_status
from engine.memory.kv import KVPool
from engine.memory.pages import SeqPages
from engine.policy import BatchRule, TunedPolicy
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.types import Request, SamplingParams
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.engine.conftest import SPEC_RC, ByteTokenizer, make_engine, run_prompts

TOK = ByteTokenizer()
SP = SamplingParams(max_tokens=24, ignore_eos=True)


def _policy(split: float, depth: int = 3, version: int = 1) -> TunedPolicy:
    return TunedPolicy(rules=(BatchRule(64, "draft", depth),), crossover=64, pool_split=split,
                       version=version)


def _engine(tiny, **kw):
    e = make_engine(tiny, **{**SPEC_RC, **kw})
    add_model_proposers(e, DraftHeads.random(tiny[0], 2, (3, 6), 128, seed=1, scale=0.3), ("draft",),
                        vocab_sizes=(0, 128))
    return e


def _lent(e) -> tuple[int, int]:
    return len(e.pool.global_alloc.lent), len(e.pool.local_alloc.lent)


def _submit(e, prompts=PROMPTS):
    for i, p in enumerate(prompts):
        e.add_request(Request(f"r{i}", TOK.encode(p), SP))


def _step(e, out: dict[str, list[int]]) -> None:
    for ev in e.step().events:
        out.setdefault(ev.request_id, []).extend(ev.token_ids)


def _step_until(e, cond, out=None, limit=200):
    for _ in range(limit):
        _step(e, {} if out is None else out)
        if cond():
            return
    raise AssertionError("condition never held")


def _finish(e, out=None) -> dict[str, list[int]]:
    out = {} if out is None else out
    while e.has_work():
        _step(e, out)
    return out


@pytest.fixture(scope="module")
def plain(tiny):
    return run_prompts(make_engine(tiny, **SPEC_RC), PROMPTS, SP, TOK)[0]


def test_a_quarter_split_takes_a_quarter_of_tenant_pages_and_the_draft_uses_them(tiny, plain):
    e = _engine(tiny)
    before = memory_status(e)
    e.set_policy(_policy(0.25))
    _submit(e)
    most, seen = 0, []
    while e.has_work():
        e.step()
        m = memory_status(e)
        g, l = _lent(e)
        assert g <= e.pool.global_alloc.reserved and l <= e.pool.local_alloc.reserved
        assert not (e.pool.global_alloc.lent & e.pool.global_alloc._kept)  # never in the prefix cache
        assert not (e.pool.local_alloc.lent & e.pool.local_alloc._kept)
        most = max(most, m["draft_pages_used"])
        seen.append(m)
    assert before["tenant_pages"] == 2 * 199 and before["lent_pages"] == 0
    m = seen[-1]
    assert m["lent_pages"] == 2 * (199 * 25 // 100) and m["tenant_pages"] == 2 * 199 - m["lent_pages"]
    assert 0.24 <= 1 - m["tenant_pages"] / before["tenant_pages"] <= 0.25
    assert m["tenant_bytes"] + m["lent_bytes"] == before["tenant_bytes"]
    assert most > 0 and g == l == 0  # the draft held lent pages, and gave them all back
    assert m["max_context_tenants"] < m["max_context_tenants_unsplit"] == before["max_context_tenants"]


def test_split_zero_lends_nothing_and_the_draft_cannot_draft(tiny):
    e = _engine(tiny)
    e.set_policy(_policy(0.0))
    _submit(e, PROMPTS[:2])
    _step_until(e, lambda: all(s.num_output >= 2 for s in e._seqs.values()))
    seqs = list(e._seqs.values())
    assert e.proposers["draft"].propose(seqs, 3) == [[], []]
    assert _lent(e) == (0, 0) and e.pool.reserved == 0


def test_greedy_output_is_plain_decoding_while_the_split_shrinks_under_a_live_draft(tiny, plain):
    e = _engine(tiny)
    d = e.proposers["draft"]
    e.set_policy(_policy(0.25, depth=4))
    _submit(e)
    out: dict[str, list[int]] = {}
    _step_until(e, lambda: d.held_pages() > 20, out)
    e.set_policy(_policy(0.02, depth=4, version=2))  # 3 pages per pool: fewer than the draft holds
    _step(e, out)
    g, l = _lent(e)
    assert g <= e.pool.global_alloc.reserved == 3 and l <= e.pool.local_alloc.reserved == 3
    _finish(e, out)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == plain
    assert _lent(e) == (0, 0) and d.held_pages() == 0


@pytest.mark.parametrize("how", ["preempt", "abort", "recover"])
def test_lent_pages_return_at_once(tiny, how):
    e = _engine(tiny)
    d = e.proposers["draft"]
    e.set_policy(_policy(0.25))
    _submit(e, PROMPTS[:3])
    _step_until(e, lambda: d.held_pages() > 0)
    if how == "preempt":
        e.scheduler.preempt_all()
    elif how == "abort":
        for rid in list(e._seqs):
            e.abort(rid)
        e.step()
    else:
        e.recover()
    assert _lent(e) == (0, 0) and d.held_pages() == 0 and not d._state
    _finish(e)
    assert _lent(e) == (0, 0) and e.pool.used == 0 and e.pool.free == e.pool.total


def test_the_resident_bytes_planned_before_loading_are_those_loaded(tiny):
    heads = DraftHeads.random(tiny[0], 2, (3, 6), 128, seed=1)
    e = make_engine(tiny, **SPEC_RC)
    add_model_proposers(e, heads, vocab_sizes=(0, 64, 128))
    planned = heads_resident_bytes(heads, tiny[0], ("mtp", "early_exit", "draft"), (0, 64, 128),
                                   tiny[1]["embed"])
    assert planned == sum(p.resident_bytes() for p in e.proposers.values()) > 0
    m = memory_status(e)
    assert m["resident_bytes"] == planned and m["budget_bytes"] == m["kv_pool_bytes"] + planned


def test_the_pool_tells_the_borrower_and_lending_stays_in_the_reservation():
    """No JAX: a split shrinking below what is lent, a tenant release and a reset reach the hook;
    lent pages leave the tenants' count untouched and never go to the prefix cache's LRU."""
    pool = KVPool(41, 41, 4, 8)
    heard = []
    pool.on_lend = lambda event, pages=None: heard.append(event)
    pool.set_split(0.25)  # 10 pages per pool
    a = pool.global_alloc
    assert a.capacity == 30 and a.num_free == 30
    got = a.alloc(8, lend=True)
    assert len(got) == 8 and a.num_free == 30 and a.num_used == 0  # tenants lose nothing more
    assert a.alloc(3, lend=True) is None and len(a.alloc(2, lend=True)) == 2  # 10 is the quota
    a.free(got[:4])
    assert len(a.lent) == 6 and a.num_cached == 0 and a.num_free == 30
    pool.set_split(0.1)  # 4 pages now: 6 lent is over, the borrower must shed
    assert heard[-1] == "split" and a.num_free == 40 - 6
    pool.release(SeqPages([], []))
    pool.reset()
    assert heard[-2:] == ["release", "reset"] and not a.lent


def test_a_draft_of_another_shape_keeps_its_own_arrays_and_stays_lossless(tiny, plain):
    """Not the target's leading layers (one KV head, not two): separate arrays sized for the
    largest split, counted in its resident bytes; greedy output still equals plain decoding."""
    import jax

    from engine.speculation.draft_model import DraftModelProposer
    from tests.engine.tiny import init_random_params, tiny_config

    dcfg = tiny_config(n_layers=2, n_kv_heads=1, n_heads=2)
    d = DraftModelProposer(dcfg, init_random_params(dcfg, jax.random.PRNGKey(5)),
                           DraftHeads.random(tiny[0], 1, (3,), 128, seed=1).vocab, draft_vocab=128)
    e = make_engine(tiny, **SPEC_RC)
    e.add_proposer(d)
    assert not d.lends and d.pool is not e.pool and d.resident_bytes() >= d.runner.kv.nbytes() > 0
    e.set_policy(_policy(0.25))
    out, stats = run_prompts(e, PROMPTS, SP, TOK)
    assert out == plain and sum(s.proposed for s in stats) > 0
    assert d.held_pages() == 0 and _lent(e) == (0, 0)
