"""The loader sizes the KV pool from the memory budget less the weights as served (engine/loader.py,
engine/memory/budget.py): the tiny GGUF's own blocks hold fewer bytes than its float32 numbers, and
the pool gets the difference; the memory block /ready shows names the served form and its bytes."""

from __future__ import annotations

import pytest

from engine import loader
from engine.memory.budget import memory_status, page_bytes
from engine.model.quant_weights import weight_bytes
from engine.model.tokenizer import Tokenizer
from engine.quant.matmul import kernel_available, kernel_status
from tests.engine.conftest import ByteTokenizer
from tests.engine.test_weights import tiny_gguf, tmp_cache  # noqa: F401 (fixtures)

POOL = 2 << 20
"""Bytes of KV pool the float32 engine gets beside its weights."""


@pytest.fixture
def load(tiny_gguf, monkeypatch):  # noqa: F811
    """load_engine on the tiny GGUF (a byte tokenizer: the file has none), small shapes."""
    monkeypatch.setattr(Tokenizer, "from_gguf",
                        classmethod(lambda cls, path=None, progress=True: ByteTokenizer()))
    path = str(tiny_gguf[0])
    return lambda **kw: loader.load_engine(model=path, max_batch=2, max_context=256, progress=False,
                                           speculation=False, **kw)


@pytest.mark.skipif(not kernel_available(), reason=f"no quantized-matmul kernel: {kernel_status()}")
def test_the_bytes_quantized_weights_do_not_take_go_to_the_pool(load):
    fixed = load(weights="float32", kv_budget_bytes=POOL)
    memory = weight_bytes(fixed.runner.params) + POOL
    f32, gguf = (load(weights=w, memory_budget_bytes=memory) for w in ("float32", "gguf"))
    m32, mq = memory_status(f32), memory_status(gguf)
    assert (m32["weights"], mq["weights"]) == ("float32", "gguf")
    assert m32["memory_budget_bytes"] == mq["memory_budget_bytes"] == memory
    assert mq["weight_bytes"] == weight_bytes(gguf.runner.params) < 0.8 * m32["weight_bytes"]
    assert m32["budget_bytes"] == POOL
    assert mq["budget_bytes"] == POOL + m32["weight_bytes"] - mq["weight_bytes"]
    assert f32.runner.rc.global_pages == fixed.runner.rc.global_pages  # the same pool as the fixed budget
    assert gguf.runner.rc.global_pages > f32.runner.rc.global_pages
    assert mq["max_context_tenants"] > m32["max_context_tenants"] > 0
    scratch = sum(page_bytes(gguf.runner.kv))  # page 0 of each pool, on top of the planned pool
    for m in (m32, mq):  # the pool fills what the weights leave, to less than a page of each pool
        assert 0 <= m["budget_bytes"] - (m["kv_pool_bytes"] - scratch) < scratch


def test_a_budget_that_leaves_nothing_or_two_budgets_are_refused(load):
    with pytest.raises(ValueError, match="leaves nothing for the KV pool"):
        load(weights="float32", memory_budget_bytes=1 << 10)
    with pytest.raises(ValueError, match="not both"):
        load(kv_budget_bytes=POOL, memory_budget_bytes=4 * POOL)
