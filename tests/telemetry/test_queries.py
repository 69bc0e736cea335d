"""Aggregate queries and the dashboard views, on numbers checkable by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from bench.telemetry import sample_step
from engine.types import RequestResult
from store.db import session_scope
from telemetry import queries
from telemetry.retention import RetentionConfig, apply_retention
from telemetry.writer import request_row, step_row, write_rows

T0 = 1_700_000_040.0  # a minute boundary


def _step(t: float, technique: str, depth: int, per_pos: tuple, batch: int, step_ms: float,
          decode: int) -> dict:  # fmt: skip
    rec = dataclasses.replace(
        sample_step(0, t), technique=technique, depth=depth, accepted_per_pos=per_pos,
        proposed=depth * batch, accepted=sum(per_pos), batch_size=batch, step_ms=step_ms,
        decode_tokens=decode,
    )  # fmt: skip
    return step_row(rec)


STEPS = [
    # two sequences speculating 3 deep: 6 proposed
    _step(T0 + 1, "ngram", 3, (2, 1, 0), batch=2, step_ms=10.0, decode=5),
    _step(T0 + 2, "ngram", 3, (2, 2, 1), batch=2, step_ms=12.0, decode=7),
    _step(T0 + 3, "mtp", 2, (4, 1), batch=4, step_ms=20.0, decode=9),
    _step(T0 + 65, "none", 0, (), batch=4, step_ms=8.0, decode=4),
    _step(T0 + 70, "ngram", 3, (1, 0, 0), batch=2, step_ms=14.0, decode=3),
]
REQUESTS = [
    RequestResult("a1", "acme", 10, 20, T0, T0 + 0.5, T0 + 2, "stop", 10, 6),
    RequestResult("a2", "acme", 10, 20, T0, T0 + 0.25, T0 + 3, "length", 10, 2),
    RequestResult("g1", "globex", 5, 8, T0, None, T0 + 70, "abort", 0, 0),
]


@pytest.fixture
def filled(db: Engine) -> Engine:
    with db.begin() as conn:
        write_rows(conn, STEPS, [request_row(r) for r in REQUESTS])
    return db


def test_acceptance_by_technique_and_tenant(filled: Engine) -> None:
    with session_scope(filled) as s:
        by_technique = {a.key: a for a in queries.acceptance_by(s, "technique", T0)}
        by_tenant = {a.key: a for a in queries.acceptance_by(s, "tenant", T0)}
        late_only = queries.acceptance_by_technique(s, T0 + 60)
    assert (by_technique["ngram"].count, by_technique["ngram"].proposed) == (3, 18)
    assert by_technique["ngram"].accepted == 3 + 5 + 1
    assert by_technique["ngram"].rate == pytest.approx(9 / 18)
    assert by_technique["none"].rate is None
    assert by_technique["mtp"].rate == pytest.approx(5 / 8)
    assert (by_tenant["acme"].count, by_tenant["acme"].rate) == (2, pytest.approx(8 / 20))
    assert by_tenant["globex"].rate is None
    assert {a.key for a in late_only} == {"none", "ngram"}


def test_acceptance_by_draft_position(filled: Engine) -> None:
    with session_scope(filled) as s:
        rows = queries.acceptance_by_position(s, T0, technique="ngram")
    # three steps, two sequences each: 6 drafts offered at every position
    assert [(r.position, r.proposed, r.accepted) for r in rows] == [(0, 6, 5), (1, 6, 3), (2, 6, 1)]
    assert rows[1].conditional_rate == pytest.approx(3 / 5)
    assert rows[2].conditional_rate == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="by must be one of"):
        with session_scope(filled) as s:
            queries.acceptance_by(s, "color", T0)


def test_histogram_step_time_and_goodput(filled: Engine) -> None:
    with session_scope(filled) as s:
        hist = queries.batch_size_histogram(s, T0)
        times = queries.step_time_by(s, T0, technique="ngram")
        goodput = queries.goodput_over_time(s, 60, T0)
        fine = queries.goodput_over_time(s, 10, T0, until=T0 + 60)
    assert hist == {2: 3, 4: 2}
    assert [(t.batch_size, t.depth, t.steps, t.mean_ms, t.max_ms) for t in times] == [
        (2, 3, 3, pytest.approx(12.0), 14.0)
    ]
    assert [(g.bucket_start, g.steps, g.output_tokens) for g in goodput] == [
        (T0, 3, 21), (T0 + 60, 2, 7),
    ]  # fmt: skip
    assert goodput[0].tokens_per_s == pytest.approx(21 / 60)
    assert goodput[0].mean_batch_size == pytest.approx(8 / 3)
    assert [(g.bucket_start, g.output_tokens) for g in fine] == [(T0, 21)]


def test_queries_span_raw_rows_and_rollups(filled: Engine) -> None:
    with session_scope(filled) as s:
        before = (queries.acceptance_by_technique(s, T0), queries.batch_size_histogram(s, T0),
                  queries.acceptance_by_position(s, T0))  # fmt: skip
    apply_retention(filled, RetentionConfig(raw_steps_s=60.0), now=T0 + 125.0)  # rolls minute 1
    with session_scope(filled) as s:
        after = (queries.acceptance_by_technique(s, T0), queries.batch_size_histogram(s, T0),
                 queries.acceptance_by_position(s, T0))  # fmt: skip
        raw_only = queries.step_time_by(s, T0)
    assert after == before
    assert {t.technique for t in raw_only} == {"none", "ngram"}  # rolled minutes leave step_time_by


def test_views_agree_with_the_queries(filled: Engine, run_sql: Callable[..., list]) -> None:
    """The xo_v_* views, read with plain SQL (as a dashboard would), on both databases.

    PostgreSQL computes `x / 60.0` in NUMERIC: a reader gets a Decimal, hence float()."""
    apply_retention(filled, RetentionConfig(raw_steps_s=60.0), now=T0 + 125.0)
    acceptance = run_sql(
        "SELECT technique, SUM(proposed), SUM(accepted) FROM xo_v_acceptance"
        " WHERE minute_start >= :t0 GROUP BY technique ORDER BY technique", t0=T0)
    goodput = [(m, s, o, float(r)) for m, s, o, r in run_sql(
        "SELECT minute_start, steps, output_tokens, tokens_per_s FROM xo_v_goodput_minute"
        " ORDER BY minute_start")]
    tenants = run_sql(
        "SELECT tenant, requests, failed, accepted, mean_ttft_ms FROM xo_v_tenant_minute"
        " ORDER BY tenant")
    with session_scope(filled) as s:
        expected = [(a.key, a.proposed, a.accepted) for a in queries.acceptance_by_technique(s, T0)]
    assert acceptance == expected
    assert goodput == [(T0, 3, 21, pytest.approx(21 / 60)), (T0 + 60, 2, 7, pytest.approx(7 / 60))]
    assert tenants == [("acme", 2, 0, 8, pytest.approx(375.0)), ("globex", 1, 1, 0, None)]
