"""Byte arithmetic of weights and paged KV caches (stdlib only; nothing touches a device).

The planner (engine/memory/planner.py), the per-technique costs (engine/memory/spec_memory.py)
and the loader's pool sizing all count bytes with these functions.

The KV layout counted (engine/memory/kv.py): a *global* pool for the global layers
and a *local* pool for the sliding-window layers. A page holds `page_size`
tokens of K and V for every layer of its kind. A sequence of n tokens holds
ceil(n / page_size) global pages and min(ceil(n / page_size), ring_pages) local
pages, ring_pages = ceil((sliding_window + max_spec_depth) / page_size).

Worked example (gemma3-270m: 3 global + 15 local layers, 1 KV head of 256,
bfloat16 KV, page_size 16, context 8192, max_spec_depth 8):
    KV per token: global 2 x 3 x 1 x 256 x 2 B = 3072 B, local 2 x 15 x 256 x 2 = 15360 B
    one sequence: 512 global pages x 48 KiB + 33 ring pages x 240 KiB = 31.73 MiB
    naive cache:  8192 tokens x 18 KiB (every layer, every token)      = 144 MiB
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from engine.config import ModelConfig

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

QUANT_BLOCK = 32
"""int8/int4 weights carry one bfloat16 scale per block of this many weights."""
WEIGHT_BITS: dict[str, Fraction] = {
    "float32": Fraction(32),
    "bfloat16": Fraction(16),
    "int8": Fraction(8) + Fraction(16, QUANT_BLOCK),
    "int4": Fraction(4) + Fraction(16, QUANT_BLOCK),
}
"""Bits per weight, block scales included (int8 = 8.5, int4 = 4.5)."""
KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
"""Bytes per K or V element in a page (the engine's page layout has no scales)."""
SERVED_BLOCKS: dict[str, tuple[int, int, int]] = {"Q8_0": (8, 32, 2), "Q5_0": (5, 32, 2), "Q6_K": (8, 16, 4),
                                                   "Q4_K": (4, 32, 8)}
"""(bits, group, scale bytes) engine/quant/formats.py holds each GGUF block type in: bits a value,
and per group of values a scale (float16 for Q8_0 and Q5_0, the file's own; float32 for Q6_K)
or a float32 scale and min (Q4_K)."""


def served_bytes(tensors, form: str) -> int:
    """Bytes of a GGUF's tensors, (numpy shape, ggml type name) each, as the engine holds them
    served as `form` (engine/model/quant_weights.py): "gguf" keeps the block types above and
    widens the rest to float32, "int8" stores each matrix as int8 with a float32 scale per
    output row of the file (norms float32), "float32"/"bfloat16" every tensor in that dtype.

    >>> served_bytes([((16, 64), "Q4_K"), ((64,), "F32")], "gguf"), served_bytes([((16, 64), "Q5_0")], "gguf")
    (1024, 704)
    >>> served_bytes([((16, 64), "Q8_0")], "gguf"), served_bytes([((16, 64), "Q8_0")], "int8")
    (1088, 1088)
    """
    total = 0
    for shape, qtype in tensors:
        n = math.prod(shape)
        if form in ("float32", "bfloat16"):
            total += n * (4 if form == "float32" else 2)
        elif len(shape) == 1:
            total += 4 * n
        elif form == "int8":
            total += n + 4 * shape[0]
        elif qtype in SERVED_BLOCKS:
            bits, group, scale_bytes = SERVED_BLOCKS[qtype]
            total += n * bits // 8 + (n // group) * scale_bytes
        else:
            total += 4 * n
    return total


def weight_bytes(params: int, dtype: str) -> int:
    """Bytes of `params` weights in `dtype`, block scales included (int4: 4.5 bits each).

    >>> weight_bytes(1000, "int4"), weight_bytes(1000, "bfloat16")
    (563, 2000)
    """
    if dtype not in WEIGHT_BITS:
        raise ValueError(f"unknown weight dtype {dtype!r} (choose {', '.join(WEIGHT_BITS)})")
    return math.ceil(params * WEIGHT_BITS[dtype] / 8)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> tuple[int, int]:
    """(global, local) whole-model K+V bytes per token.

    >>> from engine.config import GEMMA3_270M
    >>> kv_bytes_per_token(GEMMA3_270M, "bfloat16")
    (3072, 15360)
    """
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose {', '.join(KV_DTYPE_BYTES)})")
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim * KV_DTYPE_BYTES[kv_dtype]
    return len(cfg.global_layers) * per_layer, len(cfg.local_layers) * per_layer


def ring_pages(cfg: ModelConfig, page_size: int, max_spec_depth: int) -> int:
    """Local pages a sequence cycles through: ceil((sliding_window + max_spec_depth) / page_size)."""
    return -(-(cfg.sliding_window + max_spec_depth) // page_size)


def pages_per_sequence(
    cfg: ModelConfig, n: int, page_size: int, max_spec_depth: int,
) -> tuple[int, int]:
    """(global, local) pages a sequence of n tokens holds; 0 for a kind without layers."""
    pages = -(-n // page_size)
    local = min(pages, ring_pages(cfg, page_size, max_spec_depth))
    return (pages if cfg.global_layers else 0), (local if cfg.local_layers else 0)


@dataclass(frozen=True)
class PoolSizes:
    """How the KV pool splits into global and local pages."""

    num_global_pages: int
    """Pages in the global pool (the tenants' share plus the remainder)."""
    num_local_pages: int
    """Pages in the local pool: exactly tenants x local pages per tenant."""
    ring_pages: int
    """Local pages one sequence cycles through (window + verify slots)."""
    global_page_bytes: int
    """Bytes of one global page (0 without global layers)."""
    local_page_bytes: int
    """Bytes of one local page (0 without local layers)."""
    tenants: int
    """Sequences of context_len tokens the pool holds at once."""

    @property
    def total_bytes(self) -> int:
        """Bytes the two pools occupy (at most the pool_bytes they were sized from)."""
        return (self.num_global_pages * self.global_page_bytes
                + self.num_local_pages * self.local_page_bytes)


def _check_shape(cfg: ModelConfig, page_size: int, context_len: int, max_spec_depth: int) -> None:
    if not cfg.n_layers:
        raise ValueError(f"{cfg.name} has n_layers=0: there is no KV to plan")
    if page_size <= 0:
        raise ValueError(f"page_size={page_size} must be positive")
    if context_len <= 0:
        raise ValueError(f"context_len={context_len} must be positive")
    if max_spec_depth < 0:
        raise ValueError(f"max_spec_depth={max_spec_depth} must be >= 0")


def sequence_bytes(
    cfg: ModelConfig, context_len: int, page_size: int, kv_dtype: str, max_spec_depth: int,
) -> int:
    """Paged, windowed KV bytes of one sequence of context_len tokens."""
    _check_shape(cfg, page_size, context_len, max_spec_depth)
    g_tok, l_tok = kv_bytes_per_token(cfg, kv_dtype)
    g, l = pages_per_sequence(cfg, context_len, page_size, max_spec_depth)
    return page_size * (g * g_tok + l * l_tok)


def naive_sequence_bytes(cfg: ModelConfig, context_len: int, kv_dtype: str) -> int:
    """KV bytes of one sequence in a contiguous cache: every token, every layer."""
    return context_len * sum(kv_bytes_per_token(cfg, kv_dtype))


def size_pool(
    cfg: ModelConfig, pool_bytes: int, page_size: int, kv_dtype: str, context_len: int,
    max_spec_depth: int,
) -> PoolSizes:
    """Split pool_bytes to hold the most sequences of context_len tokens.

    tenants = pool_bytes // one sequence's bytes; the local pool gets exactly
    the tenants' ring pages, the remainder goes to global pages (to local
    pages when the model has no global layers). Raises ValueError when the
    pool holds no sequence at all.
    """
    seq = sequence_bytes(cfg, context_len, page_size, kv_dtype, max_spec_depth)
    if pool_bytes < seq:
        raise ValueError(f"pool_bytes={pool_bytes} holds no sequence of "
                         f"context_len={context_len} ({seq} bytes each)")
    g_tok, l_tok = kv_bytes_per_token(cfg, kv_dtype)
    g_page, l_page = g_tok * page_size, l_tok * page_size
    _, l = pages_per_sequence(cfg, context_len, page_size, max_spec_depth)
    tenants = pool_bytes // seq
    num_local = tenants * l
    if g_page:
        num_global = (pool_bytes - num_local * l_page) // g_page
    else:  # no global layers: the remainder buys extra ring pages
        num_global, num_local = 0, pool_bytes // l_page
    return PoolSizes(num_global, num_local, ring_pages(cfg, page_size, max_spec_depth),
                     g_page, l_page, tenants)


@dataclass(frozen=True)
class PoolSplit:
    """A pool split: `share` of each pool's pages lent to speculation (engine/memory/kv.KVPool.set_split).

    The truncated-layer draft model keeps its KV in the lent pages: each of its
    pages is a whole page of the target's pool (it writes its own layers only).
    """

    share: float
    """Share of each pool's pages withheld from tenants."""
    lent_global_pages: int
    """Global pages lent (int(global pages x share), as the engine rounds)."""
    lent_local_pages: int
    """Local pages lent."""
    lent_bytes: int
    """Bytes of the lent pages."""
    tenant_bytes: int
    """Bytes of the pages left to tenants."""
    tenants: int
    """Sequences of context_len the tenants' pages hold at once."""
    tenants_unsplit: int
    """The same with nothing lent."""
    draft_sequences: int
    """Sequences of context_len whose draft-model KV the lent pages hold."""

    @property
    def tenants_displaced(self) -> int:
        return self.tenants_unsplit - self.tenants


def _fit(pages: tuple[int, int], need: tuple[int, int]) -> int:
    """Sequences needing `need` (global, local) pages that `pages` hold."""
    return min((p // n for p, n in zip(pages, need) if n), default=0)


def split_pool(cfg: ModelConfig, sizes: PoolSizes, share: float, context_len: int, page_size: int,
               max_spec_depth: int, draft_layers: int) -> PoolSplit:
    """Lend `share` of each pool to speculation; what tenants keep and what the draft model
    (the first `draft_layers` layers) can hold, at context_len.

    >>> from engine.config import GEMMA3_270M
    >>> sizes = size_pool(GEMMA3_270M, 2 << 30, 16, "bfloat16", 8192, 8)
    >>> s = split_pool(GEMMA3_270M, sizes, 0.25, 8192, 16, 8, 4)
    >>> s.tenants_unsplit, s.tenants, s.draft_sequences  # the 4-layer draft: local pages only
    (64, 48, 16)
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"pool split {share} must be in [0, 1)")
    lent = (int(sizes.num_global_pages * share), int(sizes.num_local_pages * share))
    left = (sizes.num_global_pages - lent[0], sizes.num_local_pages - lent[1])
    need = pages_per_sequence(cfg, context_len, page_size, max_spec_depth)
    draft = pages_per_sequence(cfg.replace(n_layers=min(draft_layers, cfg.n_layers)), context_len, page_size,
                               max_spec_depth)
    bytes_of = lambda g, l: g * sizes.global_page_bytes + l * sizes.local_page_bytes
    return PoolSplit(share, *lent, bytes_of(*lent), bytes_of(*left), _fit(left, need),
                     _fit((sizes.num_global_pages, sizes.num_local_pages), need), _fit(lent, draft))


def format_bytes(n: float) -> str:
    """Binary units, two decimals.

    >>> format_bytes(3 * 2**29), format_bytes(12)
    ('1.50 GiB', '12 B')
    """
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
