"""Per-tenant speculation on the real Gemma 3 270M: one batch of four tenants, each drafting with
its own (technique, depth) or not at all, gives plain decoding's greedy tokens, compiles
nothing after warmup and returns every page; rows that draft nothing decode one token each
beside the drafting rows' verify in the same ragged call (engine/step/ragged_step.py) with the same
tokens."""

from __future__ import annotations

import pytest

from engine.policy import NEVER, BatchRule, TenantRule, TunedPolicy
from engine.types import SamplingParams
from tests.engine.conftest import run_requests

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
POLICY = TunedPolicy((BatchRule(4, "early_exit", 2), BatchRule(64)), crossover=4, pool_split=0.25, version=5,
                     tenants=(TenantRule("copy", "ngram", 6), TenantRule("code", "mtp", 3),
                              TenantRule("chat", "draft", 4)))
"""copy: n-gram at 6, code: MTP at 3, chat: the draft model at 4; prose: the batch rule (early exit at 2)."""


@pytest.fixture(scope="module")
def engine():
    from engine.loader import load_engine

    e = load_engine(dtype="float32", max_batch=4, max_context=128, progress=False, speculation=True,
                    spec_max_batch=4)
    e.warmup(progress=False)
    return e


@pytest.fixture(scope="module")
def requests(engine):
    from bench.workloads import KINDS, prompts, to_request

    out = []
    for n, kind in zip((96, 64, 40, 16), KINDS):  # mixed lengths, one prompt per kind and tenant
        ids = to_request(prompts(kind, 1, seed=3)[0], engine.tokenizer, kind).prompt_ids
        out.append((kind, [ids[0]] + ids[-n:]))
    return out


def _run(engine, requests, policy):
    engine.set_policy(policy)
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return run_requests(engine, [ids for _, ids in requests], sp, tenants=[tenant for tenant, _ in requests])


def test_tenants_drafting_differently_in_one_batch_equal_plain_on_the_real_model(engine, requests):
    assert {"ngram", "mtp", "early_exit", "draft"} <= set(engine.proposers)
    plain, _ = _run(engine, requests, NEVER)
    out, stats = _run(engine, requests, POLICY)
    assert out == plain
    classes = {(c.tenant, c.technique, c.depth) for s in stats for c in s.row_classes if c.proposed}
    assert {t for t, _, _ in classes} >= {"copy", "code", "prose"}, classes
    assert classes <= {("copy", "ngram", 6), ("code", "mtp", 3), ("chat", "draft", 4),
                       ("prose", "early_exit", 2)}
    assert any(len({c.technique for c in s.row_classes if c.proposed}) >= 2 for s in stats)
    assert sum(s.accepted for s in stats) > 0
    assert engine.compiles_since_warmup() == 0
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total
    assert engine.proposers["draft"].held_pages() == 0


def test_rows_without_drafts_decode_beside_the_verify_rows_on_the_real_model(engine, requests):
    """copy and code draft, chat and prose do not: two plain rows beside two drafting ones."""
    plain, _ = _run(engine, requests, NEVER)
    policy = TunedPolicy((BatchRule(64),), crossover=64, version=6,
                         tenants=(TenantRule("copy", "ngram", 4), TenantRule("code", "mtp", 3)))
    out, stats = _run(engine, requests, policy)
    assert out == plain
    mixed = [s for s in stats if s.plain_rows]
    assert mixed and all(s.plain_rows <= 2 for s in mixed), [s.plain_rows for s in stats]
    assert sum(s.accepted for s in mixed) > 0
    assert engine.compiles_since_warmup() == 0
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total
