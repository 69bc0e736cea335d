"""What `crossover serve`'s log says at startup about the weights (daemon/lifecycle.load_engine on a
tiny GGUF): by default its own blocks, which matmul path serves them (the kernel built on first use,
or why not), and the memory budget the pool was sized from."""

from __future__ import annotations

import logging

import pytest

from engine.model.tokenizer import Tokenizer
from engine.quant.matmul import kernel_available, kernel_status
from tests.engine.conftest import ByteTokenizer
from tests.engine.test_weights import tiny_gguf, tmp_cache  # noqa: F401 (fixtures)

KERNEL = kernel_status()
"""Found or built in the user cache once, before tmp_cache points the cache at a fresh folder."""


@pytest.fixture
def startup_log(tiny_gguf, monkeypatch, caplog):  # noqa: F811
    """The log lines of loading the tiny GGUF as the daemon does, with no weights or dtype given."""
    from daemon import lifecycle
    from daemon.settings import Settings

    monkeypatch.setattr(Tokenizer, "from_gguf",
                        classmethod(lambda cls, path=None, progress=True: ByteTokenizer()))
    with caplog.at_level(logging.INFO):
        engine = lifecycle.load_engine(Settings(model=str(tiny_gguf[0]), memory_budget_bytes=4 << 20,
                                                max_batch=2, max_context=256, speculation=False))
    return engine, [r.getMessage() for r in caplog.records]


def test_the_log_names_the_weights_and_the_matmul_path(startup_log):
    engine, lines = startup_log
    form = "gguf" if kernel_available() else "float32"
    assert engine.weights_form == form
    if kernel_available():
        assert f"weights: gguf, quantized matmul: {KERNEL}" in lines and KERNEL.startswith("ffi (")
    else:
        fallback = "weights: gguf asked, but the quantized matmul is jnp ("
        assert any(line.startswith(fallback) for line in lines)
    engine_line = next(line for line in lines if line.startswith("engine: "))
    assert f"weights {form} (" in engine_line and "of a 4 MiB memory budget" in engine_line
