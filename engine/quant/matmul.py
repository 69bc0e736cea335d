"""y = x @ W for a `QuantWeight` W, without a float copy of W where the kernel runs.

Paths (`qmatmul(..., path=...)`):
- "ffi": engine/quant/kernel.cc through `jax.ffi` (built on first use by build.py, AVX-512 or
  AVX2 chosen by CPUID); each weight is converted to float32 in registers.
- "jnp": dequantize to float32 and dot: the reference, and the fallback when the kernel is
  switched off (`CROSSOVER_QUANT_KERNEL=off`), cannot be built, or the CPU lacks AVX2+FMA.
  XLA:CPU materializes the float32 matrix here on every call.
- None (default): "ffi" when the kernel is available on CPU, else "jnp".

`kernel_status()` says which path serves and why; the first call logs it once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import jax
import jax.numpy as jnp

from engine.quant.build import BuildError, build
from engine.quant.formats import QuantWeight, dequantize

log = logging.getLogger("crossover.engine")

_TARGETS = {8: "crossover_qmatmul_i8", 4: "crossover_qmatmul_i4"}
_SYMBOLS = {8: "CrossoverQMatmulI8", 4: "CrossoverQMatmulI4"}
ISA_NAMES = {0: "none", 1: "portable", 2: "avx2", 3: "avx512"}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": ctypes.CDLL | None, "status": str


def _load() -> ctypes.CDLL | None:
    """Build (or find) and register the kernel once per process; None when the jnp path serves."""
    with _lock:
        if "status" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, status = None, ""
        if os.environ.get("CROSSOVER_QUANT_KERNEL", "").lower() in ("off", "0", "false", "no"):
            status = "jnp (CROSSOVER_QUANT_KERNEL=off)"
        else:
            try:
                lib = ctypes.CDLL(str(build()))
                isa = lib.crossover_qk_isa()
                if isa == 0:
                    lib, status = None, "jnp (the CPU lacks AVX2+FMA)"
                else:
                    for bits, target in _TARGETS.items():
                        capsule = jax.ffi.pycapsule(getattr(lib, _SYMBOLS[bits]))
                        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
                    status = f"ffi ({ISA_NAMES[isa]})"
            except (BuildError, OSError, AttributeError) as exc:
                lib, status = None, f"jnp (the kernel did not build or load: {exc})"
        (log.info if lib is not None else log.warning)("quantized matmul: %s", status)
        _state.update(lib=lib, status=status)
        return lib


def kernel_status() -> str:
    """"ffi (avx512)", "ffi (avx2)" or "jnp (<why>)": the path `qmatmul` takes by default."""
    _load()
    return str(_state["status"])


def kernel_available() -> bool:
    return _load() is not None


def set_isa(name: str) -> str:
    """Force the kernel's ISA ("avx2", "avx512" where the CPU has it, or "portable": plain C++
    with the AVX-512 kernels' tiling; "best" restores); returns the previous one. For tests and
    benchmarks: it is process-wide."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"no kernel: {kernel_status()}")
    previous = ISA_NAMES[lib.crossover_qk_isa()]
    code = lib.crossover_qk_best_isa() if name == "best" else {v: k
                                                               for k, v in ISA_NAMES.items()}.get(name, -1)
    if lib.crossover_qk_set_isa(code) < 0:
        raise ValueError(f"ISA {name!r} is not available on the CPU (best: "
                         f"{ISA_NAMES[lib.crossover_qk_best_isa()]})")
    return previous


def supported_isas(portable: bool = False) -> list[str]:
    """The kernel ISAs the CPU runs ([] without the kernel); with `portable`, the plain C++ copy
    of the AVX-512 tiling too (slow: for tests)."""
    lib = _load()
    if lib is None:
        return []
    low = 1 if portable else 2
    return [n for c, n in ISA_NAMES.items() if low <= c <= lib.crossover_qk_best_isa()]


def set_threads(n: int) -> None:
    """Threads per kernel call (0: XLA's intra-op pool size). Process-wide; for benchmarks."""
    lib = _load()
    if lib is not None:
        lib.crossover_qk_set_threads(int(n))


def _ffi(x: jax.Array, w: QuantWeight) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(_TARGETS[w.bits], out)
    if w.bits == 4:
        return call(x, w.values, w.scales, w.mins)
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
