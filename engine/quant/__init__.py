"""Quantized weights served as stored: group-quantized int8 / 5-bit / 4-bit matrices and their matmul.

- formats.py: `QuantWeight` (a pytree), lossless from GGUF blocks, int8 from float, dequantize.
- matmul.py: `qmatmul(x, w)`: the C++ kernel through `jax.ffi` where it builds, else jnp;
  `qgreedy(x, w)`: the greedy token of an int8 output table without its logits (a screen).
- build.py: compiles kernel.cc once per source and compiler into the user cache, under a lock.
"""
