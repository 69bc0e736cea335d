"""Quantized params: every matrix a `QuantWeight` (engine/quant/formats.py), served by `qmatmul`.

Forms (`WEIGHT_FORMS`, the `--weights` flag):
- "gguf": the GGUF's own blocks, unpacked losslessly (`from_gguf`), so the numbers equal the
  float32 path's weights bit for bit. q|k|v and gate|up fuse (`concat_columns`) where their
  block types agree on group, bits and scale dtype (the default file: gate|up are Q5_0 in every
  layer, 5-bit; attn_v is Q8_0 in half the layers, where q, k and v then stay apart), else stay
  apart; ffn_down is Q4_K in some layers and Q6_K in others, so the layers come as per-layer
  dicts (the runner's form anyway: engine.model.gemma.unstack_layers).
- "int8": symmetric int8, one scale per output column, of the float32 weights (`quantize_params`).
- "float32", "bfloat16": float matrices (engine/model/weights.py).

The tied embedding [vocab, d] is held as the output layer's W = embed.T [d, vocab]: logits are
qmatmul(h, W), token lookups its columns (engine.model.gemma.embedding_rows). Norms stay float32.

`dequantize_params` turns quantized params back into float32 ones of the same layout: the
fallback where the kernel is not available (qmatmul's jnp path would rebuild every float
matrix on every call), and the tests' reference.

Loading "gguf" unpacks the file once (a few seconds) into the weights cache's `GGUF_CACHE` folder,
one .npy per array and a meta.json of each weight's (K, N, group, bits); later loads memory-map
it. The folder's name carries the layout's version, so a folder of an older layout is never read.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import jax
import numpy as np

from engine.config import QUANTIZED_FORMS, WEIGHT_FORMS, ModelConfig
from engine.model.gguf_file import GGUFFile, WeightsError, default_gguf_path, file_sha256
from engine.model.weights import gguf_config, load_model, role_shapes
from engine.model.weights_cache import cache_folder, read_cache, write_cache
from engine.quant.formats import GGUF_TYPES, QuantWeight, concat_columns, dequantize, from_gguf, quantize_int8
from engine.quant.matmul import kernel_available, kernel_status
from engine.runtime.progress import Reporter, Steps, note

Params = dict[str, Any]

_NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm")
_FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
_GGUF = {
    "attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm", "o": "attn_output", "post_attn_norm": "post_attention_norm",
    "pre_ffw_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
    "post_ffw_norm": "post_ffw_norm",
}
_PARTS = ("values", "scales", "mins", "high")  # a QuantWeight's arrays, as cached
_BIT_PARTS = {8: ("values", "scales"), 5: ("values", "scales", "high"), 4: ("values", "scales", "mins")}
GGUF_CACHE = "gguf-v2"
"""The weights cache's folder of unpacked GGUF blocks ("gguf" held float32 Q8_0/Q5_0 scales and
Q5_0 as int8; v2: float16 scales where the file's are, Q5_0 as 5-bit values)."""


def is_quantized(params: Params) -> bool:
    return isinstance(params["embed"], QuantWeight)


def is_gguf(spec: str | Path | None) -> bool:
    """Whether a model spec names a GGUF file (None: the default model, a GGUF)."""
    return spec is None or str(spec).lower().endswith(".gguf")


def weight_bytes(params: Params) -> int:
    """Bytes the params hold (a QuantWeight's values, scales, mins and high bits; float arrays' own)."""
    return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in jax.tree.leaves(params)))


# ----------------------------------------------------------- float <-> int8 ---


def _layers(params: Params) -> list[dict]:
    """Per-layer dicts of host arrays from stacked or per-layer params."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return [dict(lp) for lp in layers]
    n = next(iter(layers.values())).shape[0]
    return [{k: np.asarray(v[i]) for k, v in layers.items()} for i in range(n)]


def quantize_params(params: Params, group: int | None = None) -> Params:
    """Float params (stacked or per layer) with every matrix int8 (`quantize_int8`: one scale per
    output column, or per `group` inputs), the embedding as W = embed.T, norms float32; per-layer
    layers, on the device."""
    f32 = lambda a: np.asarray(a, np.float32)
    layers = [{k: quantize_int8(f32(v), group) if np.ndim(v) == 2 else f32(v) for k, v in lp.items()}
              for lp in _layers(params)]
    out = {"embed": quantize_int8(f32(params["embed"]).T, group), "final_norm": f32(params["final_norm"]),
           "layers": layers}
    return jax.device_put(out)


def dequantize_params(params: Params) -> Params:
    """Quantized params as float32 ones of the same layout (the embedding [vocab, d] again)."""
    host = lambda w: dequantize(jax.tree.map(np.asarray, w))
    deq = lambda v: host(v) if isinstance(v, QuantWeight) else v
    embed = params["embed"]
    out = {"embed": np.ascontiguousarray(host(embed).T) if isinstance(embed, QuantWeight) else embed,
           "final_norm": params["final_norm"],
           "layers": [{k: deq(v) for k, v in lp.items()} for lp in params["layers"]]}
    return jax.device_put(out)


# -------------------------------------------------------------------- GGUF ---


def _fuse(parts: dict[str, Any]) -> dict[str, Any]:
    """q, k, v -> qkv and gate, up -> gate_up where the parts are all QuantWeights of one group,
    bits and scale dtype (or all float matrices), else apart."""
    out = dict(parts)
    key = lambda w: (w.group, w.bits, np.dtype(w.scales.dtype))
    for fused, names in _FUSED.items():
        ws = [parts[n] for n in names]
        if all(isinstance(w, QuantWeight) for w in ws) and len({key(w) for w in ws}) == 1:
            out[fused] = concat_columns(ws)
        elif not any(isinstance(w, QuantWeight) for w in ws):
            out[fused] = np.concatenate(ws, axis=1)
        else:
            continue
        for n in names:
            del out[n]
    return out


def gguf_leaves(gf: GGUFFile, cfg: ModelConfig, progress: Reporter = None) -> Iterator[tuple[str, Any]]:
    """(flat name, host leaf) of every leaf, one at a time: "embed", "final_norm",
    "layers.<i>.<leaf>". A matrix in a block type engine/quant unpacks is a QuantWeight (the
    embedding: of its transpose, the head W); one stored as floats (F32, F16) stays a float32
    matrix [in, out] (the embedding [vocab, d]); norms are float32."""
    shapes = role_shapes(cfg)

    def tensor(name: str, role: str) -> Any:
        if name not in gf.tensors:
            raise WeightsError(f"{gf.path}: tensor {name} is missing")
        info = gf.tensors[name]
        if tuple(info.shape) != shapes[role]:
            raise WeightsError(f"{gf.path}: tensor {name} has shape {tuple(info.shape)}, "
                               f"expected {shapes[role]}")
        if len(info.shape) == 1 or info.qtype.name not in GGUF_TYPES:
            arr = gf.read(name)
            return arr if arr.ndim == 1 or role == "embed" else np.ascontiguousarray(arr.T)
        raw = np.fromfile(gf.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        try:
            return from_gguf(raw, info.qtype.name, info.shape)
        except ValueError as exc:
            raise WeightsError(f"{gf.path}: tensor {name}: {exc}") from exc

    with Steps(progress, f"unpacking {gf.path.name}", 2 + cfg.n_layers) as bar:
        yield "embed", tensor("token_embd.weight", "embed")
        yield "final_norm", tensor("output_norm.weight", "final_norm")
        bar.advance(2)
        for i in range(cfg.n_layers):
            parts = {role: tensor(f"blk.{i}.{stem}.weight", role) for role, stem in _GGUF.items()}
            matrices = _fuse({k: v for k, v in parts.items() if k not in _NORMS})
            for k, v in {**{n: parts[n] for n in _NORMS}, **matrices}.items():
                yield f"layers.{i}.{k}", v
            bar.advance()


def _arrays(leaves: Iterator[tuple[str, Any]], meta: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Leaves as named arrays for the cache (a QuantWeight as <name>.<part> of each part its bits
    hold: values, scales, mins, high), recording each leaf in `meta` as it goes."""
    for name, leaf in leaves:
        if isinstance(leaf, QuantWeight):
            meta[name] = [*leaf.shape, leaf.group, leaf.bits]
            for part in _BIT_PARTS[leaf.bits]:
                yield f"{name}.{part}", getattr(leaf, part)
        else:
            meta[name] = None
            yield name, leaf


def _from_arrays(folder: Path) -> Params:
    """Params from a cache folder: memory maps, aliased by `jax.device_put` on CPU."""
    meta = json.loads((folder / "meta.json").read_text())
    flat: dict[str, Any] = {}
    for name, spec in meta.items():
        if spec is None:
            flat[name] = jax.device_put(next(read_cache(folder, [name], None))[1])
            continue
        k, n, group, bits = spec
        held = _BIT_PARTS[bits]
        arrays = dict(read_cache(folder, [f"{name}.{p}" for p in held], None))
        parts = {p: jax.device_put(arrays[f"{name}.{p}"]) if p in held else None for p in _PARTS}
        flat[name] = QuantWeight(parts["values"], parts["scales"], parts["mins"], (k, n), group, bits,
                                 parts["high"])
    return _unflatten(flat)


def _unflatten(flat: dict[str, Any]) -> Params:
    layers: list[dict] = []
    for name, leaf in flat.items():
        if name.startswith("layers."):
            _, i, key = name.split(".", 2)
            while len(layers) <= int(i):
                layers.append({})
            layers[int(i)][key] = leaf
    return {"embed": flat["embed"], "final_norm": flat["final_norm"], "layers": layers}


def load_gguf_quantized(path: str | Path, progress: Reporter = True) -> tuple[ModelConfig, Params]:
    """(config, params) with the GGUF's own blocks; unpacked once, then memory-mapped from the cache."""
    gf = GGUFFile.open(path)
    cfg = gguf_config(gf)
    folder = cache_folder(file_sha256(gf.path, progress=progress), GGUF_CACHE)
    for attempt in range(2):
        try:
            if not folder.is_dir():
                meta: dict = {}
                write_cache(folder, _arrays(gguf_leaves(gf, cfg, progress), meta), None, meta)
            return cfg, _from_arrays(folder)
        except WeightsError:
            raise
        except (OSError, ValueError, KeyError) as exc:  # a damaged cache: drop it and build it again, once
            with suppress(OSError):
                shutil.rmtree(folder, ignore_errors=True)
            if attempt:
                sys.stderr.write(f"warning: cannot cache unpacked weights ({exc}); unpacking in memory\n")
    return cfg, jax.device_put(_unflatten(dict(gguf_leaves(gf, cfg, progress))))


# ----------------------------------------------------------------- public ---


def load_weights(spec: str | Path | None, weights: str,
                 progress: Reporter = True) -> tuple[ModelConfig, Params]:
    """(config, params) in `weights` form (WEIGHT_FORMS). A quantized form needs the kernel
    (engine/quant/matmul.py: built here on first use): without it the weights load as float32,
    with the same numbers, and the log says so."""
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMS)}, got {weights!r}")
    if weights not in QUANTIZED_FORMS:
        return load_model(spec, weights, progress)
    if weights == "gguf" and not is_gguf(spec):
        raise WeightsError(f"{spec}: --weights gguf needs a GGUF file (this checkpoint: int8, bfloat16 "
                           "or float32)")
    status = kernel_status()
    if not kernel_available():
        note(progress, f"weights: {weights} asked, but the quantized matmul is {status}: serving its numbers "
                       "as float32 matrices")
        if weights == "gguf":  # the float32 cache holds exactly the GGUF's numbers
            return load_model(spec, "float32", progress)
        cfg, params = load_model(spec, "float32", progress)
        return cfg, dequantize_params(quantize_params(params))
    note(progress, f"weights: {weights}, quantized matmul: {status}")
    if weights == "gguf":
        return load_gguf_quantized(spec or default_gguf_path(progress), progress)
    cfg, params = load_model(spec, "float32", progress)
    return cfg, quantize_params(params)
