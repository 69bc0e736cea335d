"""Quantized weights (engine/quant): lossless GGUF unpacking, and every matmul path agreeing."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from engine.model.gguf_file import GGUFFile, default_gguf_path
from engine.quant import matmul as qm
from engine.quant.formats import (
    PANEL,
    QuantWeight,
    concat_columns,
    dequantize,
    from_gguf,
    pack,
    quantize_int8,
    take_columns,
)
from tests.engine.kernel_checks import check_missing_compiler, check_switched_off

ROWS = (1, 3, 16, 64)


# ------------------------------------------------------------------ helpers ---


def random_int8(rng, k: int, n: int, group: int) -> QuantWeight:
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    return pack(q, rng.uniform(1e-3, 2e-2, (n, k // group)).astype(np.float32))


def random_int4(rng, k: int, n: int, group: int = 32) -> QuantWeight:
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    s = rng.uniform(1e-3, 2e-2, (n, k // group)).astype(np.float32)
    return pack(q, s, rng.uniform(0, 0.1, s.shape).astype(np.float32))


def assert_close(y, x, w: QuantWeight) -> None:
    """y within float32 rounding of x @ W: each error at most 1e-5 of sum_k |x_k W_kn|."""
    wf = np.asarray(dequantize(w), np.float64)
    x = np.asarray(x, np.float64)
    exact, bound = x @ wf, np.abs(x) @ np.abs(wf)
    err = np.abs(np.asarray(y, np.float64) - exact)
    assert (err <= 1e-5 * bound + 1e-30).all(), float((err / (bound + 1e-30)).max())


def on_device(w: QuantWeight) -> QuantWeight:
    return jax.tree.map(jnp.asarray, w)


needs_kernel = pytest.mark.skipif(not qm.kernel_available(), reason=f"no kernel: {qm.kernel_status()}")


# ------------------------------------------------------------ the real file ---


@pytest.fixture(scope="module")
def real_file() -> GGUFFile:
    return GGUFFile.open(default_gguf_path(progress=False))


def one_of_each(gf: GGUFFile) -> dict[str, str]:
    """The first tensor of each quantized type, the 262144-row embedding aside."""
    found: dict[str, str] = {}
    for name, t in gf.tensors.items():
        if t.qtype.name in ("Q8_0", "Q5_0", "Q6_K", "Q4_K") and name != "token_embd.weight":
            found.setdefault(t.qtype.name, name)
    return found


def read(gf: GGUFFile, name: str) -> tuple[np.ndarray, QuantWeight]:
    t = gf.tensors[name]
    raw = np.fromfile(gf.path, np.uint8, count=t.nbytes, offset=t.offset)
    return raw, from_gguf(raw, t.qtype.name, t.shape)


@pytest.mark.slow
def test_gguf_blocks_unpack_losslessly(real_file):
    names = one_of_each(real_file)
    assert sorted(names) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    for qtype, name in names.items():
        raw, w = read(real_file, name)
        t = real_file.tensors[name]
        ref = np.asarray(gguf_dequantize(raw.reshape(t.shape[0], -1), t.qtype), np.float32)
        mine = np.ascontiguousarray(dequantize(w).T)
        assert mine.view(np.uint32).tolist() == ref.view(np.uint32).tolist(), (qtype, name)  # bit for bit
        assert (w.bits, w.group) == {"Q4_K": (4, 32), "Q6_K": (8, 16)}.get(qtype, (8, 32))
        assert w.nbytes < ref.nbytes / 2.5
        jitted = np.asarray(jax.jit(dequantize)(on_device(w))).T
        assert np.array_equal(jitted, ref), f"{name}: dequantize inside jit differs"


@pytest.mark.slow
def test_real_weights_through_every_path(real_file):
    rng = np.random.default_rng(1)
    for name in one_of_each(real_file).values():
        _, w = read(real_file, name)
        x = rng.standard_normal((5, w.shape[0])).astype(np.float32)
        assert_close(qm.qmatmul(x, on_device(w), path="jnp"), x, w)
        if qm.kernel_available():
            assert_close(qm.qmatmul(x, on_device(w), path="ffi"), x, w)


# ------------------------------------------------------------------ formats ---


def test_pack_layout_and_checks():
    rng = np.random.default_rng(0)
    w = random_int4(rng, 64, 32)
    assert w.values.shape == (32 // PANEL, 32, PANEL) and w.values.dtype == np.uint8
    assert w.scales.shape == w.mins.shape == (2, 2, PANEL)
    leaves = jax.tree.leaves(w)
    assert len(leaves) == 3
    assert len(jax.tree.leaves(random_int8(rng, 64, 32, 32))) == 2  # no mins
    with pytest.raises(ValueError, match="multiple of the panel width"):
        pack(np.zeros((24, 32), np.int8), np.ones((24, 1), np.float32))
    with pytest.raises(ValueError, match="0..15"):
        pack(np.full((16, 32), 16), np.ones((16, 1), np.float32), np.ones((16, 1), np.float32))
    with pytest.raises(ValueError, match="Q2_K"):
        from_gguf(b"", "Q2_K", (16, 256))


def test_quantize_int8_per_channel():
    rng = np.random.default_rng(0)
    wf = rng.standard_normal((96, 48)).astype(np.float32)
    w = quantize_int8(wf)
    assert w.group == 96 and w.scales.shape == (3, 1, PANEL)
    err = np.abs(dequantize(w) - wf)
    assert (err <= np.abs(wf).max(axis=0) / 254 * 1.0001).all()  # half a step per column
    assert np.array_equal(quantize_int8(np.zeros((32, 16), np.float32)).values, np.zeros((1, 32, 16)))


def test_concat_columns_and_take_columns():
    rng = np.random.default_rng(0)
    a, b = random_int8(rng, 64, 32, 32), random_int8(rng, 64, 48, 32)
    both = concat_columns([a, b])
    assert both.shape == (64, 80)
    assert np.array_equal(dequantize(both), np.concatenate([dequantize(a), dequantize(b)], axis=1))
    with pytest.raises(ValueError, match="same K"):
        concat_columns([a, random_int8(rng, 64, 16, 16)])
    for w in (both, random_int4(rng, 64, 48)):
        ids = jnp.array([0, 17, w.shape[1] - 1, 5])
        rows = take_columns(on_device(w), ids)
        assert np.array_equal(rows, np.asarray(dequantize(w)).T[np.asarray(ids)])


# ------------------------------------------------------------------- matmul ---


@pytest.mark.parametrize("kind", ["int8-g32", "int8-g16", "int8-channel", "int4"])
@pytest.mark.parametrize("m", ROWS)
def test_paths_agree(kind, m):
    rng = np.random.default_rng(m)
    k, n = 256, 96
    w = {"int8-g32": lambda: random_int8(rng, k, n, 32), "int8-g16": lambda: random_int8(rng, k, n, 16),
         "int8-channel": lambda: quantize_int8(rng.standard_normal((k, n)).astype(np.float32)),
         "int4": lambda: random_int4(rng, k, n)}[kind]()
    x = rng.standard_normal((m, k)).astype(np.float32)
    wd = on_device(w)
    assert_close(qm.qmatmul(x, wd, path="jnp"), x, w)
    assert_close(jnp.dot(x, dequantize(w)), x, w)  # the float32 path
    if not qm.kernel_available():
        return
    outs = {}
    for isa in qm.supported_isas(portable=True):  # portable: the AVX-512 tiling, on any CPU
        previous = qm.set_isa(isa)
        try:
            outs[isa] = np.asarray(qm.qmatmul(x, wd, path="ffi"))
            outs[f"{isa}-jit"] = np.asarray(jax.jit(qm.qmatmul)(x, wd))
        finally:
            qm.set_isa(previous)
    first = next(iter(outs.values()))
    assert_close(first, x, w)
    for label, y in outs.items():  # each output sums the same products in the same order
        assert np.array_equal(y, first), label


@needs_kernel
def test_kernel_threads_and_shapes():
    rng = np.random.default_rng(3)
    w = on_device(random_int8(rng, 640, 2048, 32))
    x = rng.standard_normal((2, 7, 640)).astype(np.float32)
    pooled = qm.qmatmul(x, w)
    assert pooled.shape == (2, 7, 2048)
    qm.set_threads(1)
    try:
        single = qm.qmatmul(x, w)
    finally:
        qm.set_threads(0)
    assert np.array_equal(pooled, single)
    hlo = jax.jit(qm.qmatmul).lower(x, w).as_text()
    # the int8 values go in as they are
    assert "crossover_qmatmul_i8" in hlo and "tensor<128x640x16xi8>" in hlo
    with pytest.raises(ValueError, match="K = 640"):
        qm.qmatmul(x[..., :320], w)


def test_kernel_off_falls_back_to_jnp(monkeypatch, caplog):
    check_switched_off(qm.KERNEL, monkeypatch, caplog)
    rng = np.random.default_rng(4)
    w, x = random_int4(rng, 64, 32), rng.standard_normal((3, 64)).astype(np.float32)
    hlo = jax.jit(qm.qmatmul).lower(x, on_device(w)).as_text()
    assert "custom_call" not in hlo
    assert_close(jax.jit(qm.qmatmul)(x, on_device(w)), x, w)
    with pytest.raises(RuntimeError, match="not available"):
        qm.qmatmul(x, on_device(w), path="ffi")


def test_missing_compiler_falls_back_to_jnp(monkeypatch, caplog, tmp_path):
    check_missing_compiler(qm.KERNEL, monkeypatch, caplog, tmp_path)


FAKE_CXX = """#!/bin/sh
# A stand-in compiler: --version prints a line; any other call writes its -o file after a pause
# (long enough for the builds to overlap), and each link appends a line to $LINKS.
[ "$1" = --version ] && { echo fake-cxx 1; exit 0; }
prev=""; for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done
sleep 0.5
case " $* " in *" -shared "*) echo "$$" >> "$LINKS";; esac
echo "object of $$" > "$out"
"""


def test_processes_building_at_once_link_once_and_share_the_library(tmp_path):
    """pytest-xdist's workers (and daemons) may build the kernel at the same moment into one cache:
    the lock lets one compile, the others wait and find its library, renamed into place whole."""
    import os
    import subprocess
    import sys

    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "CROSSOVER_CACHE": str(tmp_path / "cache"),
           "LINKS": str(tmp_path / "links")}
    code = "from engine.quant.build import build; print(build())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    assert len((tmp_path / "links").read_text().split()) == 1
    library = Path(paths.pop())
    assert library.read_text().startswith("object of ")
    assert sorted(p.name for p in library.parent.iterdir()) == sorted([library.name, f".{library.name}.lock"])
