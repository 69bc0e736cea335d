"""The recorder on a real database (SQLite and PostgreSQL): round trip, close, drops, and a
locked SQLite file."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time

import pytest
from sqlalchemy import func, select, text

from bench.telemetry import sample_step
from engine.types import RequestResult, RowClass, StepStats, row_classes_from_json
from store.db import make_engine
from store.models import Request, Step
from telemetry.recorder import Recorder, RecorderConfig


def _rows(url: str, table) -> list[dict]:
    """Every row of a table, as SQLAlchemy reads it (JSON columns parsed), in id order."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(select(table).order_by(table.c.id))]
    finally:
        engine.dispose()


def _count(url: str, table=Step.__table__) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(table)).scalar_one()
    finally:
        engine.dispose()


NOT_STORED = ("scheduled_time",)
"""RequestResult fields that only /metrics reads (no xo_requests column)."""


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_step_table_mirrors_step_stats() -> None:
    """xo_steps has exactly StepStats' fields, plus the row id and the recorder's instance."""
    columns = [c.name for c in Step.__table__.columns]
    assert [c for c in columns if c not in ("id", "instance")] == _fields(StepStats)


def test_request_table_mirrors_request_result() -> None:
    """xo_requests has RequestResult's fields, plus the row id, the instance and the status;
    scheduled_time (read by /metrics for queue time) is not stored."""
    columns = [c.name for c in Request.__table__.columns]
    assert sorted(c for c in columns if c not in ("id", "instance", "status")) == sorted(
        f for f in _fields(RequestResult) if f not in NOT_STORED)


def test_engine_records_round_trip(db_url: str) -> None:
    stats = StepStats(
        step_id=3, time=1_700_000_000.5, batch_size=2, prefill_tokens=5, decode_tokens=4,
        technique="ngram", depth=2, proposed=4, accepted=2, accepted_per_pos=(2, 0),
        propose_ms=0.25, verify_ms=1.5, step_ms=2.0, kv_pages_used=3, kv_pages_free=7,
        queue_len=1, policy_version=9, preempted=1, tenants=("acme", "globex"),
        row_classes=(RowClass("acme", "ngram", 2, 1, 2, 2, (1, 1)), RowClass("globex", "none", 0, 1)),
    )  # fmt: skip
    result = RequestResult(
        request_id="r-1", tenant="acme", prompt_tokens=5, output_tokens=6,
        arrival_time=1_700_000_000.0, first_token_time=None, finish_time=1_700_000_001.0,
        finish_reason="abort", proposed_tokens=4, accepted_tokens=2, preemptions=1,
    )  # fmt: skip
    with Recorder(db_url, instance="host-a") as rec:
        assert rec.record_step(stats)  # engine objects directly
        assert rec.record_step(dataclasses.replace(stats, step_id=4))
        assert rec.record_request(result)
    steps = _rows(db_url, Step.__table__)
    (request,) = _rows(db_url, Request.__table__)
    assert len(steps) == 2
    assert [row["step_id"] for row in steps] == [3, 4]
    for row in steps:
        for name, value in dataclasses.asdict(stats).items():
            if name == "step_id":
                continue
            got = row[name]
            if name in ("accepted_per_pos", "tenants"):
                got = tuple(got)  # JSON lists
            if name == "row_classes":  # JSON objects, read back as the tuner does
                got, value = row_classes_from_json(got), stats.row_classes
            assert got == value, name
        assert row["instance"] == "host-a"
    for name, value in dataclasses.asdict(result).items():
        assert request[name] == value if name not in NOT_STORED else name not in request, name
    assert request["status"] == "aborted"


def test_close_flushes_everything_without_waiting_for_the_interval(db_url: str) -> None:
    rec = Recorder(db_url, flush_interval_s=60.0).start()
    time.sleep(0.05)  # the writer is now asleep for a minute
    for i in range(2500):
        rec.record_step(sample_step(i, 1e9 + i))
    started = time.monotonic()
    assert rec.close(timeout=10)
    assert time.monotonic() - started < 5
    assert _count(db_url) == 2500
    assert rec.stats()["written_steps"] == 2500 and rec.dropped == 0
    assert not rec.record_step(sample_step(0, 0.0))  # closed: dropped and counted
    assert rec.dropped == 1


def test_bounded_buffer_drops_and_counts(db_url: str) -> None:
    rec = Recorder(db_url, max_buffer=10, max_batch=10)  # not started: nothing drains
    accepted = [rec.record_step(sample_step(i, 1e9 + i)) for i in range(15)]
    assert accepted == [True] * 10 + [False] * 5
    assert not rec.record_request(RequestResult("r", "t", 1, 1, 0.0, None, 1.0, "stop"))
    assert rec.stats()["dropped_steps"] == 5 and rec.stats()["dropped_requests"] == 1
    assert rec.close(timeout=5)  # close without start writes what it holds
    assert _count(db_url) == 10 and rec.dropped == 6


def test_malformed_records_are_dropped_alone(db_url: str) -> None:
    with Recorder(db_url) as rec:
        rec.record_step(sample_step(1, 1e9))
        rec.record_step(object())
        rec.record_step(dataclasses.replace(sample_step(2, 1e9), batch_size="many"))
        rec.record_step(sample_step(3, 1e9))
        assert rec.flush(timeout=10)
        stats = rec.stats()
    assert _count(db_url) == 2
    assert stats["invalid"] == 2 and rec.dropped == 2 and "bad record" in stats["last_error"]


def _hold_write_lock(url: str, seconds: float, locked: threading.Event) -> None:
    con = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    con.execute("BEGIN IMMEDIATE")
    locked.set()
    time.sleep(seconds)
    con.execute("ROLLBACK")
    con.close()


SQLITE_LOCK = "holds SQLite's file write lock (PostgreSQL writers do not lock each other out)"


@pytest.mark.sqlite_only(SQLITE_LOCK)
@pytest.mark.parametrize("max_buffer", [100_000, 100])
def test_locked_database_loses_nothing_within_the_buffer(db_url: str, max_buffer: int) -> None:
    config = RecorderConfig(flush_interval_s=0.1, max_buffer=max_buffer, max_batch=50,
                            busy_timeout_ms=50, retry_max_s=0.2)  # fmt: skip
    locked = threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(db_url, 1.5, locked))
    with Recorder(db_url, config) as rec:
        holder.start()
        locked.wait(5)
        calls, sent = [], 0
        while holder.is_alive():  # keep serving while the database is locked
            t0 = time.perf_counter()
            rec.record_step(sample_step(sent, 1e9 + sent))
            calls.append(time.perf_counter() - t0)
            sent += 1
            if sent % 50 == 0:
                time.sleep(0.01)
        holder.join()
        assert rec.flush(timeout=20)
        stats = rec.stats()
    assert stats["write_errors"] >= 1 and "locked" in stats["last_error"]
    calls.sort()  # record_step never waits for the lock (the writer's busy timeout is 50 ms);
    # p99 rather than max: on a loaded machine any thread may be descheduled now and then
    assert calls[len(calls) // 2] < 0.001 and calls[int(0.99 * len(calls))] < 0.01
    assert _count(db_url) + rec.dropped == sent
    if max_buffer > sent:
        assert rec.dropped == 0 and _count(db_url) == sent
    else:
        assert rec.dropped >= sent - max_buffer - 50 > 0 and stats["dropped_steps"] == rec.dropped
        assert _count(db_url) >= max_buffer


class _Blank(Exception):
    """An exception whose message is empty (str() == "")."""


def test_errors_with_empty_messages_and_unexpected_failures_do_not_end_the_writer(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write failing with an empty-message exception, then a failure outside the write (a
    bug in taking rows): the writer thread logs, backs off and writes everything after."""
    from sqlalchemy.exc import OperationalError

    config = RecorderConfig(flush_interval_s=0.05, retry_initial_s=0.05, retry_max_s=0.1)
    with Recorder(db_url, config) as rec:
        write, take, failures = rec._write, rec._take, iter([
            ("write", OperationalError("INSERT", {}, _Blank())), ("write", _Blank()), ("take", _Blank())])
        due = next(failures)

        def failing(where, real):
            def call(*args):
                nonlocal due
                if due is not None and due[0] == where:
                    exc, due = due[1], next(failures, None)
                    raise exc
                return real(*args)
            return call

        monkeypatch.setattr(rec, "_write", failing("write", write))
        monkeypatch.setattr(rec, "_take", failing("take", take))
        for i in range(20):
            rec.record_step(sample_step(i, 1e9 + i))
            if i % 5 == 4:  # in four flushes: the failures land in different ones
                assert rec.flush(timeout=20)
        assert due is None
        assert rec._thread is not None and rec._thread.is_alive()
    assert _count(db_url) == 20


def test_unstarted_records_are_cheap() -> None:
    rec = Recorder("sqlite://", max_buffer=200_000, max_batch=200_000)  # in memory, never started
    steps = [sample_step(i, float(i)) for i in range(20_000)]
    t0 = time.thread_time()
    for s in steps:
        rec.record_step(s)
    per_call_us = (time.thread_time() - t0) / len(steps) * 1e6
    assert per_call_us < 20, per_call_us  # measured ~1 us; 20 us = 2% of a core at 1,000/s


@pytest.mark.sqlite_only(SQLITE_LOCK)
def test_close_gives_up_at_its_timeout_and_counts_the_loss(db_url: str) -> None:
    locked = threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(db_url, 2.0, locked))
    holder.start()
    locked.wait(5)
    rec = Recorder(db_url, busy_timeout_ms=50, retry_max_s=0.1).start()
    for i in range(300):
        rec.record_step(sample_step(i, 1e9 + i))
    started = time.monotonic()
    assert not rec.close(timeout=0.5)
    assert time.monotonic() - started < 1.5  # shutdown is not held hostage by a lock
    holder.join()
    assert rec.stats()["lost_at_close"] == 300 == rec.dropped
    assert _count(db_url) == 0


def test_connections_killed_by_the_server_lose_no_rows(pg_url: str) -> None:
    """PostgreSQL only: the server ends the recorder's connections again and again
    (as a restart or an administrator would); every row still arrives, once."""
    killer = make_engine(pg_url, isolation_level="AUTOCOMMIT")
    kill = text("SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    killed, sent = 0, 0
    with Recorder(pg_url, flush_interval_s=0.02, retry_max_s=0.1) as rec:
        # rounds until 5 kills found a connection open (one in backoff has none to cut)
        for _round in range(40):
            if killed >= 5 and _round >= 10:
                break
            for _ in range(200):
                rec.record_step(sample_step(sent, 1e9 + sent))
                sent += 1
            time.sleep(0.05)  # a flush or two on the connection...
            with killer.connect() as conn:  # ...which the server then ends
                killed += conn.execute(kill).scalar_one()
        assert rec.flush(timeout=20)
        stats = rec.stats()
    killer.dispose()
    assert killed >= 5  # the recorder's connections really were cut
    assert rec.dropped == 0 and stats["written_steps"] == sent >= 2000
    assert _count(pg_url) == sent
