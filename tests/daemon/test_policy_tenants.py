"""The admin policy endpoint takes per-tenant rules: a good pin serves them, a bad one is a 400
naming the rule's field, and serving goes on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import TenantRule
from tests.daemon.helpers import MODEL, LiveServer, http_request, wait_for
from tuner.config import TunerConfig

TOKEN = "tenant-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
RULES = [{"max_batch": 4, "technique": "ngram", "depth": 2}, {"max_batch": 64}]


@pytest.fixture
def server(db_url: str) -> Iterator[LiveServer]:
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram")}, cost=FakeCost(), max_batch=8, max_depth=4)
    s = LiveServer(engine, db_url=db_url, admin_token=TOKEN,
                   tuner=TunerConfig(search_process=False, trials=8)).start()
    yield s
    s.close()


def test_a_pin_with_tenant_rules_is_served(server: LiveServer) -> None:
    body = {"rules": RULES, "crossover": 4, "tenants": [{"tenant": "copy", "technique": "ngram", "depth": 4},
                                                        {"tenant": "chat", "max_batch": 2}]}
    r = http_request(server.port, "PUT", "/admin/policy/pin", body, ADMIN)
    assert r.status == 200, r.json()
    assert r.json()["policy"]["tenants"][0] == {"tenant": "copy", "technique": "ngram", "depth": 4,
                                                "max_batch": 1 << 30}
    assert server.post("/v1/completions",
                       {"model": MODEL, "prompt": "abc"}).status == 200  # a step applies it
    wait_for(lambda: server.engine.policy.tenants != ())
    assert server.engine.policy.tenants == (TenantRule("copy", "ngram", 4), TenantRule("chat", max_batch=2))
    assert server.get("/admin/policy", ADMIN).json()["policy"]["tenants"][1]["tenant"] == "chat"


@pytest.mark.parametrize(("tenant", "param"), [
    ({"technique": "ngram", "depth": 2.5}, "tenants[0].depth"),
    ({"technique": "none", "depth": 2}, "tenants[0].depth"),
    ({"technique": "ngram", "depth": 6}, "tenants[0].depth"),  # deeper than the engine verifies
    ({"technique": "mtp", "depth": 2}, "tenants[0].technique"),  # no such proposer loaded
    ({"technique": "ngram", "depth": 1, "tenant": ""}, "tenants[0].tenant"),
])
def test_a_bad_tenant_rule_is_refused_naming_it(server: LiveServer, tenant: dict, param: str) -> None:
    body = {"rules": RULES, "crossover": 4, "tenants": [{"tenant": "copy", **tenant}]}
    r = http_request(server.port, "PUT", "/admin/policy/pin", body, ADMIN)
    error = r.json()["error"]
    assert r.status == 400 and error["code"] == "invalid_policy" and error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "abc"}).status == 200
    assert server.engine.policy.tenants == () and server.get("/admin/policy", ADMIN).json()["pinned"] is False


def test_metrics_count_drafts_per_row_class_in_a_step_of_several_depths() -> None:
    from prometheus_client import generate_latest

    from daemon.metrics.sink import EngineMetrics
    from engine.types import RowClass, StepStats

    metrics = EngineMetrics()
    classes = (RowClass("copy", "ngram", 8, 1, 8, 5, (1,) * 5 + (0,) * 3),
               RowClass("code", "mtp", 2, 3, 6, 2, (2, 0)),
               RowClass("chat", "none", 0, 2))
    metrics.on_step(StepStats(batch_size=6, decode_tokens=13, technique="mtp", depth=8, proposed=14,
                              accepted=7,
                              accepted_per_pos=(3, 1, 1, 1, 1, 0, 0, 0), step_ms=10.0, row_classes=classes))
    text = generate_latest(metrics.registry).decode()
    assert "crossover_spec_decode_num_drafts_total 4.0" in text  # 1 copy row + 3 code rows, not 14 // 8
