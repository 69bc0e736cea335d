"""bench/ragged_chunk_cost.py on the tiny model: every case is timed, and nothing compiles or
takes a page while it runs."""

from __future__ import annotations

from bench.ragged_chunk_cost import measure
from tests.engine.conftest import make_engine


def test_every_case_is_timed_without_compiling_or_taking_pages(tiny):
    e = make_engine(tiny)
    e.warmup(progress=False)
    starts = (0, 40, e.max_context - 40)
    r = measure(e, starts=starts, repeats=1)
    assert r["bench"] == "ragged_chunk_cost" and r["max_context"] == e.max_context
    assert len(r["ms"]) == 4 + len(starts) and all(ms > 0 for ms in r["ms"].values())
    assert f"a 16-token chunk after {starts[-1]} alone" in r["ms"]
    assert e.compiles_since_warmup() == 0 and e.pool.used == 0
