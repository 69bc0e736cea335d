"""Prefix caching: the full KV pages of a prompt prefix, shared between requests.

1. Keys. A sequence's tokens are cut into page-sized blocks. Block i's key is
   blake2b(key of block i-1 || block i's token ids); the key before block 0
   is the digest of the tenant's name, so tenants never share pages (a hit
   shows in the time to first token, and one tenant must not learn another's
   prompt from it). A key names the whole prefix up to its block's end (a
   128-bit digest: no two prefixes share one in practice).
2. Entries. `PrefixCache` maps a key to the global page holding that block
   and, once one is kept, the local (sliding-window) page holding it. A block
   is registered when a sequence has computed all of it (`register`); the
   sequence's own page becomes the entry's, so nothing is copied.
3. Hits. At admission (`lookup`) the longest chain of entries with the
   sequence's keys is found, capped at (tokens - 1) // page_size blocks: the
   last token is always computed, its logits give the next token. The
   sequence takes a reference on those pages and starts at the hit length.
4. Reference counts and eviction live in engine.memory.pages.PageAllocator: a page the
   cache indexes that no sequence references is free-but-evictable (it counts
   as free), and allocation takes truly free pages first, then evicts the
   least recently released cached page (deepest blocks of a prefix first).
   `drop_unheld` evicts every cached page at once (the admin's reset, between steps).

Sliding-window layers. A sequence keeps only a ring of `ring_pages` local
pages, reused as it grows, so a block's local page survives only while the
ring has not wrapped over it. To continue at a hit of h blocks, the sequence
needs the local pages of the last min(h, ring_pages) blocks before it (its
ring exactly as a sequence that computed the prefix would hold it), so:

- when the ring wraps onto an entry whose page holds a full, registered block,
  the entry gets a fresh page and the old one is kept as that block's local
  page (`keep_local`; no copy: the old block is leaving the window). If no
  page is free, the entry is overwritten in place as without a cache;
- a hit borrows those pages into its ring as shared entries (never written):
  when the ring wraps onto one, a spare page reserved at admission replaces it;
- a page still in the ring of the running sequence that computed it is
  adopted by a hit: that sequence's entry becomes shared too, and the hit
  allocates the spare it will need (`lookup`), so accounting stays whole;
- the call that first writes a replaced entry's new block still reads the old
  page (engine.memory.pages.SeqPages.reading: the read and write page tables differ for
  that call). That needs ring capacity >= window + page_size - 1, so the
  slots of the new page not yet written are outside every query's window;
  otherwise the cache stays off (engine.memory.kv.KVPool).

A hit is taken only as far as the global pages of every block and the local
pages of the last ring's blocks are all cached; shorter, otherwise.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.memory.pages import PageAllocator, SeqPages


def root_key(tenant: str) -> bytes:
    """The key before a tenant's first block."""
    return hashlib.blake2b(tenant.encode(), digest_size=16).digest()


def extend_keys(keys: list[bytes], root: bytes, tokens, page_size: int, n: int) -> None:
    """Append to `keys` (the keys of the leading blocks of `tokens`) until it has `n`.

    >>> a, b = [], []
    >>> extend_keys(a, root_key("t"), [5, 6, 7, 8, 9], 2, 2)
    >>> extend_keys(b, root_key("t"), [5, 6, 7, 0], 2, 2)
    >>> a[0] == b[0], a[1] == b[1]
    (True, False)
    """
    while len(keys) < n:
        i = len(keys)
        block = np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes()
        keys.append(hashlib.blake2b((keys[-1] if keys else root) + block, digest_size=16).digest())


@dataclass
class Entry:
    """The pages holding one cached block."""

    global_page: int
    local_page: int | None = None
    owner: tuple | None = None
    """(SeqPages, ring entry, page) of the running sequence whose ring holds this block's local
    page, while no page is kept for it (`PrefixCache.register`)."""


class PrefixCache:
    """Key -> pages of every cached block, and the hit counters (module doc)."""

    def __init__(self, global_alloc: PageAllocator, local_alloc: PageAllocator, page_size: int,
                 ring_pages: int):
        self.g, self.l = global_alloc, local_alloc
        self.page_size, self.ring_pages = page_size, ring_pages
        self.entries: dict[bytes, Entry] = {}
        self._by_global: dict[int, bytes] = {}
        self._by_local: dict[int, bytes] = {}
        self.hit_tokens = 0
        """Prompt tokens admitted sequences found cached, since the start."""
        self.query_tokens = 0
        """Tokens admitted sequences looked up (all of their tokens), since the start."""
        global_alloc.on_evict, local_alloc.on_evict = self._evict_global, self._evict_local

    def lookup(self, pages: SeqPages, tokens, tenant: str, adopt: bool = True) -> int:
        """Give the empty `pages` the cached pages of the longest usable prefix of `tokens`;
        the hit length in tokens (a multiple of page_size, at most len(tokens) - 1).

        A local page still in the ring of the running sequence that computed it is
        adopted: that sequence gets a spare page for when its ring wraps onto it
        (allocated here), and the page becomes the entry's (`adopt`; module doc)."""
        ps, R = self.page_size, self.ring_pages
        pages.root = root_key(tenant)
        limit = (len(tokens) - 1) // ps
        extend_keys(pages.keys, pages.root, tokens, ps, limit)
        chain: list[Entry] = []
        for key in pages.keys[:limit]:
            if (e := self.entries.get(key)) is None:
                break
            chain.append(e)
        h = len(chain)
        while h > 0:  # the ring's blocks before the hit need their local pages too
            missing = [b for b in range(max(0, h - R), h)
                       if chain[b].local_page is None and not (adopt and self._owner(chain[b], b))]
            if not missing:
                break
            h = missing[-1]
        n = min(h, R)
        for e in chain[:h]:
            self.g.share(e.global_page)
        held = [chain[b].local_page for b in range(h - n, h) if chain[b].local_page is not None]
        for page in held:  # held first: allocating the spares below must not evict them
            self.l.share(page)
        todo = [b for b in range(h - n, h) if chain[b].local_page is None]
        spares = self.l.alloc(len(todo)) if todo else []
        if spares is None:
            self.g.free([e.global_page for e in chain[:h]])
            self.l.free(held)
            return self.lookup(pages, tokens, tenant, adopt=False)
        for b, spare in zip(todo, spares):
            owner, j, page = chain[b].owner
            owner.spare.append(spare)
            owner.shared.add(j)
            self._attach(chain[b], page, pages.keys[b])
            self.l.share(page)
        pages.global_pages = [e.global_page for e in chain[:h]]
        pages.ring, pages.ring_block = [0] * n, [0] * n
        for b in range(h - n, h):
            pages.ring[b % R], pages.ring_block[b % R] = chain[b].local_page, b
            pages.shared.add(b % R)
        pages.cached = h
        return h * ps

    def _owner(self, e: Entry, b: int) -> bool:
        """Whether block b's local page is still in the ring of the sequence that computed it
        (that ring entry unchanged since `register` noted it); forgets a stale note."""
        if e.owner is not None:
            owner, j, page = e.owner
            if (j < len(owner.ring) and owner.ring[j] == page and owner.ring_block[j] == b
                    and owner.cached > b and j not in owner.shared):
                return True
            e.owner = None
        return False

    def _attach(self, e: Entry, page: int, key: bytes) -> None:
        e.local_page, e.owner, self._by_local[page] = page, None, key
        self.l.keep(page)

    def register(self, pages: SeqPages, tokens, num_cached: int) -> None:
        """Index the global pages of the blocks of `tokens` computed so far (the first
        `num_cached` tokens); a block another sequence registered first keeps that one's. A
        block whose local page is still in this ring is noted (`Entry.owner`) for adoption."""
        ps, R = self.page_size, self.ring_pages
        n = self.computed_blocks(pages, num_cached)
        if pages.cached >= n:
            return
        extend_keys(pages.keys, pages.root, tokens, ps, n)
        for i in range(pages.cached, n):
            if (e := self.entries.get(pages.keys[i])) is None:
                page = pages.global_pages[i]
                e = self.entries[pages.keys[i]] = Entry(page)
                self._by_global[page] = pages.keys[i]
                self.g.keep(page)
            j = i % R
            if (e.local_page is None and j < len(pages.ring) and pages.ring_block[j] == i
                    and j not in pages.shared):
                e.owner = (pages, j, pages.ring[j])
        pages.cached = n

    def computed_blocks(self, pages: SeqPages, num_cached: int) -> int:
        """Blocks of `pages` whose tokens are all among the first `num_cached`: `register` indexes
        those past `pages.cached`."""
        return min(num_cached // self.page_size, len(pages.global_pages))

    def wrapping(self, pages: SeqPages, num_cached: int, end: int):
        """(block, ring entry) for each block that writing [num_cached, end) starts in an entry
        still holding an older block: `wrap` readies those entries."""
        ps = self.page_size
        for b in range(num_cached // ps, -(-end // ps)):
            j = b % self.ring_pages
            if j < len(pages.ring) and pages.ring_block[j] < b:
                yield b, j

    def wrap(self, pages: SeqPages, num_cached: int, end: int) -> None:
        """The ring part of engine.memory.kv.KVPool.prepare: where writing [num_cached, end) wraps onto
        a shared entry, or onto one holding a block to keep, the entry gets another page."""
        for b, j in self.wrapping(pages, num_cached, end):  # each entry's block set before the next
            if j in pages.shared:
                pages.shared.discard(j)
                new = pages.spare.pop()
            else:
                new = self.keep_local(pages, j, num_cached)
            if new is not None:
                pages.reading[j], pages.ring[j] = pages.ring[j], new
            pages.ring_block[j] = b

    def keep_local(self, pages: SeqPages, j: int, num_cached: int, fresh: bool = True) -> int | None:
        """Make ring entry j's page the local page of the block it holds, when that block is
        computed and cached without one. With `fresh`, only if a fresh page for the entry can be
        had: that page is returned (the caller swaps it in), else None and nothing changes."""
        b = pages.ring_block[j]
        if j in pages.shared or (b + 1) * self.page_size > num_cached or b >= pages.cached:
            return None
        e = self.entries.get(pages.keys[b])
        if e is None or e.local_page is not None:
            return None
        new = self.l.alloc(1) if fresh else [0]
        if new is None:
            return None
        self._attach(e, pages.ring[j], pages.keys[b])
        return new[0]

    def _evict_global(self, page: int) -> None:
        e = self.entries.pop(self._by_global.pop(page))
        if e.local_page is not None:
            del self._by_local[e.local_page]
            self.l.unkeep(e.local_page)

    def _evict_local(self, page: int) -> None:
        self.entries[self._by_local.pop(page)].local_page = None

    def drop_unheld(self) -> dict:
        """Evict every cached page no sequence holds (the admin's prefix-cache reset): the
        entries of their blocks go, the blocks running sequences hold stay. What went:
        {"enabled", "dropped_blocks" (entries forgotten), "freed_pages" (of both pools)}."""
        blocks, pages = len(self.entries), self.g.num_cached + self.l.num_cached
        self.g.evict_cached()  # each entry evicted frees its cached local page too (`_evict_global`)
        self.l.evict_cached()  # then the local pages of blocks whose global page is held
        return {"enabled": True, "dropped_blocks": blocks - len(self.entries), "freed_pages": pages}

    def clear(self) -> None:
        """Forget every entry (the allocators are cleared by their owner)."""
        self.entries.clear()
        self._by_global.clear()
        self._by_local.clear()

    def status(self) -> dict:
        q = self.query_tokens
        return {"enabled": True, "hit_tokens": self.hit_tokens, "query_tokens": q,
                "hit_rate": round(self.hit_tokens / q, 4) if q else 0.0, "blocks": len(self.entries),
                "cached_pages": self.g.num_cached + self.l.num_cached}


class SeenPrefixes:
    """Prefix hits without pages, for engine/fake.py: which block keys were seen (the newest
    `limit`), so a fake engine reports the hits a real one would have with room to spare."""

    def __init__(self, page_size: int, limit: int = 1 << 16):
        self.page_size, self.limit = page_size, limit
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self.step = {"prefix_hit_tokens": 0, "prefix_query_tokens": 0}
        """This step's counts (StepStats fields); `take` hands them over and starts again."""
        self.total = {"hit_tokens": 0, "query_tokens": 0}

    def admit(self, tokens, tenant: str = "") -> int:
        """Hit tokens of a prompt (as PrefixCache.lookup would count them); remembers its blocks.

        >>> seen = SeenPrefixes(2)
        >>> seen.admit([1, 2, 3, 4, 5]), seen.admit([1, 2, 3, 4, 9]), seen.admit([1, 2, 3])
        (0, 4, 2)
        """
        keys: list[bytes] = []
        extend_keys(keys, root_key(tenant), tokens, self.page_size, (len(tokens) - 1) // self.page_size)
        hit = next((i for i, k in enumerate(keys) if k not in self._seen), len(keys)) * self.page_size
        for k in keys:
            self._seen[k] = None
            self._seen.move_to_end(k)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        for d, key in ((self.step, "prefix_"), (self.total, "")):
            d[key + "hit_tokens"] += hit
            d[key + "query_tokens"] += len(tokens)
        return hit

    def drop(self, held=()) -> int:
        """Forget every block but those of `held` ((tokens, tenant) of the running requests), as
        PrefixCache.drop_unheld; how many went.

        >>> seen = SeenPrefixes(2)
        >>> _ = seen.admit([1, 2, 3, 4, 5]), seen.admit([7, 8, 9])
        >>> seen.drop(held=[([7, 8, 9], "")]), seen.admit([1, 2, 3]), seen.admit([7, 8, 9])
        (2, 0, 2)
        """
        keep: set[bytes] = set()
        for tokens, tenant in held:
            keys: list[bytes] = []
            extend_keys(keys, root_key(tenant), tokens, self.page_size, (len(tokens) - 1) // self.page_size)
            keep.update(keys)
        before = len(self._seen)
        self._seen = OrderedDict((k, None) for k in self._seen if k in keep)
        return before - len(self._seen)

    def take(self) -> dict[str, int]:
        out, self.step = self.step, {"prefix_hit_tokens": 0, "prefix_query_tokens": 0}
        return out

    def status(self) -> dict:
        q = self.total["query_tokens"]
        return {"enabled": True, **self.total,
                "hit_rate": round(self.total["hit_tokens"] / q, 4) if q else 0.0}
