"""Round trips of every table through a real database (SQLite and PostgreSQL), and the
engine/session helpers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from store.apikeys import generate_api_key, hash_api_key, verify_api_key
from store.db import default_url, make_engine, resolve_url, session_scope
from store.history import (
    finish_retune,
    mark_applied,
    mark_rolled_back,
    save_policy,
    start_retune,
)
from store.models import Policy, Request, Retune, Step, StepRollup, Tenant
from store.tenants import add_tenant, find_tenant_by_key, revoke_tenant


def _columns(obj: object) -> dict:
    return {c.key: getattr(obj, c.key) for c in obj.__table__.columns if c.key != "id"}


def test_every_model_round_trips(db_url: str) -> None:
    rows = [
        Step(instance="a", step_id=7, time=1.7e9 + 0.25, batch_size=4, prefill_tokens=3,
             decode_tokens=9, technique="ngram", depth=3, proposed=12, accepted=5,
             accepted_per_pos=[3, 1, 1], propose_ms=0.5, verify_ms=3.25, step_ms=4.5,
             kv_pages_used=10, kv_pages_free=90, queue_len=2, policy_version=4, preempted=1,
             sampled_rows=2, prefix_hit_tokens=32, prefix_query_tokens=40, tenants=["acme", "globex"],
             plain_rows=3, grammar_ms=1.25, constrained_rows=2, cut_tokens=4),
        Request(instance="a", request_id="r-1", tenant="acme", prompt_tokens=12, output_tokens=30,
                arrival_time=1.7e9, first_token_time=None, finish_time=1.7e9 + 2.5,
                finish_reason="abort", status="aborted", proposed_tokens=20, accepted_tokens=8,
                preemptions=1),
        StepRollup(minute_start=1_700_000_040, instance="", technique="mtp", depth=2, steps=3,
                   batch_size_sum=12, batch_size_max=5, prefill_tokens=0, decode_tokens=30,
                   proposed=24, accepted=11, accepted_per_pos=[7, 4], step_ms_sum=30.5,
                   step_ms_max=12.0, propose_ms_sum=1.5, verify_ms_sum=25.0, preempted=0,
                   batch_hist={"3": 1, "4": 1, "5": 1}),
        Tenant(name="acme", api_key_hash=hash_api_key("k"), max_concurrent=4, max_tokens=512,
               max_queued=0, requests_per_minute=None, tokens_per_minute=1000, created_at=1.0,
               revoked_at=None),
        Policy(instance="b", version=3, body={"crossover": 16, "rules": [{"technique": "ngram", "depth": 3}]},
               source="tuner", created_at=2.0, applied_at=3.0, rolled_back_at=4.0,
               rollback_reason="goodput fell 12%"),
        Retune(instance="b", triggered_by="admin", started_at=5.0, finished_at=6.5, status="applied",
               study_name="crossover", trial_number=11, predicted_goodput=140.0,
               measured_goodput=131.5, chosen_policy_version=3, error=None,
               details={"trials": 16}),
    ]  # fmt: skip
    expected = [(type(r), _columns(r)) for r in rows]
    assert len({model for model, _ in expected}) == 6  # one of each table
    engine = make_engine(db_url)
    with session_scope(engine) as session:
        session.add_all(rows)
    with session_scope(engine) as session:
        for model, want in expected:
            got = session.scalars(select(model)).one()
            assert got.id is not None
            assert _columns(got) == want
    engine.dispose()


def test_policy_and_retune_writers(db_url: str) -> None:
    engine = make_engine(db_url)
    with session_scope(engine) as session:
        save_policy(session, 1, {"technique": "none"}, "default", at=10.0)
        mark_applied(session, 1, at=11.0)
        save_policy(session, 2, {"technique": "ngram"}, "tuner", at=20.0)
        mark_rolled_back(session, 2, "measured 80 < 95 tokens/s", at=30.0)
        retune = start_retune(session, "schedule", study_name="s", at=19.0)
        finish_retune(session, retune.id, "rejected", predicted_goodput=120.0,
                      measured_goodput=80.0, chosen_policy_version=2, at=31.0)  # fmt: skip
    with session_scope(engine) as session:
        p2 = session.scalars(select(Policy).where(Policy.version == 2)).one()
        assert (p2.rolled_back_at, p2.rollback_reason) == (30.0, "measured 80 < 95 tokens/s")
        r = session.scalars(select(Retune)).one()
        assert (r.status, r.finished_at, r.measured_goodput) == ("rejected", 31.0, 80.0)
    with pytest.raises(ValueError, match="source"):
        with session_scope(engine) as session:
            save_policy(session, 3, {}, "cron")
    with pytest.raises(IntegrityError):  # versions are unique
        with session_scope(engine) as session:
            save_policy(session, 1, {}, "admin")
    engine.dispose()


def test_tenants_hash_keys_and_revoke(db_url: str, run_sql: Callable[..., list]) -> None:
    engine = make_engine(db_url)
    key_a, key_b = generate_api_key(), generate_api_key()
    with session_scope(engine) as session:
        add_tenant(session, "acme", key_a, max_concurrent=2)
        add_tenant(session, "globex", key_b)
    stored = [h for (h,) in run_sql("SELECT api_key_hash FROM xo_tenants")]
    assert len(stored) == 2
    assert all(key_a not in h and key_b not in h for h in stored)
    with session_scope(engine) as session:
        assert find_tenant_by_key(session, key_b).name == "globex"
        assert find_tenant_by_key(session, key_a + "x") is None
        revoke_tenant(session, "acme", at=5.0)
    with session_scope(engine) as session:
        assert find_tenant_by_key(session, key_a) is None
    engine.dispose()


def test_api_key_hash_is_salted_and_verifies() -> None:
    key = generate_api_key()
    h1, h2 = hash_api_key(key), hash_api_key(key)
    assert h1 != h2  # per-key salt
    assert verify_api_key(key, h1) and verify_api_key(key, h2)
    assert not verify_api_key(key[:-1], h1)
    assert not verify_api_key(key, "plain-text")
    assert not verify_api_key(key, "md5$00$" + h1.split("$")[2])


def test_sqlite_connections_use_wal_and_busy_timeout(tmp_path: Path) -> None:
    engine = make_engine(str(tmp_path / "x.db"), busy_timeout_ms=1234)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 1234
    engine.dispose()


def test_urls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CROSSOVER_DB", raising=False)
    assert default_url() == "sqlite:///crossover.db"
    monkeypatch.setenv("CROSSOVER_DB", str(tmp_path / "t.db"))
    assert default_url() == f"sqlite:///{tmp_path / 't.db'}"
    monkeypatch.setenv("CROSSOVER_DB", "postgresql://u@h/db")
    assert default_url() == "postgresql://u@h/db"
    assert resolve_url("sqlite:///:memory:") == "sqlite:///:memory:"


def test_session_scope_rolls_back_on_error(db_url: str) -> None:
    engine = make_engine(db_url)
    with pytest.raises(RuntimeError):
        with session_scope(engine) as session:
            add_tenant(session, "acme", "k")
            raise RuntimeError("boom")
    with session_scope(engine) as session:
        assert session.scalars(select(Tenant)).all() == []
    engine.dispose()


def test_a_server_connection_killed_under_the_pool_is_replaced(pg_url: str) -> None:
    """PostgreSQL only: a pooled connection the server dropped (a restart, an idle
    timeout) is noticed at checkout and replaced, not handed to the caller to fail."""
    engine = make_engine(pg_url, pool_size=1)
    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    killer = make_engine(pg_url)
    with killer.begin() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
    killer.dispose()
    with engine.connect() as conn:  # the pooled connection is dead: the ping replaces it
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    engine.dispose()
