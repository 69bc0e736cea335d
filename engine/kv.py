"""Paged KV cache: device storage (a pytree) and the host-side page allocator.

Two pools, one per layer kind. A page holds `page_size` tokens of keys and
values for *all* layers of its kind. Page 0 of each pool is never handed out:
padding rows and padding tokens write there, so it is scratch.

- Global layers: a sequence of length n owns ceil(n / page_size) pages, in
  logical order (page table `global_table`).
- Local (sliding-window) layers: a sequence owns a ring of at most `ring_pages`
  pages; position p lives in ring entry (p // page_size) % ring_pages. Ring
  capacity covers the window plus the verify slots of speculation, so writing
  rejected draft tokens never clobbers a key that is still inside the window.

The device side never sees Python lists: the scheduler builds int32 page
tables with numpy and passes them in (STYLE 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.model import KVView

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
    def create(cfg: ModelConfig, global_pages: int, local_pages: int, page_size: int, dtype) -> "KVState":
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


def cache_reader(kv: KVState, batch: Batch, ring_pages: int):
    """Returns read_cache(kind, layer_index) -> KVView for engine.model.forward.

    The local table may be narrower than the ring (short contexts): its slots
    are read as they are, positions still follow the full ring's arithmetic.
    """
    ps = kv.page_size
    B, P = batch.global_table.shape
    R = ring_pages
    last = (batch.start - 1)[:, None]  # [B, 1] newest cached position

    g_slots = jnp.arange(P * ps, dtype=jnp.int32)[None, :]
    g_pos = jnp.where(g_slots <= last, g_slots, -1)  # slot s holds position s
    cap = R * ps
    l_slots = jnp.arange(batch.local_table.shape[1] * ps, dtype=jnp.int32)[None, :]
    l_pos = last - jnp.mod(last - l_slots, cap)  # newest position congruent to the slot
    l_pos = jnp.where(l_pos >= 0, l_pos, -1)

    def read(kind: str, idx) -> KVView:
        if kind == "global":
            k, v, table, pos = kv.global_k, kv.global_v, batch.global_table, g_pos
        else:
            k, v, table, pos = kv.local_k, kv.local_v, batch.local_table, l_pos
        kk = k[idx, table]  # [B, pages, ps, KV, hd]: one gather
        vv = v[idx, table]
        shape = (B, table.shape[1] * ps, *kk.shape[3:])
        return KVView(kk.reshape(shape), vv.reshape(shape), jnp.broadcast_to(pos, shape[:2]))

    return read


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


class PageAllocator:
    """Hands out page ids of one pool; page 0 is reserved scratch."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.reserved = 0
        """Pages lent to speculation (the policy's pool split): never handed to tenants."""
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        """Pages a tenant can still get (0 while usage exceeds a grown reservation)."""
        return max(0, len(self._free) - self.reserved)

    @property
    def capacity(self) -> int:
        """Pages that can be handed out to tenants (all but scratch and the reservation)."""
        return self.num_pages - 1 - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > self.num_free:
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


@dataclass
class SeqPages:
    """The pages one sequence holds (host side)."""

    global_pages: list[int]
    ring: list[int]  # ring entries allocated so far (grows to ring_pages, then wraps)


class KVPool:
    """Host-side bookkeeping of both pools for all sequences."""

    def __init__(self, global_pages: int, local_pages: int, page_size: int, ring_pages: int):
        self.page_size = page_size
        self.ring_pages = ring_pages
        self.global_alloc = PageAllocator(global_pages)
        self.local_alloc = PageAllocator(local_pages)
        self.split = 0.0
        """The policy's share of each pool lent to speculation (`set_split`)."""
        self._keep = (0, 0)  # (global, local) pages the split must leave to one sequence (`yield_to`)

    def needed(self, pages: SeqPages, length: int) -> tuple[int, int]:
        """Extra (global, local) pages to hold positions [0, length)."""
        want = -(-length // self.page_size)
        return (max(0, want - len(pages.global_pages)),
                max(0, min(want, self.ring_pages) - len(pages.ring)))

    def grow(self, pages: SeqPages, length: int) -> bool:
        """Allocate so that positions [0, length) have pages; False (no change) if full."""
        g, l = self.needed(pages, length)
        if g > self.global_alloc.num_free or l > self.local_alloc.num_free:
            return False
        pages.global_pages += self.global_alloc.alloc(g) or []
        pages.ring += self.local_alloc.alloc(l) or []
        return True

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
        self._keep = self.needed(SeqPages([], []), length) if length > 0 else (0, 0)
        self._apply_split()

    def _apply_split(self) -> None:
        for a, keep in zip((self.global_alloc, self.local_alloc), self._keep):
            lent = int((a.num_pages - 1) * self.split)
            a.reserved = max(0, min(lent, a.num_pages - 1 - keep))

    @property
    def yielded(self) -> int:
        """Pages the split gives back right now so the longest sequence can finish."""
        lent = sum(int((a.num_pages - 1) * self.split) for a in (self.global_alloc, self.local_alloc))
        return lent - self.reserved

    def fits_alone(self, length: int) -> bool:
        """Whether one sequence of `length` tokens fits in the empty pool (the split yields to it)."""
        g, l = self.needed(SeqPages([], []), length)
        return g <= self.global_alloc.num_pages - 1 and l <= self.local_alloc.num_pages - 1

    def release(self, pages: SeqPages) -> None:
        self.global_alloc.free(pages.global_pages)
        self.local_alloc.free(pages.ring)
        pages.global_pages, pages.ring = [], []

    def reset(self) -> None:
        """Every page back to the free lists; only when no sequence holds any (after a fault,
        so pages a failed step took without recording them cannot stay lost)."""
        for a in (self.global_alloc, self.local_alloc):
            held = set(range(1, a.num_pages)) - set(a._free)
            a.free(sorted(held, reverse=True))

    def fill_tables(self, pages: SeqPages, g_row: np.ndarray, l_row: np.ndarray) -> None:
        """Write one sequence's page ids into numpy page-table rows (rest scratch).

        A row may be narrower than the pages held: pages past the call's
        context bucket are not touched by that call.
        """
        k = min(len(pages.global_pages), len(g_row))
        g_row[:k] = pages.global_pages[:k]
        k = min(len(pages.ring), len(l_row))
        l_row[:k] = pages.ring[:k]

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
