"""Quantized params from a GGUF (engine/model/quant_weights.py): the file's own blocks as
QuantWeights, float tensors as float, cached, and exactly the float32 loader's numbers."""

from __future__ import annotations

import numpy as np
import pytest

from engine.memory.sizes import served_bytes
from engine.model import quant_weights
from engine.model.gguf_file import GGUFFile, WeightsError, default_gguf_path
from engine.model.quant_weights import dequantize_params, load_gguf_quantized, load_weights, weight_bytes
from engine.model.weights import load_gguf
from engine.model.weights_cache import cache_folder
from engine.quant.formats import QuantWeight
from tests.engine.test_weights import tiny_gguf, tmp_cache, write_tiny_gguf  # noqa: F401 (fixtures)


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
    folder = next(cache_folder("x", "gguf").parent.parent.glob("params-*/gguf"))
    assert (folder / "meta.json").is_file() and (folder / "embed.values.npy").is_file()
    monkeypatch.setattr(quant_weights, "gguf_leaves", lambda *a, **k: pytest.fail("unpacked again"))
    _, second = load_gguf_quantized(path, progress=False)
    np.testing.assert_array_equal(np.asarray(second["layers"][1]["q"].scales),
                                  np.asarray(first["layers"][1]["q"].scales))


def test_damaged_cache_is_rebuilt(tiny_gguf):  # noqa: F811
    path, _ = tiny_gguf
    load_gguf_quantized(path, progress=False)
    folder = next(cache_folder("x", "gguf").parent.parent.glob("params-*/gguf"))
    (folder / "layers.3.q.scales.npy").write_bytes(b"junk")
    _, params = load_gguf_quantized(path, progress=False)
    _same_numbers(params, load_gguf(path, progress=False)[1])


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
    """The default model: q|k|v and gate|up fuse as int8 groups of 32, o is 4-bit, down 4-bit in
    some layers and 6-bit (int8 values, groups of 16) in others; all of it under 400 MiB."""
    gf = GGUFFile.open(default_gguf_path(progress=False))
    cfg, params = load_gguf_quantized(gf.path, progress=False)
    layers = params["layers"]
    fused = {(lp["qkv"].bits, lp["qkv"].group, lp["gate_up"].bits, lp["o"].bits) for lp in layers}
    assert fused == {(8, 32, 8, 4)}
    assert {(lp["down"].bits, lp["down"].group) for lp in layers} == {(4, 32), (8, 16)}
    assert params["embed"].shape == (cfg.d_model, cfg.vocab_size) and params["embed"].bits == 8
    assert weight_bytes(params) < 400 * 2**20
    tensors = [(t.shape, t.qtype.name) for t in gf.tensors.values()]
    assert weight_bytes(params) == served_bytes(tensors, "gguf") == 294_398_464
    assert weight_bytes(params) < 0.35 * 4 * 268_098_176  # the float32 params' bytes (FACTS.md)
