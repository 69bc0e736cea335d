"""Quantized params from a GGUF (engine/model/quant_weights.py): the file's own blocks as
QuantWeights, float tensors as float, cached, and exactly the float32 loader's numbers."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from engine.memory.sizes import served_bytes
from engine.model import quant_weights
from engine.model.gguf_file import GGUFFile, WeightsError, default_gguf_path
from engine.model.quant_weights import (
    GGUF_CACHE,
    dequantize_params,
    load_gguf_quantized,
    load_weights,
    weight_bytes,
)
from engine.model.weights import load_gguf
from engine.model.weights_cache import cache_folder
from engine.quant.formats import QuantWeight
from tests.engine.test_weights import tiny_gguf, tmp_cache, write_tiny_gguf  # noqa: F401 (fixtures)

FIVE = ("q", "k", "v", "gate", "up")  # Q5_0 in `tiny_q5`


@pytest.fixture()
def tiny_q5(tmp_path, tmp_cache):  # noqa: F811
    """The tiny GGUF with q, k, v, gate and up as Q5_0 (the embedding Q8_0)."""
    path = tmp_path / "tiny-q5.gguf"
    return path, write_tiny_gguf(path, q5=FIVE)


def _same_numbers(quantized, stacked) -> None:
    """dequantize_params(quantized) equals the float32 loader's stacked params, leaf for leaf."""
    deq = dequantize_params(quantized)
    np.testing.assert_array_equal(np.asarray(deq["embed"]), np.asarray(stacked["embed"]))
    np.testing.assert_array_equal(np.asarray(deq["final_norm"]), np.asarray(stacked["final_norm"]))
    for i, lp in enumerate(deq["layers"]):
        lp = dict(lp)
        if "q" in lp:  # unfused: compare the stacked leaf's columns part by part
            lp["qkv"] = np.hstack([lp.pop("q"), lp.pop("k"), lp.pop("v")])
        if "gate" in lp:
            lp["gate_up"] = np.hstack([lp.pop("gate"), lp.pop("up")])
        assert set(lp) == set(stacked["layers"])
        for k, v in lp.items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(stacked["layers"][k][i]),
                                          err_msg=f"layer {i} {k}")


def test_tiny_gguf_blocks_stay_quantized_floats_stay_float(tiny_gguf):  # noqa: F811
    path, _ = tiny_gguf
    cfg, params = load_gguf_quantized(path, progress=False)
    lp = params["layers"][2]
    assert isinstance(params["embed"], QuantWeight) and params["embed"].shape == (cfg.d_model, cfg.vocab_size)
    assert isinstance(lp["q"], QuantWeight) and isinstance(lp["gate"], QuantWeight)  # Q8_0 in the file
    assert not isinstance(lp["k"], QuantWeight) and lp["down"].dtype == np.float32  # F32, F16: float
    assert "qkv" not in lp and "gate_up" not in lp  # blocks and floats do not fuse
    _same_numbers(params, load_gguf(path, progress=False)[1])


def test_tiny_gguf_second_load_maps_the_cache(tiny_gguf, monkeypatch):  # noqa: F811
    path, _ = tiny_gguf
    _, first = load_gguf_quantized(path, progress=False)
    folder = next(cache_folder("x", "gguf").parent.parent.glob(f"params-*/{GGUF_CACHE}"))
    assert (folder / "meta.json").is_file() and (folder / "embed.values.npy").is_file()
    monkeypatch.setattr(quant_weights, "gguf_leaves", lambda *a, **k: pytest.fail("unpacked again"))
    _, second = load_gguf_quantized(path, progress=False)
    np.testing.assert_array_equal(np.asarray(second["layers"][1]["q"].scales),
                                  np.asarray(first["layers"][1]["q"].scales))


def test_damaged_cache_is_rebuilt(tiny_gguf):  # noqa: F811
    path, _ = tiny_gguf
    load_gguf_quantized(path, progress=False)
    folder = next(cache_folder("x", "gguf").parent.parent.glob(f"params-*/{GGUF_CACHE}"))
    (folder / "layers.3.q.scales.npy").write_bytes(b"junk")
    _, params = load_gguf_quantized(path, progress=False)
    _same_numbers(params, load_gguf(path, progress=False)[1])


def test_tiny_q5_is_5bit_fused_cached_and_exact(tiny_q5, monkeypatch):
    """Q5_0 matrices load as 5-bit QuantWeights with the file's float16 scales; q|k|v and gate|up
    fuse; a second load maps the cached high-bit planes; the numbers are the float32 loader's."""
    path, _ = tiny_q5
    cfg, params = load_gguf_quantized(path, progress=False)
    lp = params["layers"][4]
    for leaf in (lp["qkv"], lp["gate_up"]):
        assert (leaf.bits, leaf.group, leaf.scales.dtype, leaf.high.dtype) == (5, 32, np.float16, np.uint8)
    assert lp["qkv"].shape == (cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim)
    assert lp["gate_up"].high.shape == (2 * cfg.ffn_dim // 16, cfg.d_model // 8, 16)
    assert (params["embed"].bits, params["embed"].scales.dtype) == (8, np.float16)
    _same_numbers(params, load_gguf(path, progress=False)[1])
    folder = next(cache_folder("x", "gguf").parent.parent.glob(f"params-*/{GGUF_CACHE}"))
    assert (folder / "layers.4.qkv.high.npy").is_file() and not list(folder.glob("*.mins.npy"))
    monkeypatch.setattr(quant_weights, "gguf_leaves", lambda *a, **k: pytest.fail("unpacked again"))
    _, second = load_gguf_quantized(path, progress=False)
    assert isinstance(second["layers"][4]["qkv"].high, jax.Array)
    _same_numbers(second, load_gguf(path, progress=False)[1])


def test_cache_of_an_older_layout_is_not_read(tiny_q5):
    """A folder of the layout before 5-bit values (named "gguf") is left alone, never read."""
    path, _ = tiny_q5
    load_gguf_quantized(path, progress=False)
    folder = next(cache_folder("x", "gguf").parent.parent.glob(f"params-*/{GGUF_CACHE}"))
    old = folder.with_name("gguf")
    old.mkdir()
    (old / "meta.json").write_text('{"embed": [1, 2, 3, 8]}')  # read, it would fail to load
    shutil.rmtree(folder)
    _, again = load_gguf_quantized(path, progress=False)
    assert GGUF_CACHE != "gguf" and folder.is_dir() and sorted(p.name for p in old.iterdir()) == ["meta.json"]
    _same_numbers(again, load_gguf(path, progress=False)[1])


def test_without_the_kernel_the_same_numbers_serve_as_float32(tiny_gguf, monkeypatch, capsys):  # noqa: F811
    path, _ = tiny_gguf
    monkeypatch.setattr(quant_weights, "kernel_available", lambda: False)
    _, params = load_weights(path, "gguf", progress=True)
    assert not isinstance(params["embed"], QuantWeight) and params["layers"]["qkv"].dtype == np.float32
    assert "serving its numbers as float32" in capsys.readouterr().err


def test_gguf_form_needs_a_gguf_file(tmp_path):
    with pytest.raises(WeightsError, match="needs a GGUF file"):
        load_weights(tmp_path, "gguf", progress=False)
    with pytest.raises(ValueError, match="weights must be one of"):
        load_weights(None, "int4", progress=False)


def test_real_file_is_served_in_its_own_blocks():
    """The default model: gate|up fuse as 5-bit groups of 32 (Q5_0); q|k|v too where attn_v is
    Q5_0, and stay apart (v int8) where it is Q8_0; o is 4-bit, down 4-bit in some layers and
    6-bit (int8 values, groups of 16) in others. Q8_0 and Q5_0 take exactly the file's bytes."""
    gf = GGUFFile.open(default_gguf_path(progress=False))
    cfg, params = load_gguf_quantized(gf.path, progress=False)
    layers = params["layers"]
    five = (5, 32, "float16")
    form = lambda w: (w.bits, w.group, np.dtype(w.scales.dtype).name)
    assert {(form(lp["gate_up"]), lp["o"].bits) for lp in layers} == {(five, 4)}
    v_types = [gf.tensors[f"blk.{i}.attn_v.weight"].qtype.name for i in range(cfg.n_layers)]
    assert sorted(set(v_types)) == ["Q5_0", "Q8_0"]
    for lp, v_type in zip(layers, v_types):
        if v_type == "Q5_0":
            assert form(lp["qkv"]) == five and "q" not in lp
        else:
            assert "qkv" not in lp and form(lp["q"]) == form(lp["k"]) == five
            assert form(lp["v"]) == (8, 32, "float16")
    assert {(lp["down"].bits, lp["down"].group) for lp in layers} == {(4, 32), (8, 16)}
    assert params["embed"].shape == (cfg.d_model, cfg.vocab_size) and params["embed"].bits == 8
    assert weight_bytes({"e": params["embed"]}) == gf.tensors["token_embd.weight"].nbytes == 178_257_920
    q5_file = sum(t.nbytes for t in gf.tensors.values() if t.qtype.name == "Q5_0")
    held = [w for lp in layers for w in lp.values() if isinstance(w, QuantWeight)]
    q5_held = sum(w.nbytes for w in held if w.bits == 5)
    assert q5_held == q5_file
    tensors = [(t.shape, t.qtype.name) for t in gf.tensors.values()]
    assert weight_bytes(params) == served_bytes(tensors, "gguf") == 256_080_384
    assert weight_bytes(params) < 0.25 * 4 * 268_098_176  # the float32 params' bytes (FACTS.md)
