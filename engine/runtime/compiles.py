"""Compilation bookkeeping: how many shapes were compiled, by whom, and what they cost.

- A process-wide counter of jit lowerings (`compile_count`) lets tests and
  `/ready` prove that serving compiles nothing after warmup. Lowerings made
  inside `warming()` (the background warmup thread of engine/warmup/warm.py) are
  counted apart, so `serving_compiles` moves only when a thread that serves
  compiles.
- `abstract` describes live arrays for ahead-of-time `jit(...).lower(...)`:
  shape, dtype and, for a committed array, its sharding, so that the
  executable it compiles is the one a later call with those arrays finds in
  the jit cache (a committed and an uncommitted argument lower differently).
- The persistent compilation cache and the memory-mapping cap of XLA:CPU.
- Host memory: `compile_ahead` drops what JAX keeps of each shape's lowering
  once it is compiled; glibc arenas capped and trimmed;
  `freeze_heap` takes warmup's objects out of the garbage collector's walks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import jax

_compiles = 0
_warming_compiles = 0
_lock = threading.Lock()
_local = threading.local()


def _on_event(name: str, *_args, **_kw) -> None:
    global _compiles, _warming_compiles
    # Lowering runs on every in-memory jit cache miss, also when the persistent
    # compilation cache then supplies the executable: it counts new shapes.
    if name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        with _lock:
            _compiles += 1
            if getattr(_local, "warming", False):
                _warming_compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Jit compilations (cache misses) in this process so far, any function, any thread."""
    return _compiles


def serving_compiles() -> int:
    """Jit compilations so far outside `warming()` blocks."""
    return _compiles - _warming_compiles


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """Count the lowerings this thread makes inside the block as warmup, not serving."""
    before = getattr(_local, "warming", False)
    _local.warming = True
    try:
        yield
    finally:
        _local.warming = before


def abstract(tree):
    """`tree` with every jax.Array replaced by its ShapeDtypeStruct (sharding kept only where
    the array is committed); numpy arrays and other leaves as they are. Reads metadata only,
    so an array another thread has donated meanwhile still works."""

    def one(a):
        if isinstance(a, jax.Array):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if a.committed else None,
                                        weak_type=a.aval.weak_type)
        return a

    return jax.tree.map(one, tree)


def outputs(compiled, committed: bool):
    """ShapeDtypeStructs of a compiled call's outputs, as a later call receives them: committed
    (with the compiled output sharding) when any input was committed, as jit does."""
    return jax.tree.map(lambda info, sh: jax.ShapeDtypeStruct(info.shape, info.dtype,
                                                              sharding=sh if committed else None),
                        compiled.out_info, compiled.output_shardings)


def any_committed(*trees) -> bool:
    return any(isinstance(a, jax.Array) and a.committed for a in jax.tree.leaves(trees))


def memory_mappings() -> int | None:
    """Memory mappings of this process (Linux), None where unknown."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """The mappings compiled code may take in this process (None: no known cap, or not XLA:CPU,
    whose kernels live on the host: each compiled executable maps its kernels separately)."""
    if jax.default_backend() != "cpu":
        return None
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def compile_ahead(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered.compile()`, then `drop_lowering(lowered)`: what warmup's jobs compile with."""
    compiled = lowered.compile()
    drop_lowering(lowered)
    return compiled


def drop_lowering(lowered: jax.stages.Lowered) -> bool:
    """Drop the StableHLO module (and its MLIR context) that JAX keeps beside the executable of
    a compiled `lowered` (in its lowering, which jit's cache holds, and in the cache of lowerings):
    a later call of that shape finds the executable without it. Each lowering keeps its own
    MLIR context with every dialect loaded, about a MiB per shape on a small function and more
    on the model's (`python -m bench.memory_probe serving --keep-lowerings` measures it).
    Whether it was dropped: False when `lowered` is not compiled yet or was dropped already, and
    where JAX's internals differ from those of jax 0.10 (then nothing is changed). Only this
    lowering is touched, and the cache of lowerings is only a cache: a shape not compiled yet
    lowers again when first compiled."""
    try:
        from jax._src.interpreters import pxla

        clear = pxla._cached_lowering_to_hlo.cache_clear
    except (ImportError, AttributeError):
        return False
    computation = getattr(lowered, "_lowering", None)
    if getattr(computation, "_executable", None) is None or getattr(computation, "_hlo", None) is None:
        return False
    computation._hlo = None  # MeshComputation.compile() returns the cached executable first
    clear()
    return True


M_ARENA_MAX = -8
"""glibc's mallopt parameter for the most malloc arenas."""


def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas (default 8 per core): XLA's compile and runtime threads each
    grow their own 64 MiB heaps, and memory freed in one stays resident there. Call before
    those threads start; whether it took effect (False off glibc)."""
    lib = _libc()
    return bool(lib is not None and lib.mallopt(M_ARENA_MAX, arenas))


def trim_heap() -> None:
    """Hand the free pages of every malloc arena back to the system (glibc; elsewhere nothing):
    compiling leaves much memory free but resident."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


def freeze_heap() -> int:
    """Move every object alive now into the collector's permanent generation (`gc.freeze`) and
    return how many are frozen. A warmed-up engine holds millions of objects (the vocabulary,
    JAX's executables and caches); a full collection walks all of them, a pause of seconds
    that stalls decoding whenever one falls during serving. Frozen, they are never walked
    again; what serving creates later is collected as usual. Call it once warmup has built what
    lives for the process's life (it does not collect first: that would be the same pause)."""
    import gc

    gc.freeze()
    return gc.get_freeze_count()


def enable_persistent_cache(path: str | None = None) -> str:
    """Keep compiled executables on disk so a restart (or the next test run) skips XLA.

    Defaults to $CROSSOVER_CACHE/jax (or ~/.cache/crossover/jax).
    """
    if path is None:
        root = os.environ.get("CROSSOVER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "crossover")
        path = os.path.join(root, "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
