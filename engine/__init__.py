"""The crossover engine: a JAX Gemma 3 server core, one synchronous step at a time.

Map (lower layers first; a subpackage imports only those above it in this list, and the
contract modules at the top):

- types.py, config.py, policy.py: the contract other packages use by name (requests and
  events, the frozen model/serving configs, the tuned decode policy value).
- runtime/: the process around the engine: allocator settings, compile bookkeeping and
  XLA's caches, progress callbacks.
- memory/: bytes and pages: the paged KV pool, the prefix cache, the byte arithmetic and
  the planner that sizes the pool, the budget shared with speculation.
- kernels/: C++ kernels through `jax.ffi` on CPU and the builder they share (a source built
  once per instruction set and compiler into the user cache): ragged paged attention.
- quant/: weights served as the model file stores them (group-quantized int8 / 4-bit
  matrices) and their matmul: a C++ kernel through `jax.ffi`, built on first use, or jnp.
- model/: the Gemma 3 model and its files: the decoder, the flat-token forward, sharding,
  weights (GGUF, safetensors, the converted cache), tokenizer and chat template.
- execute/: what one forward runs on: the model runner, the ragged calls laid out for a
  step, in-jit sampling and its penalties, the host state of each sequence.
- speculation/: draft proposers (n-gram, MTP heads, early exit, draft model) and the
  trained heads they share.
- warmup/: compiling every ragged shape and the proposers' before serving, then running
  each once.
- step/: EngineCore (schedule -> execute -> update), the scheduler, one step as ragged
  calls, the per-row (technique, depth) chooser, fault containment.
- loader.py: builds a ready EngineCore from a model spec (weights, tokenizer, planned pool).
- fake.py: a fake EngineCore with the same surface, no JAX, for daemon and tuner tests.
- data/: packaged files (the shipped draft heads).
"""
