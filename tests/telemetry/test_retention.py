"""Retention: roll-ups are exact, late rows merge, and the database stays bounded."""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, func, select

from bench.telemetry import sample_step
from engine.types import RequestResult
from store.db import session_scope
from store.models import Request, Step, StepRollup
from telemetry import queries
from telemetry.recorder import Recorder
from telemetry.retention import RetentionConfig, apply_retention
from telemetry.writer import request_row, step_row, write_rows

T0 = 1_700_000_040.0  # a minute boundary
TECHNIQUES = (("none", 0), ("ngram", 3), ("mtp", 2))


TEMPLATE = step_row(sample_step(0, 0.0))


def _steps(n: int, start: float, rate: float, seed: int = 0) -> list[dict]:
    """Rows of three techniques, random batch sizes, step times and acceptances."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        technique, depth = TECHNIQUES[i % 3]
        per_pos = [rng.randint(0, 4) for _ in range(depth)]
        rows.append(dict(
            TEMPLATE, step_id=i, time=start + i / rate, technique=technique, depth=depth,
            proposed=4 * depth, accepted=sum(per_pos), accepted_per_pos=per_pos,
            batch_size=rng.choice((1, 2, 4, 8)), step_ms=rng.uniform(5, 20),
        ))  # fmt: skip
    return rows


def _insert(db: Engine, steps: list[dict], requests: list[dict] = ()) -> None:
    with db.begin() as conn:
        write_rows(conn, steps, list(requests))


def _snapshot(db: Engine, since: float) -> tuple:
    with session_scope(db) as s:
        return (
            queries.acceptance_by_technique(s, since),
            [
                (p.technique, p.position, p.accepted)
                for p in queries.acceptance_by_position(s, since)
            ],
            queries.batch_size_histogram(s, since),
            [
                (g.bucket_start, g.steps, g.output_tokens)
                for g in queries.goodput_over_time(s, 60, since)
            ],
        )


def test_rollups_preserve_every_aggregate(db: Engine) -> None:
    _insert(db, _steps(900, T0, rate=2.0))  # 7.5 minutes, three techniques
    before = _snapshot(db, since=T0)
    config = RetentionConfig(raw_steps_s=120.0, rollups_s=3600.0)
    now = T0 + 450.0 + 30.0  # cutoff: start of the minute holding T0 + 360
    result = apply_retention(db, config, now=now)

    with session_scope(db) as s:
        oldest_raw = s.scalar(select(func.min(Step.time)))
        n_raw = s.scalar(select(func.count()).select_from(Step))
        n_rollups = s.scalar(select(func.count()).select_from(StepRollup))
    assert oldest_raw >= T0 + 360.0 - 1e-9  # whole minutes before the cutoff are gone
    assert result.rolled_steps == 900 - n_raw == 720
    assert n_rollups == result.rollup_rows == 6 * 3  # six minutes x three techniques
    assert _snapshot(db, since=T0) == before  # queries see the same numbers


def test_late_steps_merge_into_existing_rollups(db: Engine) -> None:
    config = RetentionConfig(raw_steps_s=60.0, rollups_s=3600.0)
    _insert(db, _steps(60, T0, rate=1.0))
    apply_retention(db, config, now=T0 + 200.0)
    _insert(db, _steps(30, T0, rate=1.0, seed=1))  # late rows for the same minute
    apply_retention(db, config, now=T0 + 200.0)
    with session_scope(db) as s:
        rollups = s.scalars(select(StepRollup)).all()
        assert sum(r.steps for r in rollups) == 90
        assert len(rollups) == 3  # merged, not duplicated (the unique key holds)
        ngram = next(r for r in rollups if r.technique == "ngram")
        assert sum(int(v) for v in ngram.batch_hist.values()) == ngram.steps == 30
        assert len(ngram.accepted_per_pos) == 3 and sum(ngram.accepted_per_pos) == ngram.accepted


def test_old_rollups_and_requests_are_pruned(db: Engine) -> None:
    reqs = [request_row(RequestResult(f"r{i}", "acme", 1, 1, T0 + i, None, T0 + i, "stop"))
            for i in range(0, 7200, 600)]  # fmt: skip
    _insert(db, _steps(120, T0, rate=1 / 60), reqs)  # two hours, a step a minute
    config = RetentionConfig(raw_steps_s=600.0, rollups_s=3600.0, requests_s=1800.0)
    result = apply_retention(db, config, now=T0 + 7200.0)
    with session_scope(db) as s:
        assert s.scalar(select(func.min(StepRollup.minute_start))) >= T0 + 3600.0
        assert s.scalar(select(func.min(Request.finish_time))) >= T0 + 5400.0
    assert result.deleted_requests == 9
    assert result.deleted_steps == 60 and result.deleted_rollups == 0  # never rolled up in vain
    assert result.rolled_steps == 50  # the minutes between the two windows


@pytest.mark.sqlite_only("measures the SQLite file's size on disk")
def test_database_stays_bounded_over_a_simulated_day(db: Engine, db_url: str) -> None:
    """24 h at 0.25 steps/s stands in for 50 steps/s: the bounds scale with the rate."""
    rate, window, rollups_s, every = 0.25, 1800.0, 4 * 3600.0, 900.0
    config = RetentionConfig(raw_steps_s=window, rollups_s=rollups_s)
    path = db_url.removeprefix("sqlite:///")
    sizes, raw_max, rollups_max = {}, 0, 0
    for k in range(int(86400 / every)):  # one retention run per 15 simulated minutes
        start = T0 + k * every
        _insert(db, _steps(int(every * rate), start, rate, seed=k))
        apply_retention(db, config, now=start + every)
        with session_scope(db) as s:
            raw_max = max(raw_max, s.scalar(select(func.count()).select_from(Step)))
            rollups_max = max(rollups_max, s.scalar(select(func.count()).select_from(StepRollup)))
        hour = (k + 1) * every / 3600
        if hour in (12, 18, 24):
            _checkpoint(path)
            sizes[hour] = os.path.getsize(path)
    assert raw_max <= rate * (window + 60 + every)
    assert rollups_max <= (rollups_s / 60 + 1) * len(TECHNIQUES)
    assert sizes[24] <= sizes[12] * 1.05, sizes  # the file stopped growing after the windows filled
    per_step = sizes[24] / (rate * (window + 60 + every) + rollups_max)
    at_50 = per_step * (50 * (6 * 3600 + 60 + 60)) + per_step * (90 * 1440 * len(TECHNIQUES))
    assert at_50 < 2e9  # defaults at 50 steps/s: ~1.1M raw rows + 90 days of rollups, < 2 GB


def _checkpoint(path: str) -> None:
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def test_the_recorder_applies_retention_from_its_thread(
    db_url: str, run_sql: Callable[..., list]
) -> None:
    fake_now = T0 + 3600.0
    config = RetentionConfig(raw_steps_s=600.0, rollups_s=86400.0)
    with Recorder(db_url, retention=config, retention_interval_s=0.05, clock=lambda: fake_now,
                  flush_interval_s=0.05) as rec:  # fmt: skip
        for i in range(120):
            rec.record_step(sample_step(i, T0 + i))  # an hour old by the recorder's clock
        deadline = time.monotonic() + 10
        while rec.stats()["rolled_steps"] < 120 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = rec.stats()
    assert stats["rolled_steps"] == 120 and stats["retention_runs"] >= 1
    assert run_sql("SELECT COUNT(*) FROM xo_steps") == [(0,)]
    assert run_sql("SELECT SUM(steps) FROM xo_step_rollups") == [(120,)]


def test_config_errors_name_both_values() -> None:
    with pytest.raises(ValueError, match=r"rollups_s \(60.0\).*raw_steps_s \(120.0\)"):
        RetentionConfig(raw_steps_s=120.0, rollups_s=60.0).validate()
