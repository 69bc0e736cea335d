"""The queue cannot stall: a pool split that leaves the head request too few pages yields to it.

Pool: 40 usable global pages of 4 tokens (160 tokens); a split of 0.5 leaves tenants 20 pages
(80 tokens). The big request needs 30 pages (120 tokens) to finish alone.
"""

from __future__ import annotations

from engine.policy import TunedPolicy
from engine.types import Request, SamplingParams
from tests.engine.conftest import ByteTokenizer, make_engine

TOK = ByteTokenizer()
POOL = dict(global_pages=41, local_pages=41)
BIG = Request("big", TOK.encode("b" * 59), SamplingParams(max_tokens=60, ignore_eos=True))


def _small(i: int) -> Request:
    return Request(f"s{i}", TOK.encode(f"small {i}"), SamplingParams(max_tokens=20, ignore_eos=True))


def _step_until_idle(engine, limit: int = 1000):
    """Step until idle (at most `limit` steps): finish reasons by id, most global pages tenants
    could use at once."""
    reasons, most = {}, 0
    for _ in range(limit):
        if not engine.has_work():
            return reasons, most
        out = engine.step()
        most = max(most, engine.pool.global_alloc.capacity)
        reasons.update({e.request_id: e.finish_reason for e in out.events if e.finished})
    raise AssertionError(f"still busy after {limit} steps; finished: {sorted(reasons)}")


def test_a_larger_split_yields_to_the_request_waiting_at_the_head(tiny):
    engine = make_engine(tiny, **POOL)
    for i in range(2):
        engine.add_request(_small(i))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.running
    engine.add_request(BIG)  # it waits behind the running ones...
    engine.set_policy(TunedPolicy(pool_split=0.5, version=1))  # ...when the split grows
    for i in range(2, 5):
        engine.add_request(_small(i))  # queued behind the big one
    reasons, most = _step_until_idle(engine)
    assert reasons == {"big": "length", **{f"s{i}": "length" for i in range(5)}}
    assert most >= 30  # the split gave pages back while the big request needed them
    assert engine.pool.yielded == 0 and engine.pool.global_alloc.capacity == 20  # and took them again
    assert engine.pool.used == 0 and engine.policy.pool_split == 0.5


def test_a_request_that_fits_only_without_the_split_is_accepted_and_served(tiny):
    engine = make_engine(tiny, **POOL)
    engine.set_policy(TunedPolicy(pool_split=0.5, version=1))
    engine.step()
    assert engine.pool.global_alloc.capacity == 20
    engine.add_request(BIG)  # 30 pages: more than the split leaves, less than the pool
    engine.add_request(_small(0))
    reasons, most = _step_until_idle(engine)
    assert reasons == {"big": "length", "s0": "length"} and most >= 30
    assert engine.pool.used == 0 and engine.pool.yielded == 0
