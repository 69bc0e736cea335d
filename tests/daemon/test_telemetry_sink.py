"""Telemetry sinks: failures are logged, never raised into serving; drops logged, rate-limited."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import cast

import pytest
from sqlalchemy import Table

from daemon.telemetry_sink import DROP_LOG_INTERVAL_S, FanoutSink, RecorderSink
from engine.types import RequestResult, StepStats
from store.db import make_engine
from store.models import Request
from telemetry.recorder import Recorder
from tests.daemon.helpers import MODEL, LiveServer, wait_for
from tests.daemon.memory_sink import MemorySink

STEP = StepStats(1, 0.0, 1, 0, 1, "none", 0, 0, 0, (), 0.0, 0.0, 1.0, 1, 9, 0, 0)
RESULT = RequestResult("r1", "team-a", 3, 2, 0.0, 0.1, 0.2, "stop")


class Broken:
    def on_step(self, stats: StepStats) -> None:
        raise RuntimeError("sink down")

    def on_result(self, result: RequestResult) -> None:
        raise RuntimeError("sink down")

    def flush(self) -> None:
        raise RuntimeError("sink down")


def test_one_failing_sink_spares_the_others(caplog: pytest.LogCaptureFixture) -> None:
    memory = MemorySink()
    fan = FanoutSink([Broken(), memory])
    fan.on_step(STEP)
    fan.on_result(RESULT)
    fan.flush()
    assert memory.steps == [STEP] and memory.results == [RESULT] and memory.flushed == 1
    assert [r.message for r in caplog.records].count("telemetry sink failed") == 3


def test_dropped_rows_are_logged_once_per_interval(db_url: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    recorder = Recorder(db_url, max_buffer=1, max_batch=1)  # never started: fills at once
    sink = RecorderSink(recorder, clock=lambda: now[0])
    for _ in range(4):
        sink.on_step(STEP)
    now[0] += DROP_LOG_INTERVAL_S
    sink.on_result(RESULT)
    warnings = [r for r in caplog.records if r.message == "telemetry rows dropped"]
    assert len(warnings) == 2 and recorder.stats()["dropped"] == 4


def test_a_failing_database_is_logged_and_serving_goes_on(
        db_url: str, live: Callable[..., LiveServer], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="crossover.telemetry")
    server = live(db_url=db_url)
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    con.execute("DROP TABLE xo_requests")
    con.close()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
    assert server.post("/v1/completions", body).status == 200
    assert server.database is not None
    recorder = server.database.recorder
    # the recorder's thread counts the error, then logs it: wait for both
    wait_for(lambda: recorder.stats()["write_errors"] > 0
             and any("telemetry write failed" in r.getMessage() for r in caplog.records),
             what="a failed write, logged")
    assert server.post("/v1/completions", body).status == 200  # still serving
    engine = make_engine(db_url)
    cast(Table, Request.__table__).create(engine)  # back: the rows the recorder kept get written
    engine.dispose()
    wait_for(lambda: recorder.stats()["written_requests"] == 2, what="the retried rows")
    assert recorder.stats()["dropped"] == 0
