"""Paged KV cache: device storage (a pytree) and the host-side bookkeeping of its pools
(the page allocator itself is engine/memory/pages.py).

Two pools, one per layer kind. A page holds `page_size` tokens of keys and
values for *all* layers of its kind. Page 0 of each pool is never handed out:
padding rows and padding tokens write there, so it is scratch.

- Global layers: a sequence of length n owns ceil(n / page_size) pages, in
  logical order (page table `global_table`).
- Local (sliding-window) layers: a sequence owns a ring of at most `ring_pages`
  pages; position p lives in ring entry (p // page_size) % ring_pages. Ring
  capacity covers the window plus the verify slots of speculation, so writing
  rejected draft tokens never clobbers a key that is still inside the window.
- Prefix caching (engine/memory/prefix_cache.py): pages are reference-counted; full
  blocks' global pages are shared by requests with the same prefix. A local
  ring can share pages only as far as it holds them: a hit needs the cached
  local pages of the ring's blocks before it, and those survive the ring's
  wrapping because a wrap gives a cached entry a fresh page instead of
  overwriting it (that call reads the old page, writes the new one).

The device side never sees Python lists: the scheduler builds int32 page
tables with numpy and passes them in as arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.memory.pages import PageAllocator, SeqPages
from engine.memory.prefix_cache import PrefixCache

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVState:
    """Device storage of both pools."""

    global_k: jax.Array  # [n_global_layers, global_pages, page_size, kv_heads, hd]
    global_v: jax.Array
    local_k: jax.Array  # [n_local_layers, local_pages, page_size, kv_heads, hd]
    local_v: jax.Array

    @staticmethod
    def create(cfg: ModelConfig, global_pages: int, local_pages: int, page_size: int, dtype) -> KVState:
        def z(n_layers, pages):
            return jnp.zeros((n_layers, pages, page_size, cfg.n_kv_heads, cfg.head_dim), dtype)

        ng, nl = len(cfg.global_layers), len(cfg.local_layers)
        return KVState(z(ng, global_pages), z(ng, global_pages), z(nl, local_pages), z(nl, local_pages))

    @property
    def page_size(self) -> int:
        return self.local_k.shape[2]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.global_k, self.global_v, self.local_k, self.local_v))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Batch:
    """Per-call arrays describing which tokens to run and where their pages are."""

    tokens: jax.Array  # [B, T] int32 new tokens (padding arbitrary)
    start: jax.Array  # [B] int32 tokens already cached (position of tokens[:, 0])
    n_new: jax.Array  # [B] int32 real new tokens per row (0 for padding rows)
    global_table: jax.Array  # [B, P] int32 global page ids in logical order
    local_table: jax.Array  # [B, R] int32 ring page ids

    def positions(self) -> jax.Array:
        """[B, T] positions of the new tokens, -1 for padding."""
        t = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]
        return jnp.where(t < self.n_new[:, None], self.start[:, None] + t, -1)


def write_new(kv: KVState, batch: Batch, new_kv: dict, ring_pages: int) -> KVState:
    """Scatter the new tokens' keys/values (from forward) into their pages."""
    ps = kv.page_size
    pos = batch.positions()  # [B, T]
    real = pos >= 0
    safe = jnp.maximum(pos, 0)
    off = jnp.where(real, safe % ps, 0)
    R = ring_pages
    g_page = jnp.take_along_axis(batch.global_table, safe // ps, axis=1)
    l_idx = jnp.minimum((safe // ps) % R, batch.local_table.shape[1] - 1)  # narrow table: see cache_reader
    l_page = jnp.take_along_axis(batch.local_table, l_idx, axis=1)
    g_page = jnp.where(real, g_page, SCRATCH_PAGE)
    l_page = jnp.where(real, l_page, SCRATCH_PAGE)
    gk, gv = new_kv["global"]  # [Lg, B, T, KV, hd]; the first layers only for an early-exit draft
    lk, lv = new_kv["local"]

    def put(pool, new, page):
        if new.shape[0] == pool.shape[0]:
            return pool.at[:, page, off].set(new.astype(pool.dtype))
        return pool.at[: new.shape[0], page, off].set(new.astype(pool.dtype))

    return KVState(put(kv.global_k, gk, g_page), put(kv.global_v, gv, g_page),
                   put(kv.local_k, lk, l_page), put(kv.local_v, lv, l_page))


class KVPool:
    """Host-side bookkeeping of both pools for all sequences.

    `prefix_window`: the local layers' sliding window, to turn on prefix caching
    (engine/memory/prefix_cache.py); None leaves it off. It stays off when the ring is
    shorter than window + page_size - 1 tokens (see that module).
    """

    def __init__(self, global_pages: int, local_pages: int, page_size: int, ring_pages: int,
                 prefix_window: int | None = None):
        self.page_size = page_size
        self.ring_pages = ring_pages
        self.global_alloc = PageAllocator(global_pages)
        self.local_alloc = PageAllocator(local_pages)
        self.split = 0.0
        """The policy's share of each pool lent to speculation (`set_split`)."""
        self._keep = (0, 0)  # (global, local) pages the split must leave to one sequence (`yield_to`)
        self.on_lend = lambda event, pages=None: None
        """The draft model holding lent pages (engine/speculation/draft_model.py) hears "release" (a tenant's
        pages, any reason), "split" (the reservation changed) and "reset" (before the pools clear)."""
        self.prefix: PrefixCache | None = None
        if prefix_window is not None and ring_pages * page_size >= prefix_window + page_size - 1:
            self.prefix = PrefixCache(self.global_alloc, self.local_alloc, page_size, ring_pages)

    def _needs(self, pages: SeqPages, length: int) -> tuple[int, int, int]:
        """(global pages, ring entries, spares) to add so that positions [0, length) have pages."""
        want = -(-length // self.page_size)
        wraps = sum(1 for j in pages.shared if pages.ring_block[j] + self.ring_pages < want)
        return (max(0, want - len(pages.global_pages)),
                max(0, min(want, self.ring_pages) - len(pages.ring)), max(0, wraps - len(pages.spare)))

    def needed(self, pages: SeqPages, length: int) -> tuple[int, int]:
        """Extra (global, local) pages to hold positions [0, length)."""
        g, r, s = self._needs(pages, length)
        return g, r + s

    def grow(self, pages: SeqPages, length: int) -> bool:
        """Allocate so that positions [0, length) have pages; False (no change) if full."""
        g, r, s = self._needs(pages, length)
        if not (g or r or s):  # a decode within its pages: nothing to take
            return True
        if g > self.global_alloc.num_free or r + s > self.local_alloc.num_free:
            return False
        pages.global_pages += self.global_alloc.alloc(g) or []
        pages.ring_block += range(len(pages.ring), len(pages.ring) + r)  # entry j first holds block j
        pages.ring += self.local_alloc.alloc(r) or []
        pages.spare += self.local_alloc.alloc(s) or []
        return True

    def lookup(self, pages: SeqPages, tokens, tenant: str) -> int:
        """At admission (`pages` empty): take the cached pages of `tokens`' longest cached
        prefix; its length in tokens (0 without a prefix cache)."""
        return 0 if self.prefix is None else self.prefix.lookup(pages, tokens, tenant)

    def count_prefix(self, hit: int, queried: int) -> None:
        """An admitted sequence found `hit` of its `queried` tokens cached."""
        if self.prefix is not None:
            self.prefix.hit_tokens += hit
            self.prefix.query_tokens += queried

    def cache_blocks(self, pages: SeqPages, tokens, num_cached: int) -> None:
        """Register the full blocks of the `num_cached` tokens computed so far in the prefix cache."""
        if self.prefix is not None:
            self.prefix.register(pages, tokens, num_cached)

    def prepare(self, pages: SeqPages, num_cached: int, end: int) -> None:
        """Ready the ring for a call writing positions [num_cached, end) (after `grow`).

        Where the ring wraps onto an entry whose page the prefix cache has or is to
        keep, the entry gets another page; the old one stays the entry's read page
        until the new block has a cached token (engine/memory/prefix_cache.py).
        """
        for j in self._read_done(pages, num_cached):
            self.local_alloc.free([pages.reading.pop(j)])
        if self.prefix is not None:
            self.prefix.wrap(pages, num_cached, end)

    def _read_done(self, pages: SeqPages, num_cached: int) -> list[int]:
        """Ring entries whose old read page `prepare` frees: their new block has a cached token."""
        return [j for j in pages.reading if num_cached > pages.ring_block[j] * self.page_size]

    def settled(self, pages: SeqPages, num_cached: int, end: int) -> bool:
        """Whether a call writing positions [num_cached, end) after `num_cached` cached ones needs
        nothing of the pool: no block for `cache_blocks` to register, no page for `grow` to take,
        no ring entry for `prepare` to free or give another page. Its page tables are then those
        of the sequence's last call."""
        if any(self._needs(pages, end)) or self._read_done(pages, num_cached):
            return False
        px = self.prefix
        return px is None or (pages.cached >= px.computed_blocks(pages, num_cached)
                              and next(px.wrapping(pages, num_cached, end), None) is None)

    def set_split(self, share: float) -> None:
        """Lend `share` of each pool to speculation (the policy's pool split).

        Tenants keep the pages they hold; new pages come only from what is
        left, so shrinking below current use preempts at the next growth.
        The split never takes pages a sequence needs to finish alone (`yield_to`).
        """
        self.split = share
        self._apply_split()

    def yield_to(self, length: int) -> None:
        """Shrink the split, while needed, so one sequence of `length` tokens fits once the
        pool is empty; `yield_to(0)` gives the policy's split back.

        The scheduler calls it each step with the longest final length of the sequences
        running or at the head of the queue: a larger split applied while such a request
        waits shrinks for it instead of blocking the queue behind it forever.

        >>> pool = KVPool(41, 41, 4, 8)  # 40 usable pages per pool
        >>> pool.set_split(0.5); pool.global_alloc.capacity
        20
        >>> pool.yield_to(120); pool.global_alloc.capacity  # 30 pages of 4 tokens
        30
        >>> pool.yield_to(0); pool.global_alloc.capacity
        20
        """
        want = -(-length // self.page_size)  # `needed` of an empty sequence: no shared entries
        self._keep = (want, min(want, self.ring_pages)) if length > 0 else (0, 0)
        self._apply_split()

    def _apply_split(self) -> None:
        for a, keep in zip((self.global_alloc, self.local_alloc), self._keep):
            lent = int((a.num_pages - 1) * self.split)
            a.reserved = max(0, min(lent, a.num_pages - 1 - keep))
        self.on_lend("split")

    @property
    def yielded(self) -> int:
        """Pages the split gives back right now so the longest sequence can finish."""
        lent = sum(int((a.num_pages - 1) * self.split) for a in (self.global_alloc, self.local_alloc))
        return lent - self.reserved

    def fits_alone(self, length: int) -> bool:
        """Whether one sequence of `length` tokens fits in the empty pool (the split yields to it)."""
        g, l = self.needed(SeqPages([], []), length)
        return g <= self.global_alloc.num_pages - 1 and l <= self.local_alloc.num_pages - 1

    def release(self, pages: SeqPages, tokens=(), num_cached: int = 0) -> None:
        """Drop the sequence's holds; with the prefix cache, its computed blocks (the first
        `num_cached` of `tokens`) stay cached, deepest first to be evicted."""
        self.on_lend("release", pages)
        if self.prefix is not None and num_cached:
            self.prefix.register(pages, tokens, num_cached)
            for j in range(len(pages.ring)):
                self.prefix.keep_local(pages, j, num_cached, fresh=False)
        self.global_alloc.free(pages.global_pages[::-1])
        by_block = sorted(range(len(pages.ring)), key=lambda j: -pages.ring_block[j])
        self.local_alloc.free([pages.ring[j] for j in by_block] + list(pages.reading.values()) + pages.spare)
        pages.global_pages, pages.ring, pages.ring_block, pages.spare = [], [], [], []
        pages.reading.clear()
        pages.shared.clear()
        pages.cached = 0

    def drop_cached(self) -> dict:
        """Forget the cached blocks no sequence holds, their pages freed (PrefixCache.drop_unheld)."""
        off = {"enabled": False, "dropped_blocks": 0, "freed_pages": 0}
        return off if self.prefix is None else self.prefix.drop_unheld()

    def reset(self) -> None:
        """Every page back to the free lists and the prefix cache emptied; only when no sequence
        holds any (after a fault, so pages a failed step took without recording them cannot
        stay lost, and no cached page outlives KV arrays made anew)."""
        self.on_lend("reset")
        self.global_alloc.clear()
        self.local_alloc.clear()
        if self.prefix is not None:
            self.prefix.clear()

    def fill_tables(self, pages: SeqPages, g_row: np.ndarray, l_row: np.ndarray,
                    w_row: np.ndarray | None = None, cached: int | None = None) -> None:
        """Write one sequence's page ids into numpy page-table rows (rest scratch).

        `w_row`: the ring pages new tokens are written to, where `l_row` gets the
        pages read (they differ right after a wrap gave an entry a new page; see
        `prepare`); without it `l_row` gets the pages written to.
        `cached`: the tokens in the cache when the call reads, where that is past what
        `prepare` last saw (a drafter's later calls read what its earlier ones wrote):
        an entry whose new block already holds a cached token reads its new page.
        A row may be narrower than the pages held: pages past its width are
        not touched by that call.
        """
        k = min(len(pages.global_pages), len(g_row))
        g_row[:k] = pages.global_pages[:k]
        k = min(len(pages.ring), len(l_row))
        if w_row is None:
            l_row[:k] = pages.ring[:k]
            return
        w_row[:k] = pages.ring[:k]
        old = pages.reading
        if cached is not None:
            old = {j: p for j, p in old.items() if cached <= pages.ring_block[j] * self.page_size}
        l_row[:k] = [old.get(j, p) for j, p in enumerate(pages.ring[:k])]

    def table_rows(self, pages: SeqPages, g_width: int, l_width: int) -> tuple[list, list, list]:
        """One sequence's (global pages, ring pages read, ring pages written) as lists, cut to
        the widths: what `fill_tables` writes into zeroed rows with `w_row` (without `cached`),
        for a caller that copies the page ids into its tables itself (ragged steps)."""
        ring = pages.ring[:l_width]
        old = pages.reading
        return (pages.global_pages[:g_width],
                [old.get(j, p) for j, p in enumerate(ring)] if old else ring, ring)

    def prefix_status(self) -> dict:
        """Prefix-cache counters for status(): hits, lookups, hit rate, cached pages."""
        return {"enabled": False} if self.prefix is None else self.prefix.status()

    @property
    def reserved(self) -> int:
        """Pages lent to speculation by the pool split."""
        return self.global_alloc.reserved + self.local_alloc.reserved

    @property
    def used(self) -> int:
        return self.global_alloc.num_used + self.local_alloc.num_used

    @property
    def free(self) -> int:
        return self.global_alloc.num_free + self.local_alloc.num_free

    @property
    def total(self) -> int:
        return self.global_alloc.capacity + self.local_alloc.capacity
