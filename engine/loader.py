"""Build a ready EngineCore from a model spec: weights, tokenizer, planned KV pool.

Default compute dtype per backend: float32 on CPU, bfloat16 on TPU/GPU.
On this CPU, XLA's bfloat16 matrix-vector product (batch 1) is ~10x slower
than float32, and float32 already streams weights near the read bandwidth;
bfloat16 pays only from batch ~8 on. Accelerators have native bf16 units and
half the bytes to read, so bf16 is faster there.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from engine.config import ModelConfig
from engine.core import EngineConfig, EngineCore
from engine.planner import KV_DTYPE_BYTES, size_pool
from engine.runner import RunnerConfig, enable_persistent_cache

PAGE_SIZE = 16
MAX_SPEC_DEPTH = 8
DEFAULT_KV_BUDGET = {"cpu": 2 << 30}  # elsewhere: what the planner leaves (see `crossover plan`)


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def smallest_batch(dtype: str) -> int:
    """XLA:CPU runs a bfloat16 matrix-vector product ~10x slower than a 2-row
    matrix product, so on CPU a lone bfloat16 sequence is padded to 2 rows."""
    return 2 if dtype == "bfloat16" and jax.default_backend() == "cpu" else 1


def context_buckets(max_context: int, page_size: int = PAGE_SIZE) -> tuple[int, ...]:
    """Page-table widths compiled: 64, 128, then 4x steps, ending exactly at max_context.

    Attention reads every slot of the bucket, so short contexts need small
    buckets: at batch 64 a 1024-slot bucket made attention cost more than
    all the weights, and a short chat (up to 64 tokens) decodes at batch 64
    ~20% faster in a 64-slot bucket than in a 128-slot one.
    Example: context_buckets(4096) == (64, 128, 512, 2048, 4096);
    context_buckets(600) == (64, 128, 512, 608).
    """
    top = -(-max_context // page_size) * page_size
    out, c = [], 64
    while c < top:
        out.append(c)
        c = 128 if c == 64 else c * 4
    return tuple(out) + (top,)


def batch_buckets(max_batch: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` up to max_batch (which is always included).

    Example: batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48).
    """
    out, b = [], smallest
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


MODEL_PROPOSERS = ("mtp", "early_exit", "draft")
"""The proposers a heads file provides (n-gram needs none)."""
VERIFY_TOKENS = (2, 3, 5, 9)
"""Verify buckets (1 + depth) compiled when speculation is on: depths 1, 2, 3-4, 5-8."""
SPEC_MAX_BATCH = 16
"""Largest decode batch compiled for verification by default (speculation stops paying beyond)."""


def runner_config(cfg: ModelConfig, dtype: str, kv_budget_bytes: int, max_batch: int,
                  max_context: int, kv_dtype: str | None = None, verify_tokens: tuple[int, ...] = (),
                  spec_max_batch: int = SPEC_MAX_BATCH) -> RunnerConfig:
    """Size the pools with the memory planner and choose the compiled buckets."""
    kv_dtype = kv_dtype or dtype
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv dtype {kv_dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")
    sizes = size_pool(cfg, kv_budget_bytes, PAGE_SIZE, kv_dtype, max_context, MAX_SPEC_DEPTH)
    cap = sizes.ring_pages * PAGE_SIZE
    return RunnerConfig(
        page_size=PAGE_SIZE,
        batch_buckets=batch_buckets(max_batch, smallest_batch(dtype)),
        prefill_buckets=tuple(b for b in (32, 128, 512) if b <= cap) or (cap,),
        context_buckets=context_buckets(max_context),
        global_pages=sizes.num_global_pages + 1,  # + the scratch page
        local_pages=sizes.num_local_pages + 1,
        ring_pages=sizes.ring_pages,
        dtype=dtype,
        kv_dtype=kv_dtype,
        verify_tokens=verify_tokens,
        spec_max_batch=min(spec_max_batch, max_batch),
        fast_output=dtype == "float32" and jax.default_backend() == "cpu",
    )


def load_engine(model: str | None = None, dtype: str | None = None, kv_budget_bytes: int | None = None,
                max_batch: int = 32, max_context: int = 4096, progress: bool = True,
                token_budget: int = 512, speculation: bool = True, heads: str | None = None,
                verify_tokens: tuple[int, ...] = VERIFY_TOKENS, spec_max_batch: int = SPEC_MAX_BATCH,
                model_proposers: tuple[str, ...] = MODEL_PROPOSERS) -> EngineCore:
    """Load weights and tokenizer, plan the pool, and return an (unwarmed) engine.

    With `speculation`, the verify buckets are compiled and the proposers load:
    n-gram always; those of `model_proposers` (MTP heads, early exit, the draft
    model) from `heads` (a `crossover train-heads` file; default: the one shipped
    for the model, if any; none read when `model_proposers` is empty).
    """
    from engine.gguf_file import default_gguf_path
    from engine.tokenizer import Tokenizer
    from engine.weights import load_model

    enable_persistent_cache()
    dtype = dtype or default_dtype()
    cfg, params = load_model(model, dtype, progress=progress)
    if max_context > cfg.max_position:
        raise ValueError(f"max_context={max_context} exceeds the model's max_position={cfg.max_position}")
    gguf = model if model and model.endswith(".gguf") else None
    # Every Gemma 3 size shares one 262k vocabulary: a HF directory uses the default file's.
    tokenizer = Tokenizer.from_gguf(gguf or default_gguf_path(progress), progress=progress)
    budget = kv_budget_bytes or DEFAULT_KV_BUDGET.get(jax.default_backend(), 4 << 30)
    rc = runner_config(cfg, dtype, budget, max_batch, max_context,
                       verify_tokens=verify_tokens if speculation else (), spec_max_batch=spec_max_batch)
    if progress:
        print(f"engine: {cfg.name} {dtype}, KV pool {rc.global_pages - 1} global + "
              f"{rc.local_pages - 1} local pages of {PAGE_SIZE} tokens, max batch {max_batch}, "
              f"context {rc.max_context}", file=sys.stderr, flush=True)
    engine = EngineCore(cfg, params, tokenizer, EngineConfig(runner=rc, token_budget=token_budget),
                        model_name=cfg.name)
    if speculation and model_proposers:
        _load_heads(engine, heads, dtype, progress, model_proposers)
    return engine


def _load_heads(engine: EngineCore, heads: str | None, dtype: str, progress: bool,
                techniques: tuple[str, ...] = MODEL_PROPOSERS) -> None:
    """MTP / early-exit / draft-model proposers from a heads file (none shipped: n-gram only)."""
    from engine.drafting import add_model_proposers
    from engine.heads import DraftHeads, default_heads_path

    path = heads or default_heads_path(engine.cfg)
    if heads is None and not path.is_file():
        if progress:
            print(f"engine: no draft heads for {engine.cfg.name} ({path}): n-gram speculation only",
                  file=sys.stderr, flush=True)
        return
    loaded = DraftHeads.load(path, dtype=jnp.dtype(dtype))
    add_model_proposers(engine, loaded, techniques)
    if progress:
        names = ", ".join(n for n in engine.proposers if n != "ngram")
        print(f"engine: draft heads {path} ({loaded.nbytes() / 2**20:.1f} MiB): {names}", file=sys.stderr, flush=True)
