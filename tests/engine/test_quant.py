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


def random_scales(rng, n: int, groups: int, dtype=np.float32) -> np.ndarray:
    """Positive scales; as float16 also a few of float16's edge values: subnormal, zero, negative,
    the largest finite (the portable kernel widens them in C++, AVX2 with F16C)."""
    s = rng.uniform(1e-3, 2e-2, (n, groups)).astype(dtype)
    if dtype == np.float16:
        edge = np.array([6e-8, 3e-5, 0.0, -0.0, -1.5e-2, 65504.0], np.float16)
        s.flat[rng.choice(s.size, edge.size, replace=False)] = edge
    return s


def random_int8(rng, k: int, n: int, group: int, scale_dtype=np.float32) -> QuantWeight:
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    return pack(q, random_scales(rng, n, k // group, scale_dtype))


def random_int5(rng, k: int, n: int, group: int = 32, scale_dtype=np.float16) -> QuantWeight:
    q = rng.integers(0, 32, (n, k)).astype(np.uint8)
    return pack(q, random_scales(rng, n, k // group, scale_dtype), bits=5)


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
        form = {"Q8_0": (8, 32, np.float16), "Q5_0": (5, 32, np.float16), "Q6_K": (8, 16, np.float32),
                "Q4_K": (4, 32, np.float32)}[qtype]
        assert (w.bits, w.group, w.scales.dtype) == form, qtype
        assert (w.high is not None) == (qtype == "Q5_0") and (w.mins is not None) == (qtype == "Q4_K")
        if qtype in ("Q8_0", "Q5_0"):  # the file's own bytes: values and float16 scales
            assert w.nbytes == t.nbytes, qtype
        assert w.nbytes < ref.nbytes / 2.5
        jitted = np.asarray(jax.jit(dequantize)(on_device(w))).T
        assert np.array_equal(jitted, ref), f"{name}: dequantize inside jit differs"
        ids = np.array([0, 17, t.shape[0] - 1, 5])
        rows = np.asarray(jax.jit(take_columns)(on_device(w), jnp.asarray(ids)))
        assert rows.view(np.uint32).tolist() == ref[ids].view(np.uint32).tolist(), f"{name}: take_columns"


@pytest.mark.slow
def test_real_embedding_is_the_files_bytes(real_file):
    """The tied Q8_0 table [262144, 640]: int8 values and the file's float16 scales, exactly its size;
    the rows an embedding lookup takes equal gguf's."""
    raw, w = read(real_file, "token_embd.weight")
    t = real_file.tensors["token_embd.weight"]
    assert w.shape == (640, 262144) and w.scales.dtype == np.float16 and w.nbytes == t.nbytes == raw.size
    ids = np.array([0, 1, 2, 106, 107, 262143, 40000])
    ref = np.asarray(gguf_dequantize(raw.reshape(t.shape[0], -1)[ids], t.qtype), np.float32)
    rows = np.asarray(take_columns(on_device(w), jnp.asarray(ids)))
    assert rows.view(np.uint32).tolist() == ref.view(np.uint32).tolist()


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
    # scales: float16 stays float16 for int8 and 5-bit values, 4-bit ones (and other dtypes) float32
    assert random_int8(rng, 64, 32, 32, np.float16).scales.dtype == np.float16
    assert pack(np.zeros((16, 32), np.int8), np.ones((16, 1), np.float64)).scales.dtype == np.float32
    assert pack(np.zeros((16, 32), np.uint8), np.ones((16, 1), np.float16),
                np.ones((16, 1), np.float16)).scales.dtype == np.float32


def test_5bit_layout_and_checks():
    """5-bit: the low four bits of q as the 4-bit form packs them, bit 4 of rows 8i..8i+7 in bits
    0..7 of high byte i, per output column."""
    q = np.zeros((32, 64), np.uint8)  # [N, K]
    q[0, 0], q[0, 1], q[1, 9], q[17, 63] = 31, 16, 21, 7
    w = pack(q, np.ones((32, 2), np.float16), bits=5)
    assert (w.bits, w.group, w.shape) == (5, 32, (64, 32)) and w.mins is None
    assert w.values.shape == (2, 32, PANEL) and w.high.shape == (2, 8, PANEL)
    assert w.values.dtype == w.high.dtype == np.uint8 and w.scales.dtype == np.float16
    assert w.values[0, 0, 0] == 0x0F and w.high[0, 0, 0] == 0b11  # rows 0 (31) and 1 (16) of column 0
    assert w.values[0, 4, 1] == 0x50 and w.high[0, 1, 1] == 0b10  # row 9 of column 1: 21 = 16 + 5
    assert w.values[1, 31, 1] == 0x70 and w.high[1, 7, 1] == 0  # row 63 of column 17: 7
    assert int(np.count_nonzero(w.high)) == 2
    wf = dequantize(w)
    assert wf[0, 0] == 15 and wf[1, 0] == 0 and wf[9, 1] == 5 and wf[63, 17] == -9 and wf[2, 2] == -16
    assert len(jax.tree.leaves(w)) == 3 and w.nbytes == 32 * 64 * 5 // 8 + 32 * 2 * 2
    with pytest.raises(ValueError, match="0..31"):
        pack(np.full((16, 32), 32), np.ones((16, 1), np.float16), bits=5)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(np.zeros((16, 36), np.uint8), np.ones((16, 3), np.float16), bits=5)
    with pytest.raises(ValueError, match="take no mins"):
        pack(np.zeros((16, 32), np.uint8), np.ones((16, 1), np.float32), np.ones((16, 1), np.float32), bits=5)


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
    with pytest.raises(ValueError, match="scale dtype"):  # float16 scales would widen silently
        concat_columns([a, random_int8(rng, 64, 16, 32, np.float16)])
    c5, d5 = random_int5(rng, 64, 32), random_int5(rng, 64, 16)
    five = concat_columns([c5, d5])
    assert five.shape == (64, 48) and five.high.shape == (3, 8, PANEL) and five.scales.dtype == np.float16
    assert np.array_equal(dequantize(five), np.concatenate([dequantize(c5), dequantize(d5)], axis=1))
    on_dev = concat_columns([on_device(c5), on_device(d5)])
    assert isinstance(on_dev.high, jax.Array) and np.array_equal(dequantize(on_dev), dequantize(five))
    with pytest.raises(ValueError, match="bits"):
        concat_columns([c5, random_int8(rng, 64, 16, 32, np.float16)])
    for w in (both, random_int4(rng, 64, 48), five, random_int8(rng, 64, 32, 32, np.float16)):
        ids = jnp.array([0, 17, w.shape[1] - 1, 5])
        rows = take_columns(on_device(w), ids)
        assert np.array_equal(rows, np.asarray(dequantize(w)).T[np.asarray(ids)])


# ------------------------------------------------------------------- matmul ---


@pytest.mark.parametrize("kind", ["int8-g32", "int8-g16", "int8-channel", "int4", "int8-f16", "int5-f16",
                                  "int5-f32", "int5-g8"])
@pytest.mark.parametrize("m", ROWS)
def test_paths_agree(kind, m):
    rng = np.random.default_rng(m)
    k, n = 256, 96  # 6 panels: a one-row call runs both wide tiles and single panels
    w = {"int8-g32": lambda: random_int8(rng, k, n, 32), "int8-g16": lambda: random_int8(rng, k, n, 16),
         "int8-channel": lambda: quantize_int8(rng.standard_normal((k, n)).astype(np.float32)),
         "int4": lambda: random_int4(rng, k, n),
         "int8-f16": lambda: random_int8(rng, k, n, 32, np.float16),
         "int5-f16": lambda: random_int5(rng, k, n),
         "int5-f32": lambda: random_int5(rng, k, n, 32, np.float32),
         "int5-g8": lambda: random_int5(rng, k, n, 8)}[kind]()
    assert w.scales.dtype == (np.float16 if kind.endswith("f16") or kind == "int5-g8" else np.float32)
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
    w5 = on_device(random_int5(rng, 640, 256))
    hlo = jax.jit(qm.qmatmul).lower(x, w5).as_text()
    # 5-bit: low nibbles, float16 scales and the high bits go in as they are
    assert "crossover_qmatmul_i5" in hlo and "tensor<16x320x16xui8>" in hlo
    assert "tensor<16x20x16xf16>" in hlo and "tensor<16x80x16xui8>" in hlo


@needs_kernel
def test_kernel_refuses_operands_that_do_not_match():
    """The handlers check every operand's shape and the scales' dtype: a mismatch is an error from
    the call (never a read past an operand)."""
    rng = np.random.default_rng(5)
    w8, w5, w4 = (on_device(w) for w in (random_int8(rng, 64, 32, 32, np.float16), random_int5(rng, 64, 32),
                                         random_int4(rng, 64, 32)))
    x = rng.standard_normal((3, 64)).astype(np.float32)

    def call(target: str, *operands) -> np.ndarray:
        return np.asarray(jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((3, 32), jnp.float32))(x, *operands))

    assert np.array_equal(call("crossover_qmatmul_i5", w5.values, w5.scales, w5.high), qm.qmatmul(x, w5))
    f16, bf16 = jnp.float16, jnp.bfloat16
    bad = {
        "i8 3 scale groups in 64 rows": ("i8", (w8.values, jnp.ones((2, 3, 16), f16)), "shapes do not match"),
        "i8 scales of 8 lanes": ("i8", (w8.values, w8.scales[:, :, :8]), "shapes do not match"),
        "i8 values of another K": ("i8", (w8.values[:, :32], w8.scales), "shapes do not match"),
        "i8 bfloat16 scales": ("i8", (w8.values, w8.scales.astype(bf16)), "float32 or float16"),
        "i5 short high bits": ("i5", (w5.values, w5.scales, w5.high[:, :4]), "high bits"),
        "i5 values of another K": ("i5", (w5.values[:, :16], w5.scales, w5.high), "shapes do not match"),
        "i5 groups of 4": ("i5", (w5.values, jnp.zeros((2, 16, 16), f16), w5.high), "multiple of 8"),
        "i5 too few panels": ("i5", (w5.values[:1], w5.scales[:1], w5.high[:1]), "shapes do not match"),
        "i4 float16 scales": ("i4", (w4.values, w4.scales.astype(f16), w4.mins), "float32 scales"),
        "i4 mins of another shape": ("i4", (w4.values, w4.scales, w4.mins[:, :1]), "mins must match"),
    }
    for label, (form, operands, message) in bad.items():
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            call(f"crossover_qmatmul_{form}", *operands)
            pytest.fail(label)


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


# ------------------------------------------------------------ greedy screen ---


def _greedy_reference(x, w: QuantWeight) -> np.ndarray:
    from engine.execute.sampling import greedy

    return np.asarray(greedy(qm.qmatmul(jnp.asarray(x), w, path="ffi")))


@needs_kernel
@pytest.mark.parametrize("m", (1, 2, 3, 5, 33))
def test_greedy_screen_gives_the_argmax_of_the_logits(m):
    """qgreedy's tokens are those of the kernel's own logits and an argmax, lowest id on ties, on
    every ISA: over random tables with float16's edge scales (negative, zero, the largest), with
    duplicated best columns (ties) and near-ties one float apart."""
    rng = np.random.default_rng(40 + m)
    k, n = 128, 4096
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    q[2049], q[3001] = q[77], q[77]  # three equal columns: the lowest id wins a tie
    q[1500] = q[1400]
    s = random_scales(rng, n, k // 32, np.float16)
    s[1500] = s[1400]
    s[1500, -1] = np.nextafter(s[1400, -1], np.float16(1))  # column 1500 a hair above 1400
    w = on_device(pack(q, s))
    assert qm.greedy_screenable(w)
    dense = np.asarray(dequantize(w))  # [k, n]
    xs = [rng.standard_normal((m, k)).astype(np.float32) * 3 for _ in range(4)]
    for col in (77, 1400):  # rows aligned with those columns make them the best
        x = np.repeat(dense[:, col][None] * 50, m, axis=0).astype(np.float32)
        xs.append(x + rng.standard_normal(x.shape).astype(np.float32) * 1e-3)
    bad = rng.standard_normal((m, k)).astype(np.float32)
    bad[0, 5] = np.nan
    bad[-1, 9] = np.inf
    for isa in qm.supported_isas(portable=True):
        previous = qm.set_isa(isa)
        try:
            for x in xs:
                got = np.asarray(jax.jit(qm.qgreedy)(x, w))
                assert np.array_equal(got, _greedy_reference(x, w)), (isa, got)
            # rows that are not finite (the engine sends them to the full product): computed in
            # full, a valid id, never a crash
            got = np.asarray(qm.qgreedy(bad, w))
            assert ((got >= 0) & (got < n)).all()
            assert np.array_equal(got[1:-1], _greedy_reference(bad, w)[1:-1])
        finally:
            qm.set_isa(previous)


@needs_kernel
def test_greedy_screen_refuses_what_it_does_not_serve():
    rng = np.random.default_rng(8)
    assert not qm.greedy_screenable(on_device(random_int8(rng, 64, 32, 32)))  # float32 scales
    assert not qm.greedy_screenable(on_device(random_int5(rng, 64, 32)))
    w = on_device(random_int8(rng, 64, 32, 32, np.float32))
    with pytest.raises(Exception, match="float16 scales"):
        jax.block_until_ready(qm.qgreedy(np.ones((1, 64), np.float32), w))


@needs_kernel
@pytest.mark.slow
def test_greedy_screen_on_the_real_table(real_file):
    """The default model's 262144-row Q8_0 table: the screen's tokens are the logits' argmax for
    rows of hidden-state scale, and it counts the rows it served."""
    _, w = read(real_file, "token_embd.weight")
    w = on_device(w)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2, 640)) * 5).astype(np.float32)
    x[:, [3, 76, 393, 585]] *= 20  # a few large features, as the model's hidden states have
    before = qm.screened_rows()
    assert np.array_equal(np.asarray(qm.qgreedy(x, w)), _greedy_reference(x, w))
    assert qm.screened_rows() == before + 2
