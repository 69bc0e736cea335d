"""Byte arithmetic of weights and paged KV, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest

from engine.config import GEMMA3_27B, GEMMA3_270M
from engine.memory.sizes import (
    MiB,
    format_bytes,
    kv_bytes_per_token,
    naive_sequence_bytes,
    pages_per_sequence,
    ring_pages,
    sequence_bytes,
    size_pool,
    split_pool,
    weight_bytes,
)
from tests.engine.tiny import tiny_config

# gemma3-270m, bfloat16 KV, page 16, depth 8, context 8192, by hand:
SEQ_270M = 512 * 16 * 3072 + 33 * 16 * 15360  # 512 global pages + a 33-page ring
NAIVE_270M = 8192 * (3072 + 15360)


def test_kv_bytes_per_token_by_hand():
    # global: 2 (K,V) x 3 layers x 1 head x 256 x 2 B; local: same with 15 layers
    assert kv_bytes_per_token(GEMMA3_270M, "bfloat16") == (3072, 15360)
    assert kv_bytes_per_token(GEMMA3_270M, "float32") == (6144, 30720)
    # 27B: 2 x 10 x 16 x 128 x 2 and 2 x 52 x 16 x 128 x 2
    assert kv_bytes_per_token(GEMMA3_27B, "bfloat16") == (81920, 425984)
    with pytest.raises(ValueError, match="'fp8'.*bfloat16"):
        kv_bytes_per_token(GEMMA3_270M, "fp8")


def test_weight_bytes_per_dtype():
    assert weight_bytes(1000, "float32") == 4000
    assert weight_bytes(1000, "bfloat16") == 2000
    assert weight_bytes(1000, "int8") == 1063  # 1 B + 2/32 B of scale each, rounded up
    assert weight_bytes(1000, "int4") == 563  # 0.5 B + 2/32 B
    assert weight_bytes(GEMMA3_27B.param_count(), "bfloat16") == 2 * 27_009_002_240
    with pytest.raises(ValueError, match="'int3'.*int4"):
        weight_bytes(1000, "int3")


def test_pages_and_sequence_bytes_by_hand():
    assert ring_pages(GEMMA3_270M, 16, 8) == 33  # ceil((512 + 8) / 16)
    assert ring_pages(GEMMA3_27B, 16, 8) == 65  # ceil((1024 + 8) / 16)
    assert pages_per_sequence(GEMMA3_270M, 8192, 16, 8) == (512, 33)
    assert pages_per_sequence(GEMMA3_270M, 100, 16, 8) == (7, 7)  # shorter than the window
    assert sequence_bytes(GEMMA3_270M, 8192, 16, "bfloat16", 8) == SEQ_270M == 33_275_904
    assert naive_sequence_bytes(GEMMA3_270M, 8192, "bfloat16") == NAIVE_270M == 144 * MiB
    with pytest.raises(ValueError, match="page_size=0"):
        sequence_bytes(GEMMA3_270M, 8192, 0, "bfloat16", 8)
    with pytest.raises(ValueError, match="context_len=-1"):
        sequence_bytes(GEMMA3_270M, -1, 16, "bfloat16", 8)


def test_size_pool_tenants_formula_and_remainder_to_global():
    pool = 10 * SEQ_270M + 12_345
    sizes = size_pool(GEMMA3_270M, pool, 16, "bfloat16", 8192, 8)
    assert sizes.tenants == 10
    assert (sizes.global_page_bytes, sizes.local_page_bytes) == (49152, 245760)
    assert sizes.ring_pages == 33
    assert sizes.num_local_pages == 10 * 33
    assert sizes.num_global_pages == (pool - 330 * 245760) // 49152  # 5120 + the remainder
    assert sizes.num_global_pages >= 10 * 512
    assert 0 <= pool - sizes.total_bytes < sizes.global_page_bytes
    assert size_pool(GEMMA3_270M, pool - 12_346, 16, "bfloat16", 8192, 8).tenants == 9


def test_size_pool_split_is_best_among_all_splits():
    cfg = tiny_config()  # global and local layers, window 8
    pool, page, ctx, depth = 200_000, 4, 40, 2
    sizes = size_pool(cfg, pool, page, "float32", ctx, depth)
    g, l = pages_per_sequence(cfg, ctx, page, depth)
    best = 0
    for n_local in range(pool // sizes.local_page_bytes + 1):
        n_global = (pool - n_local * sizes.local_page_bytes) // sizes.global_page_bytes
        best = max(best, min(n_global // g, n_local // l))
    assert sizes.tenants == best > 0


def test_size_pool_without_global_or_local_layers():
    no_global = tiny_config(global_every=100)
    sizes = size_pool(no_global, 100_000, 4, "float32", 40, 2)
    assert (sizes.num_global_pages, sizes.global_page_bytes) == (0, 0)
    seq = sequence_bytes(no_global, 40, 4, "float32", 2)
    assert sizes.tenants == 100_000 // seq
    assert sizes.num_local_pages == 100_000 // sizes.local_page_bytes  # remainder to local

    no_local = tiny_config(global_every=1)
    sizes = size_pool(no_local, 100_000, 4, "float32", 40, 2)
    assert (sizes.num_local_pages, sizes.local_page_bytes) == (0, 0)
    assert sizes.tenants == 100_000 // (10 * sizes.global_page_bytes)
    assert sizes.num_global_pages == 100_000 // sizes.global_page_bytes


def test_size_pool_refuses_a_pool_holding_no_sequence():
    with pytest.raises(ValueError, match=f"pool_bytes={SEQ_270M - 1}"):
        size_pool(GEMMA3_270M, SEQ_270M - 1, 16, "bfloat16", 8192, 8)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(3072) == "3.00 KiB"
    assert format_bytes(12) == "12 B"


def test_split_pool_by_hand():
    """gemma3-270m at 8192 tokens, 2 GiB: 64 tenants; a 0.25 split lends int(pages x 0.25) of each
    pool. A 4-layer draft has no global layer (rings only); an 8-layer one needs global pages too."""
    sizes = size_pool(GEMMA3_270M, 2 << 30, 16, "bfloat16", 8192, 8)
    assert sizes.tenants == 64 and sizes.num_local_pages == 64 * 33
    s = split_pool(GEMMA3_270M, sizes, 0.25, 8192, 16, 8, 4)
    assert (s.lent_global_pages, s.lent_local_pages) == (sizes.num_global_pages // 4, 64 * 33 // 4)
    assert s.lent_bytes == s.lent_global_pages * 16 * 3072 + s.lent_local_pages * 16 * 15360
    assert s.lent_bytes + s.tenant_bytes == sizes.total_bytes
    assert (s.tenants_unsplit, s.tenants, s.tenants_displaced) == (64, 48, 16)
    assert s.draft_sequences == 528 // 33  # local rings only
    deep = split_pool(GEMMA3_270M, sizes, 0.25, 8192, 16, 8, 8)  # layer 5 is global
    assert deep.draft_sequences == min(sizes.num_global_pages // 4 // 512, 16)
    assert split_pool(GEMMA3_270M, sizes, 0.0, 8192, 16, 8, 4).draft_sequences == 0
    with pytest.raises(ValueError, match="pool split"):
        split_pool(GEMMA3_270M, sizes, 1.0, 8192, 16, 8, 4)
