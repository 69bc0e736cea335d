"""`run_bench` (what `crossover bench telemetry` calls) writes sane JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench.telemetry import run_bench


def test_run_bench_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench" / "telemetry.json"
    result = run_bench(str(out), seconds=1.0, db_url=None)
    assert json.loads(out.read_text()) == result
    assert "writer:" in capsys.readouterr().out
    paced = result["paced"]
    assert paced["all_rows_written"] and paced["dropped"] == 0
    assert result["rows_per_s"] > 1000
    assert 500 < paced["achieved_rate"] < 1100
    # record_step is an append under a lock: even on a busy machine it is far from
    # the 20 us per call that would be 2% of a core at 1,000 steps/s
    assert result["caller_unpaced"]["cpu_us_per_step"] < 20
    assert result["caller_core_percent_at_1000"] == paced["caller_core_percent"]


def test_run_bench_leaves_a_real_database_as_it_was(tmp_path: Path) -> None:
    import sqlite3

    url = f"sqlite:///{tmp_path / 'real.db'}"
    run_bench(None, seconds=0.3, db_url=url)
    con = sqlite3.connect(tmp_path / "real.db")
    assert con.execute("SELECT COUNT(*) FROM xo_steps").fetchone() == (0,)
    con.close()


def test_the_database_password_is_never_printed(pg_url: str, capsys) -> None:
    from sqlalchemy import make_url

    password = make_url(pg_url).password
    assert password, "the test server's URL carries a password"
    result = run_bench(None, seconds=0.3, db_url=pg_url)
    out = capsys.readouterr().out
    assert "telemetry bench on postgresql" in out and "***" in out
    secret = f":{password}@"  # the password as a URL carries it (it may equal the user's name)
    assert secret not in out and secret not in json.dumps(result)
