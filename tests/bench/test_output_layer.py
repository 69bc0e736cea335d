"""bench/output_layer.py on a small table: every variant timed per row count; bad rows named."""

from __future__ import annotations

import numpy as np
import pytest

from bench.output_layer import main, measure


def test_every_variant_is_timed_per_row_count():
    table = np.random.default_rng(0).standard_normal((4096, 32)).astype(np.float32)
    r = measure(table, (1, 3), repeats=1)
    assert set(r) == {"1", "3"}
    for row in r.values():
        assert len(row) == 4 and {"tied_logits float32", "rows @ table.T bfloat16"} <= set(row)
        assert min(row.values()) > 0


def test_bad_rows_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["--rows", "0,4"])
    assert "'0,4'" in capsys.readouterr().err
