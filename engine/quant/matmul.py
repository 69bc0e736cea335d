"""y = x @ W for a `QuantWeight` W, without a float copy of W where the kernel runs.

Paths (`qmatmul(..., path=...)`):
- "ffi": engine/quant/kernel.cc through `jax.ffi` (built on first use by build.py, AVX-512 or
  AVX2 chosen by CPUID); each weight is converted to float32 in registers, and each weight stream
  is prefetched a few lines ahead (`set_prefetch`). One target per value form (int8, 5-bit,
  int4); the handler reads the scales' dtype (float32 or float16).
- "jnp": dequantize to float32 and dot: the reference, and the fallback when the kernel is
  switched off (`CROSSOVER_QUANT_KERNEL=off`), cannot be built, or the CPU lacks AVX2+FMA+F16C.
  XLA:CPU materializes the float32 matrix here on every call.
- None (default): "ffi" when the kernel is available on CPU, else "jnp".

`qgreedy(x, w)` gives each row's greedy token of an int8 table with float16 scales (GGUF's Q8_0
output layer) without its logits: for one or two rows integer sums over int16 steps of x bound
every logit, and only the columns whose bound reaches the best are computed exactly, as
`qmatmul` computes them; for more, `qmatmul`'s own product a block of columns at a time, each
block's maxima kept.

`kernel_status()` says which path serves and why; the first call logs it once.
"""

from __future__ import annotations

import ctypes
import os

import jax
import jax.numpy as jnp

from engine.kernels.ffi import Kernel
from engine.quant.build import LIBRARY
from engine.quant.formats import QuantWeight, dequantize

_TARGETS = {8: "crossover_qmatmul_i8", 5: "crossover_qmatmul_i5", 4: "crossover_qmatmul_i4"}
_GREEDY = "crossover_qgreedy_i8"
ISA_NAMES = {0: "none", 1: "portable", 2: "avx2", 3: "avx512"}
"""ISA codes: "portable" is plain C++ with the AVX-512 kernels' tiling, for tests on CPUs without
AVX-512; it is never chosen by default, and `set_isa("best")` restores the CPU's best."""

KERNEL = Kernel(label="quantized matmul", env="CROSSOVER_QUANT_KERNEL", library=LIBRARY,
                targets={_TARGETS[8]: "CrossoverQMatmulI8", _TARGETS[5]: "CrossoverQMatmulI5",
                         _TARGETS[4]: "CrossoverQMatmulI4", _GREEDY: "CrossoverQGreedyI8"},
                prefix="crossover_qk_", isa_names=ISA_NAMES, no_isa="the CPU lacks AVX2+FMA+F16C")
kernel_status = KERNEL.kernel_status  # "ffi (avx512)", "ffi (avx2)" or "jnp (<why>)"
kernel_available = KERNEL.kernel_available
set_isa = KERNEL.set_isa
set_threads = KERNEL.set_threads


def set_prefetch(nbytes: int) -> int:
    """The kernel's software prefetch distance in its weight streams, in bytes (0: none;
    default 2048); returns the previous one. Process-wide; for benchmarks that compare."""
    lib = KERNEL.load()
    if lib is None:
        raise RuntimeError(f"no kernel: {kernel_status()}")
    lib.crossover_qk_set_ahead.argtypes = [ctypes.c_int64]
    lib.crossover_qk_set_ahead.restype = ctypes.c_int64
    return int(lib.crossover_qk_set_ahead(int(nbytes)))


def supported_isas(portable: bool = False) -> list[str]:
    """The kernel ISAs the CPU runs ([] without the kernel); with `portable`, the plain C++ copy
    of the AVX-512 tiling too (slow: for tests)."""
    return KERNEL.supported_isas(lowest=1 if portable else 2)


def _ffi(x: jax.Array, w: QuantWeight) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(_TARGETS[w.bits], out)
    if w.bits == 4:
        return call(x, w.values, w.scales, w.mins)
    if w.bits == 5:
        return call(x, w.values, w.scales, w.high)
    return call(x, w.values, w.scales)


def qmatmul(x: jax.Array, w: QuantWeight, path: str | None = None) -> jax.Array:
    """x [..., K] float32 @ W [K, N] -> [..., N] float32 (see the module docstring for `path`)."""
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects K = {k}")
    if path is None:
        path = "ffi" if jax.default_backend() == "cpu" and kernel_available() else "jnp"
    lead = x.shape[:-1]
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, k)
    if path == "jnp":
        y = jnp.dot(x2, dequantize(w), preferred_element_type=jnp.float32)
    elif path == "ffi":
        if not kernel_available():
            raise RuntimeError(f"the quantized-matmul kernel is not available: {kernel_status()}")
        y = _ffi(x2, w)
    else:
        raise ValueError(f"path must be None, 'ffi' or 'jnp', got {path!r}")
    return y.reshape(*lead, n)


SCREEN_ENV = "CROSSOVER_GREEDY_SCREEN"
"""Set to off (0, false, no) to take greedy tokens from full logits always (for comparisons)."""


def greedy_screenable(w) -> bool:
    """Whether `qgreedy` serves `w`: int8 values with float16 scales (GGUF's Q8_0), the kernel on,
    SCREEN_ENV not off."""
    return (isinstance(w, QuantWeight) and w.bits == 8 and w.scales.dtype == jnp.float16
            and os.environ.get(SCREEN_ENV, "").lower() not in ("off", "0", "false", "no")
            and jax.default_backend() == "cpu" and kernel_available())


def qgreedy(x: jax.Array, w: QuantWeight) -> jax.Array:
    """argmax over n of (x @ W)[m, n], lowest n on ties, for x [M, K] and an int8 W with float16
    scales (`greedy_screenable`): int32 [M], the token `greedy(qmatmul(x, w))` gives, without
    the [M, N] logits (kernel.cc's Greedy: a screen up to two rows, block products past them)."""
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    return jax.ffi.ffi_call(_GREEDY, out)(jnp.asarray(x, jnp.float32), w.values, w.scales)


def screened_rows() -> int:
    """Rows whose token `qgreedy` took from its screen in this process (rows of block products not
    counted); 0 without the kernel."""
    lib = KERNEL.load()
    if lib is None:
        return 0
    fn = lib.crossover_qk_screened_rows
    fn.restype = ctypes.c_int64
    return int(fn())

