"""C++ kernels the model calls through `jax.ffi` on CPU, and the builder they share.

- build.py: a `Library` (a source compiled once per instruction set, plus the FFI handlers) built
  once per source and compiler into the user cache, under a lock (engine/quant builds through it).
"""
