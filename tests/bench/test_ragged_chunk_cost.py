"""bench/ragged_chunk_cost.py on the tiny model: every case is timed, and nothing compiles or
takes a page while it runs."""

from __future__ import annotations

import pytest

from bench.ragged_chunk_cost import main, measure
from tests.engine.conftest import make_engine


def test_every_case_is_timed_without_compiling_or_taking_pages_and_forwards_per_chunk(tiny):
    e = make_engine(tiny)
    e.warmup(progress=False)
    starts = (0, 40, e.max_context - 40)
    r = measure(e, starts=starts, repeats=1)
    assert r["bench"] == "ragged_chunk_cost" and r["max_context"] == e.max_context
    assert len(r["ms"]) == 5 + len(starts) and all(ms > 0 for ms in r["ms"].values())
    assert f"a 16-token chunk after {starts[-1]} alone" in r["ms"]
    assert "forward_ms_by_chunk" not in r
    assert e.compiles_since_warmup() == 0 and e.pool.used == 0
    # forwards alone per chunk: their own executables, still no page taken
    r = measure(e, starts=starts, repeats=1, chunks=(1, 512))
    assert set(r["forward_ms_by_chunk"]) == set(r["ms"])
    assert all(set(t) == {1, 512} and min(t.values()) > 0 for t in r["forward_ms_by_chunk"].values())
    assert e.pool.used == 0


def test_bad_chunks_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["--chunks", "4,x"])
    assert "'4,x'" in capsys.readouterr().err
