"""The real Gemma 3 270M behind /ready with a 2 GiB budget: a 0.25 pool split takes a quarter of
the tenants' pages and the draft model keeps its KV in them; at split 0 it cannot draft."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from engine.memory.budget import page_bytes
from engine.policy import BatchRule, TunedPolicy
from tests.daemon.helpers import LiveServer, wait_for

pytestmark = pytest.mark.slow
BUDGET = 2 << 30
PROMPT = {"model": "gemma3-270m", "prompt": "The history of the printing press begins", "max_tokens": 48,
          "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    from engine.loader import load_engine

    engine = load_engine(kv_budget_bytes=BUDGET, max_batch=1, max_context=128, progress=False,  # few shapes
                         model_proposers=("draft",), spec_max_batch=1, verify_tokens=(5,), prefix_cache=False)
    engine.warmup(progress=False)
    srv = LiveServer(engine).start()
    yield srv
    srv.close()


def _memory(server: LiveServer) -> dict:
    return server.get("/ready").json()["engine"]["memory"]


def _watch(server: LiveServer, policy: TunedPolicy) -> tuple[list[dict], dict]:
    """Serve PROMPT under `policy`, reading /ready's memory while it runs: (readings, the response)."""
    server.engine.set_policy(policy)
    wait_for(lambda: server.engine.policy.version == policy.version, 30, "the policy applied")
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(server.post("/v1/completions", PROMPT).json()))
    t.start()
    seen = []
    while t.is_alive():
        seen.append(_memory(server))
        time.sleep(0.05)
    t.join()
    wait_for(lambda: not server.engine.has_work() and server.engine.pool.used == 0, 30, "idle")
    return seen, out


def test_a_quarter_split_of_2gib_lends_a_quarter_of_tenant_pages_to_the_draft(server):
    before = _memory(server)
    assert before["budget_bytes"] == BUDGET and before["lent_pages"] == 0
    scratch = sum(page_bytes(server.engine.runner.kv))  # page 0 of each pool, on top of the planned pool
    assert BUDGET - scratch <= before["kv_pool_bytes"] + before["resident_bytes"] <= BUDGET + scratch
    assert before["resident_bytes"] > 0  # the draft's adapter and vocabulary slice, out of the budget
    seen, out = _watch(server, TunedPolicy(rules=(BatchRule(64, "draft", 4),), crossover=64, pool_split=0.25,
                                           version=1))
    assert out["usage"]["completion_tokens"] == 48
    used = max(m["draft_pages_used"] for m in seen)
    m = seen[-1]
    assert 0.24 <= 1 - m["tenant_pages"] / before["tenant_pages"] <= 0.25
    assert m["tenant_bytes"] + m["lent_bytes"] == before["tenant_bytes"]
    assert 0 < used <= m["lent_pages"]
    assert m["max_context_tenants"] < before["max_context_tenants"]
    assert _memory(server)["draft_pages_used"] == 0  # all returned once the request finished
    steps = [s for s in server.sink.steps if s.technique == "draft"]
    assert sum(s.proposed for s in steps) > 0


def test_at_split_zero_the_draft_model_cannot_draft(server):
    n = len(server.sink.steps)
    seen, out = _watch(server, TunedPolicy(rules=(BatchRule(64, "draft", 4),), crossover=64, pool_split=0.0,
                                           version=2))
    assert out["usage"]["completion_tokens"] == 48
    assert all(m["lent_pages"] == 0 and m["draft_pages_used"] == 0 for m in seen)
    assert sum(s.proposed for s in server.sink.steps[n:]) == 0
