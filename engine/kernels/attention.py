"""One layer's attention over a ragged call's tokens as one C++ call (engine/kernels/attention.cc).

engine/model/ragged.py's `attend` reads the cache block by block in XLA loops; on CPU each
block, layer and query group runs as its own small thunks. `ragged_attention` computes the
same attention (the step's own keys of each token's row and its row's cached keys, read from
the paged pool in place, one softmax) in one custom call per layer, over work items of (up to
8 tokens of a row, kv head) spread over XLA's intra-op thread pool.

`serves(...)` says whether a call goes here: CPU, one device (a custom call has no SPMD rule,
so a pool sharded over a mesh stays with jnp), float32 throughout, a head size that is a
multiple of 8, and the kernel built and on (it is off with `CROSSOVER_ATTENTION_KERNEL=off`).
Any token count: a prefill chunk's causal pass costs the kernel the visible pairs alone, where
the jnp path scores the dense [N, N] square. `kernel_status()` says which path serves and why;
the first check logs it once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.kernels.build import COMMON, BuildError, Library, build

log = logging.getLogger("crossover.engine")

LIBRARY = Library(
    source=Path(__file__).with_name("attention.cc"),
    folder="kernels",
    stem="attention",
    flags=COMMON,
    handlers=("-DAT_PART=0",),
    parts={"avx2": ("-DAT_PART=1", "-mavx2", "-mfma"), "portable": ("-DAT_PART=2",)},
)
TARGET = "crossover_ragged_attention"
ISA_NAMES = {1: "portable", 2: "avx2"}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": ctypes.CDLL | None, "status": str


def _load() -> ctypes.CDLL | None:
    """Build (or find) and register the kernel once per process; None when the jnp path serves."""
    with _lock:
        if "status" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, status = None, ""
        if os.environ.get("CROSSOVER_ATTENTION_KERNEL", "").lower() in ("off", "0", "false", "no"):
            status = "jnp (CROSSOVER_ATTENTION_KERNEL=off)"
        else:
            try:
                lib = ctypes.CDLL(str(build(LIBRARY)))
                capsule = jax.ffi.pycapsule(lib.CrossoverRaggedAttention)
                jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
                status = f"ffi ({ISA_NAMES[lib.crossover_at_isa()]})"
            except (BuildError, OSError, AttributeError) as exc:
                lib, status = None, f"jnp (the kernel did not build or load: {exc})"
        (log.info if lib is not None else log.warning)("ragged attention: %s", status)
        _state.update(lib=lib, status=status)
        return lib


def kernel_status() -> str:
    """"ffi (avx2)", "ffi (portable)" or "jnp (<why>)": the path attention takes on CPU."""
    _load()
    return str(_state["status"])


def kernel_available() -> bool:
    return _load() is not None


def set_isa(name: str) -> str:
    """Force the kernel's ISA ("avx2" where the CPU has it, "portable", or "best"); returns the
    previous one. For tests and benchmarks: it is process-wide."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"no kernel: {kernel_status()}")
    previous = ISA_NAMES[lib.crossover_at_isa()]
    codes = {n: c for c, n in ISA_NAMES.items()}
    code = lib.crossover_at_best_isa() if name == "best" else codes.get(name, -1)
    if lib.crossover_at_set_isa(code) < 0:
        raise ValueError(f"ISA {name!r} is not available on the CPU (best: "
                         f"{ISA_NAMES[lib.crossover_at_best_isa()]})")
    return previous


def supported_isas() -> list[str]:
    """The kernel ISAs the CPU runs ([] without the kernel)."""
    lib = _load()
    return [] if lib is None else [n for c, n in ISA_NAMES.items() if c <= lib.crossover_at_best_isa()]


def set_threads(n: int) -> None:
    """Threads per kernel call (0: XLA's intra-op pool size). Process-wide; for benchmarks."""
    lib = _load()
    if lib is not None:
        lib.crossover_at_set_threads(int(n))


def serves(q, k, v, pool_k, pool_v) -> bool:
    """Whether `ragged_attention` takes these operands (see the module docstring)."""
    f32 = all(a.dtype == jnp.float32 for a in (q, k, v, pool_k, pool_v))
    return (f32 and q.shape[-1] % 8 == 0 and jax.default_backend() == "cpu"
            and jax.device_count() == 1 and kernel_available())


def ragged_attention(q, k, v, row, pos, cached, table, pool_k, pool_v, layer, *, scale: float,
                     window: int | None, ring: int):
    """Attention of queries q [N, H, hd] over the step's own keys k, v [N, KV, hd] of their rows
    and their rows' caches in pool_k, pool_v [layers, pages, page_size, KV, hd] at pool index
    `layer` (an int32 scalar, traced or not), as engine.model.ragged.attend computes it.

    row, pos [N] int32: each token's row and position (-1: padding, zeros out); cached [S]: each
    row's cached tokens; table [S, W]: its page ids in slot order; ring: a sliding layer's ring
    in slots (table width x page size), 0 for a global table; window: None for none.
    Returns [N, H, hd] float32.
    """
    if not kernel_available():
        raise RuntimeError(f"the attention kernel is not available: {kernel_status()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    return call(q, k, v, i32(row), i32(pos), i32(cached), i32(table), pool_k, pool_v, i32(layer),
                scale=np.float32(scale), window=np.int64(window or 0), ring=np.int64(ring))
