"""Quantized weights through the engine: the tiny model's matrices as int8 QuantWeights give the
same greedy tokens as a float32 engine holding exactly their dequantized numbers, plainly and
under every speculation technique (its shapes compiled on use: warming every bucket up costs
minutes here, and warmup's own tests cover that path)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.memory.budget import heads_resident_bytes
from engine.model.quant_weights import dequantize_params, quantize_params, weight_bytes
from engine.policy import BatchRule, TunedPolicy
from engine.quant.formats import PANEL, QuantWeight, dequantize, select_columns
from engine.quant.matmul import kernel_available, kernel_status
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.types import SamplingParams
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.engine.conftest import SPEC_RC, make_engine, run_prompts
from tests.engine.test_quant import on_device, random_int4, random_int5, random_int8

pytestmark = pytest.mark.skipif(not kernel_available(),
                                reason=f"no quantized-matmul kernel: {kernel_status()}")
SP = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny):
    """(config, int8 params, float32 params with the same numbers)."""
    cfg, params = tiny
    q = quantize_params(params)
    return cfg, q, dequantize_params(q)


@pytest.fixture(scope="module")
def float_greedy(pair):
    cfg, _, f = pair
    return run_prompts(make_engine((cfg, f)), PROMPTS, SP)[0]


def test_params_hold_quantized_weights(pair, tiny):
    cfg, q, f = pair
    layer = q["layers"][0]
    assert isinstance(q["embed"], QuantWeight) and q["embed"].shape == (cfg.d_model, cfg.vocab_size)
    assert all(isinstance(layer[k], QuantWeight) for k in ("qkv", "o", "gate_up", "down"))
    assert f["embed"].shape == (cfg.vocab_size, cfg.d_model)
    assert weight_bytes(q) < 0.3 * weight_bytes(tiny[1])  # int8 and a scale per column, vs float32


def test_quantized_greedy_equals_float32_on_the_same_numbers(pair, float_greedy):
    cfg, q, _ = pair
    e = make_engine((cfg, q))
    assert isinstance(e.runner.params["layers"][3]["down"], QuantWeight)
    assert run_prompts(e, PROMPTS, SP)[0] == float_greedy


@pytest.fixture(scope="module")
def spec_engine(pair):
    """The int8 engine with every proposer (MTP also over the whole quantized table)."""
    cfg, q, _ = pair
    e = make_engine((cfg, q), **SPEC_RC)
    heads = DraftHeads.random(cfg, 8, (3, 6), 128, seed=1, scale=0.3)
    add_model_proposers(e, heads, vocab_sizes=(0, 128))
    return e


@pytest.mark.parametrize("technique", ["ngram", "mtp", "early_exit", "draft"])
def test_quantized_speculation_equals_float32_plain(spec_engine, float_greedy, technique):
    e = spec_engine
    e.set_policy(TunedPolicy(rules=(BatchRule(64, technique, 3),), crossover=64, pool_split=0.2, version=1))
    got, stats = run_prompts(e, PROMPTS, SP)
    assert got == float_greedy
    assert sum(s.proposed for s in stats if s.technique == technique) > 0
    assert e.pool.used == 0


def test_selected_columns_keep_the_form_and_values():
    rng = np.random.default_rng(3)
    ids = rng.permutation(64)[:32]
    for w in (random_int8(rng, 64, 64, 32, np.float16), random_int4(rng, 64, 64), random_int5(rng, 64, 64)):
        got = select_columns(on_device(w), ids)
        assert got.shape == (64, 32) and got.bits == w.bits and got.values.shape[0] == 32 // PANEL
        assert np.array_equal(dequantize(got), np.asarray(dequantize(w))[:, ids])
    with pytest.raises(ValueError, match="multiple of 16"):
        select_columns(on_device(random_int8(rng, 64, 64, 32)), ids[:20])


def test_draft_vocabulary_slices_of_a_quantized_table_stay_quantized(spec_engine, pair):
    """The MTP drafter's restricted vocabulary is the table's own int8 columns, not float rows."""
    cfg, q, _ = pair
    mtp = spec_engine.proposers["mtp"]
    emb, ids = mtp.slices.get(128)
    assert isinstance(emb, QuantWeight) and emb.shape == (cfg.d_model, 128)
    assert np.array_equal(dequantize(emb), np.asarray(dequantize(q["embed"]))[:, np.asarray(ids)])
    assert mtp.slices.nbytes() < 0.4 * (128 * cfg.d_model * 4)  # int8 and scales, vs float32 rows
    heads = DraftHeads.random(cfg, 8, (3, 6), 128, seed=1, scale=0.3)  # spec_engine's
    planned = heads_resident_bytes(heads, cfg, ("mtp", "early_exit", "draft"), (0, 128), q["embed"])
    assert planned == sum(p.resident_bytes() for p in spec_engine.proposers.values())
