"""bench/ragged_ab.py on the tiny model: both forwards timed on the same rows, bad flags refused."""

from __future__ import annotations

import pytest

from bench import ragged_ab
from tests.engine.conftest import make_engine


def test_measure_times_both_forwards_on_each_case(tiny):
    engine = make_engine(tiny)
    pool = engine.runner.kv
    out = ragged_ab.measure(engine, {"verify": (2, 3, 5, 8, 2)}, repeats=2,
                            progress=False)
    assert set(out) == {"verify"}
    for case in out.values():
        assert case["padded_ms"] > 0 and case["ragged_ms"] > 0
        assert case["ratio"] == pytest.approx(case["padded_ms"] / case["ragged_ms"], rel=0.01)
    assert engine.runner.kv.global_k.shape == pool.global_k.shape  # the pools are back on the runner


def test_a_case_larger_than_the_pool_is_refused(tiny):
    with pytest.raises(ValueError, match="global pages"):
        ragged_ab.measure(make_engine(tiny), {"big": (64, 1, 2048, 64, 64)}, progress=False)


@pytest.mark.parametrize("argv,message", [(["--cases", "nope"], "nope"), (["--repeats", "0"], "--repeats")])
def test_bad_flags_name_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        ragged_ab.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
