"""bench.long_prefill on the tiny engine: every stream token's gap lands in exactly one window,
and the ratios are the latencies' own."""

from __future__ import annotations

import pytest

from bench.long_prefill import measure
from tests.engine.conftest import make_engine


def test_gaps_split_into_during_and_outside_the_long_prefill(tiny):
    e = make_engine(tiny, verify_tokens=())
    r = measure(e, streams=2, prompt_tokens=60, warm_tokens=3, stream_tokens=24)
    whole, during, outside = r["itl_ms"], r["itl_during_prefill_ms"], r["itl_outside_prefill_ms"]
    assert whole["n"] == 2 * (24 - 1) == during["n"] + outside["n"]  # each gap in one window
    assert during["n"] > 0 and outside["n"] > 0 and r["long_ttft_ms"] > 0
    assert r["during_p99_over_median"] == pytest.approx(during["p99"] / whole["p50"], abs=2e-3)
    assert r["during_p99_over_outside_median"] == pytest.approx(during["p99"] / outside["p50"], abs=2e-3)
    assert not e.has_work() and e.pool.used == 0
