"""Host-side page bookkeeping: the allocator of one pool's page ids and the pages one sequence
holds, on the host only (no device array); engine.memory.kv.KVPool owns one allocator per
pool and engine.memory.prefix_cache indexes the pages they hand out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class PageAllocator:
    """Hands out page ids of one pool with reference counts; page 0 is reserved scratch.

    A page the prefix cache indexes (`keep`) goes, when its last holder frees it,
    to an LRU list of cached pages instead of the free list: still findable by a
    later hit (`share`), and counted as free, since `alloc` evicts the least
    recently freed of them (telling the cache, `on_evict`) once no page is free.

    >>> a = PageAllocator(4)  # pages 1..3
    >>> p, q = a.alloc(2); a.keep(p); a.free([p, q]); a.num_free, a.num_cached
    (3, 1)
    >>> a.share(p); a.num_used, a.num_free
    (1, 2)
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.reserved = 0
        """Pages lent to speculation (the policy's pool split): never handed to tenants."""
        self.on_evict = lambda page: None
        """Called with a cached page `alloc` takes back (engine.memory.prefix_cache drops its entry)."""
        self.clear()

    def clear(self) -> None:
        """Every page free, nothing cached or held."""
        self._free = list(range(self.num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # page -> holders
        self._cached: OrderedDict[int, None] = OrderedDict()  # kept pages nobody holds, LRU first
        self._kept: set[int] = set()
        self.lent: set[int] = set()  # held pages taken from the reservation (`alloc(lend=True)`)

    @property
    def num_free(self) -> int:
        """Pages a tenant can still get, cached ones included (0 while usage exceeds a grown
        reservation)."""
        return max(0, len(self._free) + len(self._cached) - max(0, self.reserved - len(self.lent)))

    @property
    def capacity(self) -> int:
        """Pages that can be handed out to tenants (all but scratch and the reservation)."""
        return self.num_pages - 1 - self.reserved

    @property
    def num_used(self) -> int:
        """Pages some tenant sequence holds (a shared page counts once; lent ones do not count)."""
        return len(self._refs) - len(self.lent)

    @property
    def num_cached(self) -> int:
        """Pages nobody holds that keep a cached prefix block (reclaimable)."""
        return len(self._cached)

    def alloc(self, n: int, lend: bool = False) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free; `lend`: from the reservation
        (the draft model's share of the pool split), never kept by the prefix cache."""
        room = min(self.reserved - len(self.lent),
                   len(self._free) + len(self._cached)) if lend else self.num_free
        if n > room:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page = self._cached.popitem(last=False)[0]
                self._kept.discard(page)
                self.on_evict(page)
            self._refs[page] = 1
            out.append(page)
        self.lent.update(out if lend else ())
        return out

    def share(self, page: int) -> None:
        """One more holder of `page` (a held or cached page)."""
        if self._cached.pop(page, False) is None:
            self._refs[page] = 1
        else:
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one hold of each page; a page nobody holds is free, or cached if kept."""
        for page in pages:
            if self._refs[page] > 1:
                self._refs[page] -= 1
                continue
            del self._refs[page]
            self.lent.discard(page)
            if page in self._kept:
                self._cached[page] = None
            else:
                self._free.append(page)

    def keep(self, page: int) -> None:
        """The prefix cache indexes `page`: once nobody holds it, it stays cached."""
        self._kept.add(page)

    def unkeep(self, page: int) -> None:
        self._kept.discard(page)
        if self._cached.pop(page, False) is None:
            self._free.append(page)

    def evict_cached(self) -> int:
        """Every cached page to the free list, telling the cache (`on_evict`); how many (held ones stay)."""
        n = len(self._cached)
        while self._cached:
            page = self._cached.popitem(last=False)[0]
            self._kept.discard(page)
            self._free.append(page)
            self.on_evict(page)
        return n


@dataclass
class SeqPages:
    """The pages one sequence holds (host side)."""

    global_pages: list[int]
    ring: list[int]  # ring entries allocated so far (grows to ring_pages, then wraps): pages written to
    ring_block: list[int] = field(default_factory=list)
    """The block each ring entry holds (or was last made ready for)."""
    reading: dict[int, int] = field(default_factory=dict)
    """Ring entry -> the page a wrap replaced, still read until the entry's new block has a cached token."""
    shared: set[int] = field(default_factory=set)
    """Ring entries holding a local page borrowed from the prefix cache (never written)."""
    spare: list[int] = field(default_factory=list)
    """Local pages held for replacing shared entries when the ring wraps onto them."""
    keys: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of the leading full blocks (engine.memory.prefix_cache; kept across preemption)."""
    root: bytes = b""
    cached: int = 0
    """Leading blocks the prefix cache has (hit or registered)."""
