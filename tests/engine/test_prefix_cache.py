"""Prefix caching: the key chain, reference counts and LRU eviction, hits on the tiny model
that keep greedy output identical, and every page back after aborts and preemption."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.execute.runner import RunnerConfig
from engine.memory.kv import KVPool
from engine.memory.pages import PageAllocator, SeqPages
from engine.memory.prefix_cache import SeenPrefixes, extend_keys, root_key
from engine.step.core import EngineConfig, EngineCore
from engine.types import Request, SamplingParams
from tests.engine.conftest import TINY_RC, ByteTokenizer, run_requests

TOK = ByteTokenizer()
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PREFIX = TOK.encode("You are a careful assistant of tenant one. Answer briefly: ")  # 60 tokens, 15 blocks


# -- host side: keys, reference counts, eviction ----------------------------------------

def test_keys_chain_over_blocks_and_tenants():
    a, b, c = [], [], []
    extend_keys(a, root_key("t"), [1, 2, 3, 4, 5, 6], 2, 3)
    extend_keys(b, root_key("t"), [1, 2, 9, 4, 5, 6], 2, 3)
    extend_keys(c, root_key("u"), [1, 2, 3, 4, 5, 6], 2, 3)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # one token changes every later key
    assert not set(a) & set(c)  # another tenant's chain never meets this one
    d = list(a[:1])
    extend_keys(d, root_key("t"), [1, 2, 3, 4, 5, 6], 2, 3)  # extending computes the rest only
    assert d == a


def freed_with_cache(pages: int, cached: int) -> tuple[PageAllocator, list[int], list[int]]:
    """An allocator of `pages` pages (plus scratch), all taken, then freed: the first kept and shared
    (still held once), the next `cached` kept (cached, least recently freed first), the rest free.
    Returns the allocator, the pages in order and the list its evictions are appended to."""
    evicted: list[int] = []
    a = PageAllocator(pages + 1)
    a.on_evict = evicted.append
    p = a.alloc(pages)
    for page in p[:cached + 1]:
        a.keep(page)
    a.share(p[0])
    a.free(p)
    return a, p, evicted


def test_allocator_counts_holders_and_evicts_least_recently_freed():
    a, p, evicted = freed_with_cache(4, cached=2)  # p[0] still held once; p[1], p[2] cached; p[3] free
    assert (a.num_used, a.num_cached, a.num_free) == (1, 2, 3)
    a.free([p[0]])  # now cached too, most recently
    assert a.alloc(1) == [p[3]] and not evicted  # truly free pages first
    assert a.alloc(2) == [p[1], p[2]] and evicted == [p[1], p[2]]  # then the least recently freed
    assert a.alloc(2) is None and a.num_free == 1  # nothing taken when too few
    a.share(p[0])  # a hit revives a cached page
    assert a.num_cached == 0 and a.num_used == 4


def test_reservation_counts_cached_pages_as_free():
    a = PageAllocator(5)
    pages = a.alloc(4)
    for page in pages:
        a.keep(page)
    a.free(pages)
    a.reserved = 3
    assert a.num_free == 1 and a.alloc(2) is None and len(a.alloc(1)) == 1


def _computed(pool: KVPool, tokens: list[int], tenant: str = "t") -> SeqPages:
    """A sequence admitted, all of `tokens` computed in one pass, then released."""
    pages = SeqPages([], [])
    hit = pool.lookup(pages, tokens, tenant)
    assert pool.grow(pages, len(tokens) + 1)
    pool.prepare(pages, hit, len(tokens))
    pool.release(pages, tokens, len(tokens))
    return pages


def test_pool_hit_shares_pages_and_keeps_the_last_ring():
    pool = KVPool(64, 64, 4, 3, prefix_window=8)  # ring of 3 pages: 12 tokens >= 8 + 4 - 1
    tokens = list(range(10, 50))  # 40 tokens, 10 blocks
    _computed(pool, tokens)
    assert pool.used == 0 and pool.global_alloc.num_cached == 10
    assert pool.local_alloc.num_cached == 3  # one pass: only the last ring's blocks stay local
    assert pool.lookup(SeqPages([], []), tokens[:30] + [1, 2, 3], "t") == 0  # blocks 4..6: no local page
    pages = SeqPages([], [])
    assert pool.lookup(pages, tokens + [1, 2], "t") == 40  # blocks 7..9 have theirs
    assert pages.shared == {0, 1, 2} and pool.used == 10 + 3 and pool.free == pool.total - 13
    assert pool.lookup(SeqPages([], []), tokens + [1], "other") == 0


def _block_by_block(pool: KVPool, tokens: list[int]) -> SeqPages:
    """A sequence admitted and computed a block (4 tokens) at a time, caching each block: still running."""
    seq = SeqPages([], [])
    pool.lookup(seq, tokens, "t")
    assert pool.grow(seq, len(tokens) + 1)
    for start in range(0, len(tokens), 4):  # each wrap keeps the old block's page
        pool.prepare(seq, start, start + 4)
        pool.cache_blocks(seq, tokens, start + 4)
    return seq


def test_pool_hit_length_needs_the_local_pages_before_it():
    pool = KVPool(64, 64, 4, 3, prefix_window=8)
    tokens = list(range(10, 50))
    seq = _block_by_block(pool, tokens)
    pool.release(seq, tokens, 40)
    assert pool.local_alloc.num_cached == 10 and pool.used == 0
    other = SeqPages([], [])
    assert pool.lookup(other, tokens[:21] + [0] * 9, "t") == 20  # capped at full blocks
    assert other.ring_block == [3, 4, 2] and other.shared == {0, 1, 2}  # ring as if computed
    assert pool.grow(other, 31) and len(other.spare) == 3  # each shared entry it wraps needs one
    pool.prepare(other, 20, 31)
    g, l_read, l_write = (np.zeros(8, np.int32) for _ in range(3))
    pool.fill_tables(other, g, l_read, l_write)
    assert list(l_read[:3]) != list(l_write[:3])  # that call reads the cached pages, writes fresh ones
    pool.release(other, tokens[:21] + [0] * 9, 20)
    assert pool.used == 0


def test_table_rows_are_the_page_ids_fill_tables_writes():
    """The ragged step's page-table rows (KVPool.table_rows) read and write what fill_tables's do,
    also right after a wrap gave shared ring entries fresh pages to write."""
    pool = KVPool(64, 64, 4, 3, prefix_window=8)
    tokens = list(range(10, 50))
    pool.release(_block_by_block(pool, tokens), tokens, 40)
    hit = SeqPages([], [])
    pool.lookup(hit, tokens[:21] + [0] * 9, "t")
    assert pool.grow(hit, 31)
    pool.prepare(hit, 20, 31)  # wraps onto shared entries: fresh pages written, cached ones read
    plain = SeqPages([], [])
    assert pool.grow(plain, 7)
    for pages in (hit, plain):
        for width in (8, 2):
            g, l_read, l_write = (np.zeros(width, np.int32) for _ in range(3))
            pool.fill_tables(pages, g, l_read, l_write)
            rows = pool.table_rows(pages, width, width)
            for filled, row in zip((g, l_read, l_write), rows, strict=True):
                assert list(filled) == list(row) + [0] * (width - len(row))
    _, read, write = pool.table_rows(hit, 8, 8)
    assert read != write


def test_a_hit_adopts_the_ring_pages_of_the_running_sequence_that_computed_them():
    pool = KVPool(64, 64, 4, 3, prefix_window=8)
    tokens = list(range(10, 50))
    a = _block_by_block(pool, tokens)
    pool.cache_blocks(a, tokens, 40)  # a still runs: blocks 7..9 are its own ring's pages
    used = pool.used
    b = SeqPages([], [])
    assert pool.lookup(b, tokens + [1], "t") == 40
    assert a.shared == {0, 1, 2} and len(a.spare) == 3  # a replaces them from spares when it wraps
    assert pool.used == used + 3 and b.ring == a.ring
    assert pool.grow(a, 44)  # its wrap onto block 7's page is met by a spare: nothing more
    assert pool.used == used + 3
    pool.prepare(a, 40, 44)  # a writes block 10 onto the adopted page of block 7: a spare instead
    assert a.reading == {1: b.ring[1]} and a.ring[1] not in b.ring and len(a.spare) == 2  # 7 % 3 == 1
    pool.release(b, tokens + [1], 40)
    pool.release(a, tokens + [0] * 4, 44)
    assert pool.used == 0 and pool.free == pool.total


def test_eviction_drops_entries_and_frees_their_local_pages():
    pool = KVPool(12, 12, 4, 3, prefix_window=8)  # 11 usable pages per pool
    _computed(pool, list(range(10, 42)))  # 8 blocks cached
    pages = SeqPages([], [])
    assert pool.lookup(pages, list(range(100, 141)), "t") == 0
    assert pool.grow(pages, 41)  # 11 global pages: every cached one is evicted
    assert pool.global_alloc.num_cached == 0 and not pool.prefix.entries
    assert pool.local_alloc.num_cached == 0  # their local pages went back to the free list
    pool.release(pages)
    assert pool.used == 0 and pool.free == pool.total


def test_short_ring_turns_the_cache_off():
    assert KVPool(8, 8, 4, 2, prefix_window=8).prefix is None  # 8 < 8 + 4 - 1
    assert KVPool(8, 8, 4, 3, prefix_window=8).prefix is not None


def test_seen_prefixes_counts_like_the_engine():
    seen = SeenPrefixes(4)
    assert seen.admit(list(range(9)), "a") == 0
    assert seen.admit(list(range(9)), "a") == 8
    assert seen.admit(list(range(9)), "b") == 0  # tenants apart
    assert seen.take() == {"prefix_hit_tokens": 8, "prefix_query_tokens": 27}
    assert seen.take()["prefix_query_tokens"] == 0 and seen.status()["hit_rate"] == round(8 / 27, 4)


# -- the tiny model -------------------------------------------------------------------

def _engine(tiny, prefix_cache: bool, **rc) -> EngineCore:
    cfg, params = tiny
    runner = RunnerConfig(**{**TINY_RC.__dict__, **rc})
    return EngineCore(cfg, params, ByteTokenizer(),
                      EngineConfig(runner=runner, token_budget=32, prefix_cache=prefix_cache))


PROMPTS = [PREFIX + TOK.encode(tail, add_bos=False)
           for tail in ("what is two plus two?", "name a colour.", "count to three", "hi")]


def _one_by_one(engine, prompts, sp=GREEDY):
    outs, stats = [], []
    for p in prompts:
        o, s = run_requests(engine, [p], sp)
        outs += o
        stats += s
    return outs, stats


LONG_CHUNKS = {"max_chunk": 24}
"""Chunks as long as the ring (24 tokens): a chunk's first queries still read the blocks its last
tokens wrap onto, so a replaced ring entry must be read from its old page (KVPool.fill_tables)."""


def test_hits_give_the_same_greedy_tokens(tiny):
    off, _ = _one_by_one(_engine(tiny, False, **LONG_CHUNKS), PROMPTS)
    on = _engine(tiny, True, **LONG_CHUNKS)
    got, stats = _one_by_one(on, PROMPTS)
    assert got == off
    hits = sum(s.prefix_hit_tokens for s in stats)
    assert hits >= 3 * 56  # every later request hits at least the prefix's full blocks
    assert sum(s.prefix_query_tokens for s in stats) == sum(map(len, PROMPTS))
    st = on.status()["prefix_cache"]
    assert st["hit_tokens"] == hits and 0 < st["hit_rate"] < 1
    assert on.pool.used == 0 and on.pool.free == on.pool.total  # cached pages count as free
    again, _ = _one_by_one(on, PROMPTS)  # whole prompts cached now, long outputs too
    assert again == off
    off_all, _ = run_requests(_engine(tiny, False, **LONG_CHUNKS), PROMPTS, GREEDY)
    both, _ = run_requests(on, PROMPTS, GREEDY)  # together: hits while others run
    assert both == off_all
    assert on.pool.used == 0
    assert _engine(tiny, False).status()["prefix_cache"] == {"enabled": False}


def test_hits_with_speculation_give_the_same_greedy_tokens(tiny):
    from engine.policy import BatchRule, TunedPolicy
    from tests.engine.conftest import SPEC_RC

    prompts = [PREFIX + TOK.encode(t, add_bos=False) for t in ("abcabcabcabcabc abc", "one two one two one")]
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    outs = []
    for on in (False, True):
        e = _engine(tiny, on, **SPEC_RC)
        e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 8),), crossover=64))  # verify crosses wraps
        outs.append(_one_by_one(e, prompts + prompts, sp)[0])
        assert e.pool.used == 0
    assert outs[0] == outs[1]


def test_a_request_sharing_a_running_prompt_hits_its_ring_pages(tiny):
    got = []
    retry = PROMPTS[0][:-1] + TOK.encode("!", add_bos=False)  # 80 of a's 81 tokens: 20 blocks
    for on in (False, True):
        engine = _engine(tiny, on, **LONG_CHUNKS)
        engine.add_request(Request("a", PROMPTS[0], GREEDY))
        out, hits = {"a": [], "b": []}, 0
        for i in range(200):
            if i == 5:  # a decodes: its ring holds blocks 15..20, b needs 14..19 (adopted)
                engine.add_request(Request("b", retry, GREEDY))
            if not engine.has_work():
                break
            o = engine.step()
            hits += o.stats.prefix_hit_tokens if o.stats else 0
            for ev in o.events:
                out[ev.request_id] += ev.token_ids
        got.append(out)
        assert hits == (80 if on else 0) and engine.pool.used == 0
    assert got[0] == got[1]


def test_a_small_pool_evicts_and_preempts_yet_greedy_tokens_stay(tiny):
    small = dict(global_pages=48, local_pages=48, **LONG_CHUNKS)  # about two prompts at once
    prompts = PROMPTS + [TOK.encode("another tenant's long system prompt. Hi") + p[-6:] for p in PROMPTS]
    off, _ = run_requests(_engine(tiny, False, **small), prompts, GREEDY)
    on = _engine(tiny, True, **small)
    got, stats = run_requests(on, prompts, GREEDY)
    assert got == off
    assert sum(s.preempted for s in stats) > 0 and sum(s.prefix_hit_tokens for s in stats) > 0
    assert on.pool.used == 0


def test_every_page_returns_after_aborts_and_preemption(tiny):
    rng = random.Random(3)
    engine = _engine(tiny, True, global_pages=48, local_pages=48)  # small: preemption and eviction
    tails = ["ab", "cd ef", "x", "the cat sat", "one two three four"]
    ids = []
    for i in range(60):
        prefix = PREFIX if rng.random() < 0.7 else TOK.encode("other tenant text, long enough to wrap")
        ids.append(prefix + TOK.encode(rng.choice(tails) * rng.randint(1, 3), add_bos=False))
        sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 1.0]), seed=i)
        engine.add_request(Request(f"r{i}", ids[-1], sp, tenant=rng.choice(["a", "b"])))
    preempted = hits = 0
    while engine.has_work():
        if rng.random() < 0.05 and engine._seqs:
            engine.abort(rng.choice(sorted(engine._seqs)))
        out = engine.step()
        if out.stats:
            preempted += out.stats.preempted
            hits += out.stats.prefix_hit_tokens
    assert preempted > 0 and hits > 0
    pool = engine.pool
    assert pool.used == 0 and pool.free == pool.total
    for a in (pool.global_alloc, pool.local_alloc):
        assert sorted(a._free + list(a._cached)) == list(range(1, a.num_pages))  # each page once
        assert set(a._cached) == a._kept  # cached pages are exactly the indexed ones


@pytest.mark.slow
def test_real_model_shared_prefix_same_output_with_cache_on_and_off():
    from engine.loader import load_engine

    outs = []
    for on in (False, True):
        engine = load_engine(max_batch=4, max_context=2048, progress=False, speculation=False,
                             prefix_cache=on)
        tok = engine.tokenizer
        system = "You are the bakery's assistant. " + " ".join(f"Rule {i}: be kind and exact."
                                                               for i in range(100))
        n_system = len(tok.encode(system))  # about 1,000 tokens: the ring (528) wraps twice over it
        prompts = [tok.encode(system + q) for q in (" What bread is best?", " When do you open?")]
        got, stats = _one_by_one(engine, prompts + prompts, SamplingParams(max_tokens=24, temperature=0.0))
        outs.append(got)
        hits = sum(s.prefix_hit_tokens for s in stats)
        assert hits >= 3 * (n_system - 32) if on else hits == 0  # the later three hit the system prompt
        assert engine.pool.used == 0
    assert outs[0] == outs[1]
