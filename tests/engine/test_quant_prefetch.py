"""The kernel's software prefetch (engine.quant.matmul.set_prefetch) changes no result."""

from __future__ import annotations

import numpy as np
import pytest

from engine.quant import matmul as qm
from tests.engine.test_quant import needs_kernel, on_device, random_int4, random_int5, random_int8


@pytest.fixture
def restore_prefetch():
    before = qm.set_prefetch(2048)
    yield
    qm.set_prefetch(before)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])  # one-row tiles, direct row tiles, unpacked panels
def test_outputs_are_the_same_with_and_without_prefetch(rows, restore_prefetch):
    rng = np.random.default_rng(rows)
    weights = {"int8": random_int8(rng, 640, 512, 32, np.float16), "int5": random_int5(rng, 640, 512),
               "int4": random_int4(rng, 1024, 256)}
    for name, w in weights.items():
        w = on_device(w)
        x = rng.standard_normal((rows, w.shape[0])).astype(np.float32)
        assert qm.set_prefetch(0) == 2048  # the previous distance comes back
        plain = np.asarray(qm.qmatmul(x, w, path="ffi"))
        assert qm.set_prefetch(2048) == 0
        ahead = np.asarray(qm.qmatmul(x, w, path="ffi"))
        assert np.array_equal(plain, ahead), name
        if name == "int8" and rows <= 2:  # the greedy screen reads the same stream
            qm.set_prefetch(0)
            plain_tok = np.asarray(qm.qgreedy(x, w))
            qm.set_prefetch(4096)
            assert np.array_equal(np.asarray(qm.qgreedy(x, w)), plain_tok)
            qm.set_prefetch(2048)
            assert np.array_equal(plain_tok, np.argmax(ahead, axis=-1))


@needs_kernel
def test_a_negative_distance_turns_prefetch_off(restore_prefetch):
    qm.set_prefetch(-5)
    assert qm.set_prefetch(2048) == 0


@needs_kernel
def test_the_benchmark_times_a_no_prefetch_engine_with_prefetch_off(restore_prefetch):
    from bench.quant_engine import NO_PREFETCH, _setting

    with _setting("gguf" + NO_PREFETCH):
        assert qm.set_prefetch(0) == 0  # off inside
    assert qm.set_prefetch(2048) == 2048  # restored after
    with _setting("gguf"):
        assert qm.set_prefetch(2048) == 2048  # other engines run as configured
