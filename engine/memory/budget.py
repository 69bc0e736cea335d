"""One memory budget: how the engine's memory divides between weights, tenants and speculation.

    memory budget = the target's weights as served (their real bytes: quantized
                    blocks' values, scales and mins, or float arrays)
                  + budget: speculation's resident bytes (MTP heads, draft-vocabulary
                    slices, exit adapters; a draft model's own weights and arrays)
                  + the KV pool: tenant pages + the pages the pool split lends

1. The loader (engine/loader.py) takes the served weights' bytes from the memory
   budget, then the resident bytes of the proposers it is about to load
   (`heads_resident_bytes`), and sizes the KV pool from what is left: each byte
   the weights do not take (quantized ones) goes to the tenants' pages, each
   resident byte of speculation is taken from them.
2. The policy's pool split withholds `pool_split` of each pool's pages from
   the tenants (engine/memory/kv.KVPool.set_split); the truncated-layer draft model
   keeps its KV in exactly those pages (engine/speculation/draft_model.py).
3. `status` reports both in bytes and in pages, and how many max-context
   tenants the tenant pages hold with and without the split: /ready shows it
   under `engine.memory`.
"""

from __future__ import annotations

import jax

from engine.memory.kv import SeqPages
from engine.quant.formats import QuantWeight, selectable


def page_bytes(kv) -> tuple[int, int]:
    """(global, local) K+V bytes of one page of an engine.memory.kv.KVState (0 for a kind without layers)."""
    g = (kv.global_k.nbytes + kv.global_v.nbytes) // max(kv.global_k.shape[1], 1)
    l = (kv.local_k.nbytes + kv.local_v.nbytes) // max(kv.local_k.shape[1], 1)
    return int(g), int(l)


def _tenants(pool, length: int, lent: tuple[int, int]) -> int:
    """Sequences of `length` tokens the tenant pages hold at once when `lent` (global, local)
    pages are withheld."""
    need = pool.needed(SeqPages([], []), length)
    fits = [(a.num_pages - 1 - held) // n
            for a, held, n in zip((pool.global_alloc, pool.local_alloc), lent, need)
            if n]
    return min(fits, default=0)


def memory_status(core) -> dict:
    """The budget of an EngineCore in bytes and pages (module docstring); `budget_bytes` is
    speculation + KV pool as the loader planned them, else pool + resident bytes. `weights`: the
    form served (engine/loader.py: "gguf", "int8", "float32", "bfloat16"; None when not loaded
    there); `weight_bytes`: the target's params as held; `memory_budget_bytes` = both."""
    pool, kv = core.pool, core.runner.kv
    gb, lb = page_bytes(kv)
    ga, la = pool.global_alloc, pool.local_alloc
    resident = sum(p.resident_bytes() for p in core.proposers.values())
    kv_bytes = int(kv.nbytes())
    lent = (ga.reserved, la.reserved)
    held = (len(ga.lent), len(la.lent))
    length = core.max_context
    budget = int(core.budget_bytes or kv_bytes + resident)
    weights = int(sum(a.nbytes for a in jax.tree.leaves(core.runner.params)))
    return {
        "memory_budget_bytes": weights + budget,
        "weights": core.weights_form,
        "weight_bytes": weights,
        "budget_bytes": budget,
        "kv_pool_bytes": kv_bytes,
        "resident_bytes": resident,
        "pool_split": pool.split,
        "tenant_pages": pool.total,
        "tenant_bytes": ga.capacity * gb + la.capacity * lb,
        "tenant_pages_used": pool.used,
        "lent_pages": sum(lent),
        "lent_bytes": lent[0] * gb + lent[1] * lb,
        "draft_pages_used": sum(held),
        "draft_bytes_used": held[0] * gb + held[1] * lb,
        "max_context": length,
        "max_context_tenants": _tenants(pool, length, lent),
        "max_context_tenants_unsplit": _tenants(pool, length, (0, 0)),
    }


def heads_resident_bytes(heads, cfg, techniques, vocab_sizes: tuple[int, ...], table,
                         exit_layers: int | None = None, draft_layers: int | None = None) -> int:
    """Bytes the proposers engine.speculation.drafting.add_model_proposers makes from `heads` will hold
    over the tied `table`: MTP heads and a slice of the table per compiled draft vocabulary; early
    exit and the draft model an adapter and one slice each (the smallest restricted vocabulary).
    A slice holds n entries as the table holds them (a quantized table's own columns where n is a
    multiple of its panel, else float rows) and n int32 ids."""
    def slice_bytes(n: int) -> int:
        whole = n == 0 or n >= cfg.vocab_size or n > heads.vocab.size  # the target's own table
        if whole:
            return 0
        if selectable(table, n):  # the table's own columns (engine/speculation/layer_draft.py)
            entry = table.nbytes // table.shape[1]
        else:  # rows in the compute dtype: float32 for a quantized table
            entry = cfg.d_model * (4 if isinstance(table, QuantWeight) else table.dtype.itemsize)
        return n * (entry + 4)

    restricted = min((v for v in vocab_sizes if v), default=0)
    total = 0
    if "mtp" in techniques and heads.mtp:
        total += sum(heads.head_bytes(h) for h in heads.mtp) + sum(slice_bytes(n) for n in set(vocab_sizes))
    for name, layers, default in (("early_exit", exit_layers, max), ("draft", draft_layers, min)):
        if name in techniques and heads.exits:
            total += heads.head_bytes(heads.exits[layers or default(heads.exits)]) + slice_bytes(restricted)
    return total


def status(core) -> dict:
    """EngineCore.status()'s speculation memory: per proposer and the whole budget."""
    return {
        "proposers": {n: {"resident_bytes": p.resident_bytes(), "max_depth": p.max_depth}
                      for n, p in core.proposers.items()},
        "memory": memory_status(core),
    }
