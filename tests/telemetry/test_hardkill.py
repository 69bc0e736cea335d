"""A recorder killed with SIGKILL loses at most one flush interval of rows."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

FLUSH_INTERVAL_S = 0.2
RATE = 1000  # steps/s
CHILD = f"""
import sys, time
from bench.telemetry import sample_step
from telemetry.recorder import Recorder
rec = Recorder(sys.argv[1], flush_interval_s={FLUSH_INTERVAL_S}).start()
start = time.perf_counter()
for i in range(10**9):
    delay = start + i / {RATE} - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    rec.record_step(sample_step(i, 1e9 + i))
    if i % 20 == 19:
        print(i + 1, flush=True)  # recorded so far
"""


@pytest.mark.sqlite_only("what a killed process leaves in a SQLite file (WAL, no server)")
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_loses_at_most_one_flush_interval(db_url: str) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, db_url], stdout=subprocess.PIPE, text=True, env=env
    )
    recorded = 0
    deadline = time.monotonic() + 30
    try:
        while recorded < 1500 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            recorded = int(line)
        child.send_signal(signal.SIGKILL)  # no chance to flush
        child.wait(10)
        for line in child.stdout:  # counts printed before the kill, not read yet
            recorded = int(line)
    finally:
        child.kill()
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert recorded >= 1500, "the child did not get going"
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    written = con.execute("SELECT COUNT(*) FROM xo_steps").fetchone()[0]
    con.close()
    one_interval = RATE * FLUSH_INTERVAL_S
    slack = 0.1 * RATE  # a flush in progress, the wake-up being late on a busy machine
    print(f"recorded {recorded}, in the database {written}")
    assert written >= recorded - one_interval - slack, (written, recorded)
    assert written <= recorded + 100  # and the count is real: nothing invented


def test_a_normal_exit_without_close_still_flushes(
    db_url: str, run_sql: Callable[..., list]
) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = (
        "import sys\n"
        "from bench.telemetry import sample_step\n"
        "from telemetry.recorder import Recorder\n"
        "rec = Recorder(sys.argv[1], flush_interval_s=60).start()\n"
        "for i in range(500): rec.record_step(sample_step(i, 1e9 + i))\n"
    )  # exits at once: the recorder's atexit hook must flush
    subprocess.run([sys.executable, "-c", code, db_url], env=env, check=True, timeout=60)
    assert run_sql("SELECT COUNT(*) FROM xo_steps") == [(500,)]
