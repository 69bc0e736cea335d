"""C++ kernels the model calls through `jax.ffi` on CPU, and the builder they share.

- build.py: a `Library` (a source compiled once per instruction set, plus the FFI handlers) built
  once per source and compiler into the user cache, under a lock (engine/quant builds through it).
- ffi.py: a `Kernel`: its library loaded and registered with XLA once per process, its status,
  off switch and ctypes controls (ISA, threads); engine/quant/matmul.py and attention.py use it.
- parallel.h: what the C++ FFI handlers share: CPUID checks, work split over XLA's thread pool.
- attention.cc, attention.py: one layer's attention over a ragged call's tokens, reading the
  paged pools in place (engine/model/ragged.py dispatches to it on CPU).
"""
