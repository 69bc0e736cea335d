"""`crossover report --pool-instance/--tenant-instance` on a fixture database with designed pool runs.

Instance "pool" holds two runs of one queue: plain decoding (policy version 1, split 0, 1000
tenant pages, 10 tokens per 100 ms step) and the draft model (version 2, split 0.25, 750 tenant
pages, 12 tokens per 100 ms step). Instance "tenants" holds ngram steps of tenant acme alone;
instance "sweep" holds ngram steps with acme and globex mixed.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from bench.report.build import ReportRequest, build_report
from bench.report.data import open_database, read_telemetry
from bench.report.pool import pool_rows
from engine.policy import BatchRule, TunedPolicy
from engine.types import StepStats
from store.db import session_scope
from store.history import save_policy
from telemetry.writer import step_row, write_rows


def _steps() -> list[tuple[StepStats, str]]:
    rows = []
    for i in range(20):
        jitter = 1 + (0.01 if i % 2 else -0.01)
        rows.append((StepStats(step_id=i, time=100.0 + i, batch_size=8, decode_tokens=10,
                               step_ms=100.0 * jitter,
                               kv_pages_used=400, kv_pages_free=600, policy_version=1, tenants=("acme",)),
                               "pool"))
        rows.append((StepStats(step_id=100 + i, time=200.0 + i, batch_size=6, decode_tokens=12,
                               step_ms=100.0 * jitter, technique="draft", depth=2, proposed=12, accepted=4,
                               accepted_per_pos=(3, 1), kv_pages_used=300, kv_pages_free=450,
                               policy_version=2, tenants=("acme",)), "pool"))
        rows.append((StepStats(step_id=200 + i, time=300.0 + i, batch_size=2, decode_tokens=3, step_ms=20.0,
                               technique="ngram", depth=2, proposed=4, accepted=1, accepted_per_pos=(1, 0),
                               tenants=("acme",)), "tenants"))
        rows.append((StepStats(step_id=300 + i, time=400.0 + i, batch_size=2, decode_tokens=4, step_ms=20.0,
                               technique="ngram", depth=2, proposed=4, accepted=2, accepted_per_pos=(2, 0),
                               tenants=("acme", "globex")), "sweep"))
    return rows


@pytest.fixture
def pool_url(db_url: str, db: Engine) -> str:
    with db.begin() as conn:
        write_rows(conn, [step_row(s, inst) for s, inst in _steps()], [])
    with session_scope(db) as session:
        save_policy(session, 1, TunedPolicy(version=1, source="admin").to_dict(), "admin", instance="pool")
        draft = TunedPolicy((BatchRule(32, "draft", 2),), crossover=32, pool_split=0.25, version=2,
                            source="admin")
        save_policy(session, 2, draft.to_dict(), "admin", instance="pool")
    return db_url


def test_pool_runs_are_read_per_version_and_kept_out_of_q1_q2(pool_url):
    engine = open_database(pool_url)
    try:
        t = read_telemetry(engine, pool_instance="pool", tenant_instance="tenants")
    finally:
        engine.dispose()
    assert set(t.pool_runs) == {1, 2} and t.techniques == {"ngram": 40}  # pool steps counted apart
    rows = pool_rows(t)
    plain, draft = rows
    assert (plain["run"].technique, plain["run"].pool_split, plain["pages"],
            plain["lent"]) == ("none", 0.0, 1000, 0)
    assert (draft["run"].technique, draft["run"].pool_split, draft["pages"],
            draft["lent"]) == ("draft", 0.25, 750, 250)
    assert draft["lent_share"] == pytest.approx(0.25) and draft["run"].peak_batch == 6
    assert plain["throughput"].contains(100.0) and draft["ratio"].contains(1.2)  # 12 vs 10 tokens per 100 ms
    assert draft["ratio"].high - draft["ratio"].low < 0.05


def test_report_shows_the_pool_table_and_q1_on_the_tenant_instance(pool_url, tmp_path):
    text = build_report(ReportRequest(db=pool_url, out=tmp_path / "r", pool_instance="pool",
                                      tenant_instance="tenants", note="a designed fixture")).read_text()
    table = text.split("### Measured end to end")[1].split("\n### ")[0]
    assert ("| 2 | draft@2 | 0.25 | 750 | 250 (25%) | 6 |" in table
            and "| 1 | none@0 | 0 | 1000 | 0 (0%) | 8 |" in table)
    assert (tmp_path / "r" / "q3_pool.png").is_file() and "![Q3](q3_pool.png)" in text
    q1 = text.split("### Q1.")[1].split("\n### ")[0]
    # only instance "tenants" (acme alone, 1 of 4 drafts accepted) counts: no mixed batch there
    assert "instance `tenants`" in q1 and "accepted n/a in mixed batches and 0.250 [" in q1
    assert "draft@2 at split 0.25 lent 250 pages (25%), ran up to 6 at once" in text
    # the fixture's draft run delivers 1.2x plain with a tight interval: it paid for its memory
    assert "paid for its memory: draft@2 split 0.25." in text
    assert "--pool-instance pool --tenant-instance tenants" in text and "a designed fixture" in text
    assert "| ngram | mixed tenants |" not in text.split("## Q1.")[1].split("## Q2.")[0]
