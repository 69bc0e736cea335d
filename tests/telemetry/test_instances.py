"""Telemetry queries by instance: several daemons share the database, each query reads one
instance's rows (raw and rolled up) or, by default, every instance's."""

from __future__ import annotations

import dataclasses

from sqlalchemy import Engine

from bench.telemetry import sample_step
from engine.types import RequestResult
from store.db import session_scope
from telemetry import queries
from telemetry.retention import RetentionConfig, apply_retention
from telemetry.writer import request_row, step_row, write_rows

T0 = 1_700_000_040.0


def _rows(instance: str, technique: str, batch: int, n: int) -> list[dict]:
    return [step_row(dataclasses.replace(
        sample_step(0, T0 + i), technique=technique, depth=2, accepted_per_pos=(1, 0),
        proposed=2 * batch, accepted=1, batch_size=batch, step_ms=10.0, decode_tokens=batch + 1),
        instance) for i in range(n)]  # fmt: skip


def test_every_query_filters_by_instance(db: Engine) -> None:
    with db.begin() as conn:
        write_rows(conn, _rows("a", "ngram", 2, 3) + _rows("b", "mtp", 4, 5),
                   [request_row(RequestResult("r1", "acme", 1, 2, T0, T0, T0 + 1, "stop", 4, 2),
                                "a"),
                    request_row(RequestResult("r2", "globex", 1, 2, T0, T0, T0 + 1, "stop", 4, 1),
                                "b")])
    # roll b's raw steps up: its rows must still count for b (and only for b)
    apply_retention(db, RetentionConfig(raw_steps_s=10.0), now=T0 + 600, instance="b")
    with session_scope(db) as s:
        by_a = queries.acceptance_by_technique(s, T0, instance="a")
        by_b = queries.acceptance_by_technique(s, T0, instance="b")
        every = queries.acceptance_by_technique(s, T0)
        assert [(r.key, r.count) for r in by_a] == [("ngram", 3)]
        assert [(r.key, r.count) for r in by_b] == [("mtp", 5)]  # from the rollups
        assert {r.key for r in every} == {"ngram", "mtp"}
        assert [r.key for r in queries.acceptance_by(s, "tenant", T0, instance="b")] == ["globex"]
        assert queries.batch_size_histogram(s, T0, instance="a") == {2: 3}
        assert queries.batch_size_histogram(s, T0, instance="b") == {4: 5}
        assert queries.batch_size_histogram(s, T0) == {2: 3, 4: 5}
        assert {p.technique for p in queries.acceptance_by_position(s, T0, instance="b")} == {
            "mtp"}
        assert [r.technique for r in queries.goodput_by_batch(s, T0, instance="a")] == ["ngram"]
        assert queries.step_time_by(s, T0, instance="b") == []  # raw window only: rolled up
        assert [p.steps for p in queries.goodput_over_time(s, 3600, T0, instance="b")] == [5]
        assert queries.acceptance_by_technique(s, T0, instance="c") == []
