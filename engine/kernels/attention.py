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

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.kernels.build import Library
from engine.kernels.ffi import Kernel

LIBRARY = Library(
    source=Path(__file__).with_name("attention.cc"),
    folder="kernels",
    stem="attention",
    handlers=("-DAT_PART=0",),
    parts={"avx2": ("-DAT_PART=1", "-mavx2", "-mfma"), "portable": ("-DAT_PART=2",)},
)
TARGET = "crossover_ragged_attention"
ISA_NAMES = {1: "portable", 2: "avx2"}

KERNEL = Kernel(label="ragged attention", env="CROSSOVER_ATTENTION_KERNEL", library=LIBRARY,
                targets={TARGET: "CrossoverRaggedAttention"}, prefix="crossover_at_", isa_names=ISA_NAMES)
kernel_status = KERNEL.kernel_status  # "ffi (avx2)", "ffi (portable)" or "jnp (<why>)"
kernel_available = KERNEL.kernel_available
set_isa = KERNEL.set_isa  # "avx2" where the CPU has it, "portable" or "best"
supported_isas = KERNEL.supported_isas
set_threads = KERNEL.set_threads


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
