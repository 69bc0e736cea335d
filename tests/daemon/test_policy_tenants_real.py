"""A tenant rule pinned over HTTP on the real Gemma 3 270M: in one batch the pinned tenant's row
drafts with n-gram while the other tenant's row decodes plainly (the telemetry's row classes say
so), both outputs equal plain decoding's, and every page returns."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from tests.daemon.helpers import LiveServer, http_request, wait_for

pytestmark = pytest.mark.slow
TOKEN = "tenant-real-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PLAIN = {"rules": [{"max_batch": 64}], "crossover": 0}
PINNED = {"rules": [{"max_batch": 64}], "crossover": 2,
          "tenants": [{"tenant": "copy", "technique": "ngram", "depth": 4}]}
# A prompt that repeats itself, so the n-gram proposer finds drafts in it.
PROMPT = "one two three four five six seven eight. " * 6 + "one two three"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    from engine.loader import load_engine

    engine = load_engine(max_batch=2, max_context=256, kv_budget_bytes=64 << 20, progress=False,  # few shapes
                         model_proposers=(), spec_max_batch=2, verify_tokens=(5,), prefix_cache=False)
    engine.warmup(progress=False)
    db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'telemetry.db'}"
    srv = LiveServer(engine, db_url=db, open_mode=False, admin_token=TOKEN).start()
    yield srv
    srv.close()


def _pin(server: LiveServer, body: dict) -> None:
    r = http_request(server.port, "PUT", "/admin/policy/pin", body, ADMIN)
    assert r.status == 200, r.json()
    version = r.json()["policy"]["version"]
    wait_for(lambda: server.engine.policy.version == version, 30, "the pinned policy applied")


def _both(server: LiveServer, keys: dict[str, str]) -> dict[str, str]:
    """Each tenant's greedy completion of PROMPT, sent at once so that they share steps."""
    out: dict[str, str] = {}

    def send(name: str) -> None:
        r = server.post("/v1/completions", {"model": "gemma3-270m", "prompt": PROMPT, "max_tokens": 24,
                                            "temperature": 0}, {"Authorization": f"Bearer {keys[name]}"})
        assert r.status == 200, r.json()
        out[name] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=send, args=(name,)) for name in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_pinned_tenant_rule_drafts_for_its_tenant_only_and_stays_lossless(server: LiveServer) -> None:
    keys = {}
    for name in ("copy", "prose"):
        r = server.post("/admin/tenants", {"name": name}, ADMIN)
        assert r.status == 201, r.json()
        keys[name] = r.json()["api_key"]
    _pin(server, PLAIN)
    plain = _both(server, keys)
    server.database.recorder.flush()
    with server.database.engine.connect() as conn:
        first = conn.execute(text("SELECT MAX(id) FROM xo_steps")).scalar()
    _pin(server, PINNED)
    pinned = _both(server, keys)
    assert pinned == plain and plain["copy"] == plain["prose"]  # the same prompt, greedy: lossless
    server.database.recorder.flush()
    with server.database.engine.connect() as conn:
        rows = conn.execute(text("SELECT batch_size, row_classes FROM xo_steps WHERE id > :i"),
                            {"i": first}).all()
    classes = [(batch, c) for batch, raw in rows
               for c in (json.loads(raw) if isinstance(raw, str) else raw or [])]
    drafted = [c for _, c in classes if c["technique"] != "none"]
    assert drafted and {c["tenant"] for c in drafted} == {"copy"}
    assert {c["technique"] for c in drafted} == {"ngram"} and max(c["depth"] for c in drafted) == 4
    assert all(c["depth"] <= 4 for c in drafted)  # less deep only where max_tokens leaves less room
    assert sum(c["accepted"] for c in drafted) > 0  # the repeated prompt's drafts are accepted
    # steps where both rows decoded together: copy drafted beside a plain prose row
    together = [c for batch, c in classes if batch == 2]
    assert {(c["tenant"], c["technique"]) for c in together} >= {("copy", "ngram"), ("prose", "none")}
    wait_for(lambda: not server.engine.has_work() and server.engine.pool.used == 0, 30, "every page back")


def test_an_exploration_with_catch_up_techniques_is_checked_and_served(server: LiveServer) -> None:
    """`explore.catch_up` over HTTP on the real engine: a technique not among the explored ones
    is a 400 naming the field; a valid one that may be tried only up to the crossover (0 here)
    never drafts, and the output is plain decoding's."""
    bad = {**PLAIN, "explore": {"share": 1.0, "techniques": ["ngram"], "depths": [1],
                                "catch_up": ["mtp"]}}
    r = http_request(server.port, "PUT", "/admin/policy/pin", bad, ADMIN)
    assert r.status == 400 and "catch_up" in json.dumps(r.json()), r.json()
    r = server.post("/admin/tenants", {"name": "explorer"}, ADMIN)
    assert r.status == 201, r.json()
    key = {"Authorization": f"Bearer {r.json()['api_key']}"}
    _pin(server, PLAIN)
    body = {"model": "gemma3-270m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = server.post("/v1/completions", body, key).json()["choices"][0]["text"]
    server.database.recorder.flush()
    with server.database.engine.connect() as conn:
        first = conn.execute(text("SELECT MAX(id) FROM xo_steps")).scalar()
    _pin(server, {**bad, "explore": {**bad["explore"], "catch_up": ["ngram"]}})
    r = server.post("/v1/completions", body, key)
    assert r.status == 200 and r.json()["choices"][0]["text"] == plain, r.json()
    server.database.recorder.flush()
    with server.database.engine.connect() as conn:
        techniques = conn.execute(text("SELECT DISTINCT technique FROM xo_steps WHERE id > :i"),
                                  {"i": first}).scalars().all()
    assert techniques == ["none"]
    wait_for(lambda: not server.engine.has_work() and server.engine.pool.used == 0, 30, "every page back")
