"""A search process that dies or hangs fails its retune alone: the next retune gets a fresh
process and succeeds. The search functions live at module level so the spawned worker can
import them."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from tests.tuner.conftest import FAST, history
from tuner.config import TunerConfig
from tuner.process import ProcessSearch
from tuner.search import SearchJob, SearchOutcome, run_search
from tuner.service import Tuner

NO_WAIT = dataclasses.replace(FAST, validation_s=0.0, search_timeout_s=120.0)
SHORT = dataclasses.replace(NO_WAIT, search_timeout_s=1.0)


def exit_on_first_retune(job: SearchJob) -> SearchOutcome:
    """Dies like an OOM-killed worker on the test database's first retune (id 1)."""
    if job.retune_id == 1:
        os._exit(3)
    return run_search(job)


def hang_when_bounded_short(job: SearchJob) -> SearchOutcome:
    """Hangs whenever its timeout is short (SHORT), else searches."""
    if job.config.search_timeout_s < 5:
        time.sleep(600)
    return run_search(job)


def finished(tuner: Tuner, view: dict, timeout: float = 120) -> dict:
    assert tuner.wait(view["id"], timeout), "retune did not finish"
    result = tuner.get(view["id"])
    assert result is not None and result["status"] != "running"
    return result


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or during the read
        return False


def wait_until(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_search_process_that_dies_fails_one_retune_and_the_next_one_runs(
        db: Engine, make_tuner: Callable[..., Tuner], caplog: pytest.LogCaptureFixture) -> None:
    history(db)
    caplog.set_level(logging.INFO, logger="crossover.tuner")
    tuner = make_tuner(NO_WAIT, search=ProcessSearch(exit_on_first_retune))
    crashed = finished(tuner, tuner.trigger("admin")[0])
    assert crashed["id"] == 1 and crashed["status"] == "failed"
    assert "SearchCrashed" in crashed["error"] and "died" in crashed["error"]
    # the message says it all: one warning line, no traceback in the log
    said = [r for r in caplog.records if "retune 1 failed" in r.getMessage()]
    assert said and all(r.exc_info is None for r in said)
    assert [r.levelno for r in said if r.levelno >= logging.WARNING] == [logging.WARNING]
    after = finished(tuner, tuner.trigger("admin")[0])
    assert after["status"] in ("applied", "rejected") and after["details"]["trials"] >= 1


def test_a_hung_search_is_killed_at_its_timeout_and_the_next_retune_runs(
        db: Engine, make_tuner: Callable[..., Tuner]) -> None:
    history(db)
    search = ProcessSearch(hang_when_bounded_short)
    tuner = make_tuner(NO_WAIT, search=search)
    assert finished(tuner, tuner.trigger("admin")[0])["status"] in ("applied", "rejected")
    worker = search.pid
    assert worker is not None and alive(worker)
    tuner.config = SHORT
    started = time.monotonic()
    hung = finished(tuner, tuner.trigger("admin")[0])
    assert time.monotonic() - started < 30
    assert hung["status"] == "failed" and "SearchTimeout" in hung["error"]
    assert "search_timeout_s=1 s" in hung["error"] and "killed" in hung["error"]
    assert wait_until(lambda: not alive(worker)), "the hung search's process still runs"
    tuner.config = NO_WAIT
    after = finished(tuner, tuner.trigger("admin")[0])
    assert after["status"] in ("applied", "rejected")
    assert search.pid not in (None, worker)


def test_an_idle_worker_that_died_is_replaced_before_the_search(db: Engine, db_url: str) -> None:
    from tests.tuner.test_search import job

    history(db, n=300)
    search = ProcessSearch()
    try:
        search(job(db_url, dataclasses.replace(NO_WAIT, trials=4)))
        first = search.pid
        os.kill(first, 9)  # the OOM killer, between two retunes
        assert wait_until(lambda: not alive(first))
        out = search(job(db_url, dataclasses.replace(NO_WAIT, trials=4)))
        assert out.best is not None and search.pid not in (None, first)
    finally:
        search.close()
    assert search.pid is None


def test_a_search_in_this_process_is_bounded_too(
        db: Engine, make_tuner: Callable[..., Tuner]) -> None:
    history(db)
    release = threading.Event()

    def stuck_when_short(job: SearchJob) -> SearchOutcome:
        if job.config.search_timeout_s < 5:
            release.wait(60)
        return run_search(job)

    tuner = make_tuner(SHORT, search=stuck_when_short)
    try:
        hung = finished(tuner, tuner.trigger("admin")[0], timeout=30)
        assert hung["status"] == "failed" and "SearchTimeout" in hung["error"]
        tuner.config = NO_WAIT
        assert finished(tuner, tuner.trigger("admin")[0])["status"] in ("applied", "rejected")
    finally:
        release.set()


def test_the_search_timeout_is_a_bounded_setting() -> None:
    assert TunerConfig().search_timeout_s == 900.0
    for bad in (0.0, 0.5, 2 * 86400.0):
        with pytest.raises(ValueError, match="search_timeout_s"):
            TunerConfig(search_timeout_s=bad)
    with pytest.raises(ValueError, match="ranges"):
        TunerConfig(ranges=tuple(range(1, 100)))  # more rules than a policy may hold


def lazy_modules_loaded(job: SearchJob) -> list[bool]:
    """Whether what a search imports lazily is already imported in this worker."""
    import sys

    return [name in sys.modules for name in ("scipy.optimize", "optuna.storages._rdb.storage")]


def test_a_started_worker_warms_up_before_the_first_search(
        db: Engine, make_tuner: Callable[..., Tuner]) -> None:
    from tests.tuner.test_search import job

    search = ProcessSearch(lazy_modules_loaded)
    tuner = make_tuner(NO_WAIT, search=search)
    assert search.ready and tuner.search_ready  # nothing started: a search would start at once
    tuner.start_search()
    assert wait_until(lambda: tuner.search_ready, 120), "the search worker never warmed up"
    assert tuner.describe()["search_ready"] is True
    from sqlalchemy import inspect

    assert inspect(db).has_table("studies")  # Optuna's storage was opened on the tuner's database
    warmed = search._warming.result()
    assert search(job("sqlite://", NO_WAIT)) == [True, True]  # type: ignore[comparison-overlap]
    assert search.pid == warmed  # the search ran in the warmed worker
    search.close()
    assert search.ready  # a dropped pool is no longer warming


def test_closing_kills_a_worker_still_warming_up() -> None:
    """`close()` right after `start()`: the worker is killed while it imports its warm-up, not
    left to finish it (the interpreter joins the pool at exit, which held a daemon's SIGTERM
    exit). SIGKILL ends it at once; the warm-up's imports take longer than the 0.5 s allowed."""
    search = ProcessSearch()
    search.start()
    workers = list(search._pool._processes)  # spawned by start()'s warm-up job
    assert workers and not search.ready
    search.close()
    assert wait_until(lambda: not any(alive(p) for p in workers), 0.5), "the warming worker still runs"


def test_the_worker_of_a_killed_daemon_exits() -> None:
    """A daemon killed without close() (SIGKILL, the OOM killer): its warmed, idle search
    worker exits too instead of waiting on its queue forever."""
    import subprocess
    import sys

    script = ("import os, time\n"
              "from tuner.process import ProcessSearch\n"
              "s = ProcessSearch(); s.start()\n"
              "while not s.ready: time.sleep(0.05)\n"
              "print(s._warming.result(), flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == -9, out.stderr
    worker = int(out.stdout.split()[-1])
    assert wait_until(lambda: not alive(worker), 10), "the dead daemon's search worker still runs"
