"""Bytes and pages: the paged KV cache and the arithmetic that sizes it.

- pages.py: the host-side page allocator (reference counts, cached pages) and the pages
  one sequence holds; page 0 is scratch.
- prefix_cache.py: full prompt pages shared between requests, keyed by a hash chain per
  tenant (pages.py's allocator counts their references and evicts them).
- kv.py: the paged KV pools (device pytree, one pool per layer kind) and their host-side
  bookkeeping, built on pages.py and prefix_cache.py.
- sizes.py: byte arithmetic of weights and KV pages (stdlib only); everything below
  counts with it.
- spec_memory.py: what each speculative technique costs in accelerator memory.
- planner.py: how many tenants' KV caches fit beside the weights (`crossover plan`).
- budget.py: how one KV byte budget divides between tenants and speculation at run time.
"""
