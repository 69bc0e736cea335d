"""Memory planner: devices, model names and plans, checked against numbers worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.config import GEMMA3_12B, GEMMA3_27B, GEMMA3_270M
from engine.memory.planner import MoEConfig, device_profile, make_plan, model_by_name, parse_moe
from engine.memory.sizes import GiB, MiB, kv_bytes_per_token, weight_bytes
from tests.engine.test_memory import NAIVE_270M, SEQ_270M

TPU = device_profile("tpu-v6e-1")


def test_devices():
    assert TPU.usable_bytes == int(28.7 * GiB)
    assert device_profile("cpu").usable_bytes == 8 * GiB
    assert device_profile("cpu", 512 * MiB).usable_bytes == 512 * MiB
    assert device_profile("h200").usable_bytes == 135 * GiB
    assert device_profile("tpu-v6e-1", 4 * GiB).usable_bytes == 4 * GiB
    with pytest.raises(ValueError, match="exceeds"):
        device_profile("tpu-v6e-1", 40 * GiB)
    with pytest.raises(ValueError, match="'tpu-v4'.*h200"):
        device_profile("tpu-v4")


def test_270m_window_advantage_and_tenants_by_hand():
    plan = make_plan(GEMMA3_270M, TPU, "bfloat16", "bfloat16", 8192)
    pool = TPU.usable_bytes - plan.weight_bytes - plan.activation_reserve_bytes
    assert plan.weight_bytes == 2 * GEMMA3_270M.param_count()
    assert plan.activation_reserve_bytes == GiB + 64 * 9 * 262_144 * 4 * 2
    assert plan.pool_bytes == pool
    assert plan.tenants == plan.pools.tenants == pool // SEQ_270M
    assert plan.naive_tenants == pool // NAIVE_270M
    assert plan.tenants > 4 * plan.naive_tenants
    assert plan.tenant_ratio == pytest.approx(plan.tenants / plan.naive_tenants)
    assert plan.fits and plan.shortfall_bytes == 0 and "fits" in plan.verdict
    assert set(plan.weight_bytes_by_dtype) == {"float32", "bfloat16", "int8", "int4"}
    assert any("activation reserve" in note for note in plan.notes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tenants = 0  # type: ignore[misc]


def test_27b_bfloat16_does_not_fit_on_tpu_v6e_1():
    plan = make_plan(GEMMA3_27B, TPU, "bfloat16", "bfloat16", 8192)
    assert plan.weight_bytes == 54_018_004_480  # 27.0e9 x 2 B = 50.31 GiB
    assert not plan.fits
    assert plan.shortfall_bytes == plan.weight_bytes - TPU.usable_bytes
    assert (plan.tenants, plan.pool_bytes, plan.pools) == (0, 0, None)
    for number in ("50.31 GiB", "28.70 GiB", "21.61 GiB"):
        assert number in plan.verdict


def test_27b_int4_fits_on_tpu_v6e_1():
    plan = make_plan(GEMMA3_27B, TPU, "int4", "bfloat16", 8192)
    assert plan.weight_bytes == math.ceil(27_009_002_240 * 4.5 / 8)
    assert plan.fits and plan.tenants >= 1
    assert plan.tenants > plan.naive_tenants


def test_reserve_and_pool_shortfalls_name_their_numbers():
    weights = 2 * GEMMA3_270M.param_count()
    cpu = device_profile("cpu", weights + GiB)  # weights fit, the 2.12 GiB reserve does not
    plan = make_plan(GEMMA3_270M, cpu, "bfloat16", "bfloat16", 8192)
    assert not plan.fits and "activation reserve 2.12 GiB" in plan.verdict
    cpu = device_profile("cpu", weights + GiB + SEQ_270M // 2)
    plan = make_plan(GEMMA3_270M, cpu, "bfloat16", "bfloat16", 8192, activation_reserve_bytes=GiB)
    assert not plan.fits and "KV pool" in plan.verdict
    assert plan.shortfall_bytes == SEQ_270M - SEQ_270M // 2


def test_speculation_displaces_tenants():
    base = make_plan(GEMMA3_270M, TPU, "bfloat16", "bfloat16", 8192)
    spec = make_plan(GEMMA3_270M, TPU, "bfloat16", "bfloat16", 8192,
                     speculation_bytes=3 * SEQ_270M)
    assert base.tenants_displaced == 0
    assert spec.tenants_displaced == 3 == base.tenants - spec.tenants
    assert spec.pool_bytes == base.pool_bytes - 3 * SEQ_270M


def test_moe_parsing_and_plan():
    moe = parse_moe("26B/4B")
    assert (moe.total_params, moe.active_params) == (26_000_000_000, 4_000_000_000)
    attn = moe.attention
    assert (attn.n_layers, attn.n_kv_heads, attn.head_dim) == (48, 8, 256)
    assert attn.sliding_window == GEMMA3_12B.sliding_window
    assert "gemma3-12b" in moe.attention_note
    assert parse_moe("26e9/4e9").total_params == 26_000_000_000
    assert parse_moe("1.5T/50b").active_params == 50_000_000_000
    small = parse_moe("26B/4B", n_layers=12, n_kv_heads=2, head_dim=128)
    assert kv_bytes_per_token(small.attention, "bfloat16") == (2 * 2 * 2 * 128 * 2,
                                                                2 * 10 * 2 * 128 * 2)
    assert isinstance(model_by_name("26B/4B"), MoEConfig)
    for bad in ("26B", "4B/26B", "abc/4B", "26X/4B", "0/0"):
        with pytest.raises(ValueError, match=bad if "/" in bad else "TOTAL/ACTIVE"):
            parse_moe(bad)
    plan = make_plan(moe, TPU, "int4", "bfloat16", 8192)
    assert plan.weight_bytes == weight_bytes(26_000_000_000, "int4")
    assert plan.active_params == 4_000_000_000
    assert plan.notes[0] == moe.attention_note


def test_model_by_name_errors_list_choices():
    assert model_by_name("gemma3-27b") is GEMMA3_27B
    with pytest.raises(ValueError, match="'gemma4'.*gemma3-270m.*26B/4B"):
        model_by_name("gemma4")
    with pytest.raises(ValueError, match="MoE"):
        model_by_name("gemma3-1b", n_layers=3)


def test_the_page_tables_span_the_maximum_context_rounded_up_to_a_page():
    """One page-table width holds every context (attention reads only the real pages)."""
    from engine.loader import VERIFY_TOKENS, runner_config

    for max_context in (50, 64, 100, 600, 1024, 4096):
        rc = runner_config(GEMMA3_270M, "float32", 2 << 30, 32, max_context, verify_tokens=VERIFY_TOKENS)
        assert (rc.max_context >= max_context and rc.max_context - max_context < 16
                and rc.max_context % 16 == 0)
        assert rc.max_chunk <= rc.ring_pages * rc.page_size and rc.spec_max_batch <= rc.max_batch


def test_a_split_lends_pages_and_a_technique_pays_from_the_same_budget():
    """One budget: a technique's resident bytes shrink the pool before it is sized (a larger MTP
    draft vocabulary costs tenants), and a 0.25 split lends a quarter of each pool's pages."""
    dev = device_profile("cpu", 8 * GiB)
    base = make_plan(GEMMA3_270M, dev, "bfloat16", "bfloat16", 4096)
    small = make_plan(GEMMA3_270M, dev, "bfloat16", "bfloat16", 4096, technique="mtp", mtp_vocabs=(8192,))
    large = make_plan(GEMMA3_270M, dev, "bfloat16", "bfloat16", 4096, technique="mtp",
                      mtp_vocabs=(8192, 32768))
    extra = 32768 * (640 * 2 + 4)  # the 32768-id slice: bfloat16 rows and int32 ids
    assert large.speculation_bytes - small.speculation_bytes == extra
    assert base.pool_bytes - small.pool_bytes == small.speculation_bytes
    assert base.tenants >= small.tenants > large.tenants
    assert base.split is not None and base.split.lent_bytes == 0 and base.split.draft_sequences == 0
    p = make_plan(GEMMA3_270M, dev, "bfloat16", "bfloat16", 4096, pool_split=0.25)
    sp, pools = p.split, p.pools
    assert (sp.lent_global_pages, sp.lent_local_pages) == (int(pools.num_global_pages * 0.25),
                                                           int(pools.num_local_pages * 0.25))
    assert sp.lent_bytes + sp.tenant_bytes == pools.total_bytes
    assert sp.tenants_unsplit == p.tenants and sp.tenants < p.tenants
    assert sp.tenants == (pools.num_local_pages - sp.lent_local_pages) // pools.ring_pages  # local pages bind
    # 4 local layers: rings only
    assert sp.draft_sequences == int(pools.num_local_pages * 0.25) // pools.ring_pages
    with pytest.raises(ValueError, match="unknown technique"):
        make_plan(GEMMA3_270M, dev, "bfloat16", "bfloat16", 4096, technique="medusa")


def test_served_quantized_weights_give_their_bytes_to_the_pool():
    cpu = device_profile("cpu")
    f32 = make_plan(GEMMA3_270M, cpu, "float32", "bfloat16", 4096)
    gguf = make_plan(GEMMA3_270M, cpu, "float32", "bfloat16", 4096, served=("gguf", 256_080_384))
    assert gguf.weight_dtype == "gguf" and gguf.weight_bytes == gguf.weight_bytes_by_dtype["gguf"]
    assert gguf.pool_bytes - f32.pool_bytes == f32.weight_bytes - 256_080_384
    assert gguf.tenants > f32.tenants
    assert gguf.float32_tenants == f32.tenants == f32.float32_tenants  # the gain: tenants - float32_tenants
    bf16 = make_plan(GEMMA3_270M, TPU, "bfloat16", "bfloat16", 8192)
    f32_tpu = make_plan(GEMMA3_270M, TPU, "float32", "bfloat16", 8192)
    assert bf16.float32_tenants == f32_tpu.tenants < bf16.tenants
    with pytest.raises(ValueError, match="one device"):
        make_plan(GEMMA3_270M, TPU, "float32", "bfloat16", 4096, tensor_parallel=2, served=("gguf", 1))


def test_a_quantized_tables_draft_slices_are_priced_in_its_form():
    """MTP's draft-vocabulary slices of a Q8_0 table hold 640 values and 20 float16 scales an
    entry (engine/speculation/layer_draft.py), not 640 float32 values."""
    cpu = device_profile("cpu")
    as_float = make_plan(GEMMA3_270M, cpu, "float32", "bfloat16", 4096, served=("gguf", 256_080_384))
    as_table = make_plan(GEMMA3_270M, cpu, "float32", "bfloat16", 4096, served=("gguf", 256_080_384, 680))
    cost = lambda plan: {c.technique: c.resident_bytes for c in plan.techniques}
    saved = {t: cost(as_float)[t] - cost(as_table)[t] for t in ("mtp", "early_exit", "draft")}
    assert saved == {"mtp": (8192 + 32768) * (640 * 4 - 680), "early_exit": 8192 * (640 * 4 - 680),
                     "draft": 8192 * (640 * 4 - 680)}
