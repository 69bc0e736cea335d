"""The prefix-cache reset (the admin's POST /admin/reset_prefix_cache): cached pages nobody holds
go back to the free lists and the cache forgets their blocks, pages running sequences hold stay,
every page is accounted for once; on the engine it runs between steps, from the inbox."""

from __future__ import annotations

from engine.fake import FakeEngine
from engine.memory.kv import KVPool
from engine.memory.pages import PageAllocator, SeqPages
from engine.types import Request, SamplingParams
from tests.engine.conftest import run_requests
from tests.engine.test_prefix_cache import GREEDY, PROMPTS, _computed, _engine, freed_with_cache


def each_page_once(a: PageAllocator, held: set[int] = frozenset()) -> bool:
    """Every page but scratch is free, cached or held, exactly once."""
    return sorted(a._free + list(a._cached) + sorted(held)) == list(range(1, a.num_pages))


def test_allocator_evicts_every_cached_page_and_keeps_held_ones():
    a, p, evicted = freed_with_cache(5, cached=3)  # p[0] held; p[1..3] cached; p[4] free
    free_before = a.num_free
    assert (a.num_used, a.num_cached) == (1, 3)
    assert a.evict_cached() == 3
    assert evicted == p[1:4]  # the cache heard of each, least recently freed first
    assert (a.num_used, a.num_cached, a.num_free) == (1, 0, free_before)  # cached pages counted as free
    assert each_page_once(a, {p[0]}) and p[0] not in a._free
    assert a.evict_cached() == 0 and len(evicted) == 3
    a.free([p[0]])  # the held page is still kept: it is cached now, not freed
    assert a.num_cached == 1 and each_page_once(a)


def test_pool_drops_unheld_blocks_and_a_running_sequence_keeps_its_own():
    pool = KVPool(64, 64, 4, 3, prefix_window=8)  # ring of 3 pages of 4 tokens
    done = list(range(10, 50))  # 40 tokens, 10 blocks: computed and released
    _computed(pool, done)
    running = SeqPages([], [])
    mine = list(range(100, 112))  # 12 tokens, 3 blocks: computed, still running
    assert pool.lookup(running, mine, "t") == 0 and pool.grow(running, 13)
    pool.prepare(running, 0, 12)
    pool.cache_blocks(running, mine, 12)
    assert len(pool.prefix.entries) == 13 and pool.global_alloc.num_cached == 10
    used, free = pool.used, pool.free
    assert pool.drop_cached() == {"enabled": True, "dropped_blocks": 10, "freed_pages": 10 + 3}
    assert len(pool.prefix.entries) == 3 and pool.global_alloc.num_cached == pool.local_alloc.num_cached == 0
    assert (pool.used, pool.free) == (used, free)  # cached pages already counted as free
    assert pool.lookup(SeqPages([], []), done + [1], "t") == 0  # forgotten
    other = SeqPages([], [])
    assert pool.lookup(other, mine + [1], "t") == 12  # the running sequence's blocks still hit
    pool.release(other, mine + [1], 12)
    pool.release(running, mine, 12)
    assert pool.drop_cached()["dropped_blocks"] == 3 and not pool.prefix.entries
    assert pool.used == 0 and pool.free == pool.total
    assert each_page_once(pool.global_alloc) and each_page_once(pool.local_alloc)
    assert not pool.global_alloc._kept and not pool.local_alloc._kept


def test_cached_local_pages_of_held_blocks_go_and_their_entries_stay():
    """A running sequence that wrapped its ring left the local pages of its early blocks cached;
    the reset frees those, so a hit that needs them is shorter, and the blocks stay indexed."""
    pool = KVPool(64, 64, 4, 3, prefix_window=8)
    tokens = list(range(10, 50))
    a = SeqPages([], [])
    pool.lookup(a, tokens, "t")
    assert pool.grow(a, 41)
    for start in range(0, 40, 4):  # a block at a time: each wrap keeps the old block's local page
        pool.prepare(a, start, start + 4)
        pool.cache_blocks(a, tokens, start + 4)
    assert pool.local_alloc.num_cached == 6  # blocks 0..5 left a's ring (a still reads block 6's)
    b = SeqPages([], [])
    assert pool.lookup(b, tokens[:21] + [0] * 9, "t") == 20
    pool.release(b, tokens[:21] + [0] * 9, 20)
    assert pool.drop_cached() == {"enabled": True, "dropped_blocks": 0, "freed_pages": 6}
    assert len(pool.prefix.entries) == 10  # a holds every global page
    assert pool.lookup(SeqPages([], []), tokens[:21] + [0] * 9, "t") == 0  # blocks 2..4 lost theirs
    pool.release(a, tokens, 40)
    pool.drop_cached()
    assert pool.used == 0 and each_page_once(pool.global_alloc) and each_page_once(pool.local_alloc)


def test_a_pool_without_a_prefix_cache_drops_nothing():
    assert KVPool(8, 8, 4, 2).drop_cached() == {"enabled": False, "dropped_blocks": 0, "freed_pages": 0}


def test_the_engine_resets_between_steps_and_the_same_prompt_misses_after(tiny):
    engine = _engine(tiny, True)
    prompt = PROMPTS[0]  # 81 tokens: 20 full blocks
    first, _ = run_requests(engine, [prompt], GREEDY)
    again, stats = run_requests(engine, [prompt], GREEDY)
    assert sum(s.prefix_hit_tokens for s in stats) == 80 and again == first
    done = engine.reset_prefix_cache()
    assert not done.done() and engine.has_work()  # queued: it runs in the next step's inbox
    engine.step()
    got = done.result(0)
    assert got["enabled"] and got["dropped_blocks"] >= 20 and got["freed_pages"] >= 20
    assert engine.pool.global_alloc.num_cached == engine.pool.local_alloc.num_cached == 0
    cold, stats = run_requests(engine, [prompt], GREEDY)
    assert sum(s.prefix_hit_tokens for s in stats) == 0 and cold == first
    assert engine.status()["prefix_cache"]["hit_tokens"] == 80  # the counters are since the start
    assert engine.pool.used == 0 and each_page_once(engine.pool.global_alloc)


def test_a_reset_while_a_request_runs_keeps_its_blocks_and_its_tokens(tiny):
    engine = _engine(tiny, True)
    expected, _ = run_requests(_engine(tiny, False), [PROMPTS[0]], SamplingParams(max_tokens=12))
    engine.add_request(Request("a", PROMPTS[0], SamplingParams(max_tokens=12)))
    out: list[int] = []
    while engine.pool.used == 0 or not out:  # until a is decoding: its prompt blocks registered
        out += [t for ev in engine.step().events for t in ev.token_ids]
    done = engine.reset_prefix_cache()
    engine.add_request(Request("b", PROMPTS[0][:-1] + [7], GREEDY))  # after the reset: a's blocks hit
    hits = 0
    while engine.has_work():
        step = engine.step()
        hits += step.stats.prefix_hit_tokens if step.stats else 0
        out += [t for ev in step.events if ev.request_id == "a" for t in ev.token_ids]
    assert done.result(0)["dropped_blocks"] == 0  # nothing cached that a did not hold
    assert hits == 80 and [out] == expected
    assert engine.pool.used == 0


def test_a_cancelled_reset_is_skipped_and_a_fault_keeps_it_queued(tiny):
    engine = _engine(tiny, True)
    run_requests(engine, [PROMPTS[0]], GREEDY)
    cancelled = engine.reset_prefix_cache()
    assert cancelled.cancel()
    engine.step()  # no InvalidStateError from completing a cancelled future
    assert engine.pool.global_alloc.num_cached > 0  # and no reset
    kept = engine.reset_prefix_cache()
    engine.recover()  # after a fault: queued resets stay queued, as policies do
    assert engine.has_work() and not kept.done()
    engine.step()
    assert kept.result(0)["enabled"] is True


def test_the_fake_forgets_all_but_the_running_prompts():
    engine = FakeEngine()
    old, live = [2] + [40] * 40, [2] + [50] * 40  # 41 tokens: 2 blocks of 16 each
    run_requests(engine, [old], SamplingParams(max_tokens=2))
    engine.add_request(Request("live", live, SamplingParams(max_tokens=50)))
    engine.step()  # "live" runs
    done = engine.reset_prefix_cache()
    assert engine.has_work() and not done.done()
    engine.step()
    assert done.result(0) == {"enabled": True, "dropped_blocks": 2, "freed_pages": 0}
    assert engine.prefixes.admit(old, "default") == 0 and engine.prefixes.admit(live, "default") == 32
