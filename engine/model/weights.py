"""Load Gemma 3 weights into the engine's params pytree.

Data flow:
1. `load_model(spec)` picks the source: None -> the default GGUF
   (`gguf_file.default_gguf_path`), `*.gguf` -> `load_gguf`, a directory ->
   `load_hf_dir`.
2. GGUF: the header (fast parser) gives the `ModelConfig`; on first use every
   tensor is dequantized, transposed to (in, out), fused (qkv, gate_up) and
   stacked over layers, one leaf at a time, into a cache folder keyed by the
   file's sha256 (engine/model/weights_cache.py: one .npy per leaf; a bfloat16 copy
   is derived on demand).
   Loads memory-map that folder: on CPU `jax.device_put` aliases read-only
   maps, so a cached load copies nothing (~0.5 s) and processes share pages.
3. HF directory: `config.json` gives the `ModelConfig`; each leaf is built
   from the safetensors shards (norms get +1: HF stores w, the model uses 1+w).
4. Leaves go to JAX one at a time in the requested dtype, so at most one
   leaf exists twice (host and device) at any moment.

The pytree (matrices (in, out), the model computes `x @ W`):
    embed [vocab, d]; final_norm [d]; layers: attn_norm [L, d],
    qkv [L, d, q_dim + 2 kv_dim] (q, k, v columns), q_norm, k_norm [L, head_dim],
    o [L, q_dim, d], post_attn_norm, pre_ffw_norm [L, d],
    gate_up [L, d, 2 ffn] (gate, up columns), down [L, ffn, d], post_ffw_norm [L, d].
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from engine.config import PRESETS, ModelConfig
from engine.model.gguf_file import GGUFFile, WeightsError, default_gguf_path, file_sha256
from engine.model.weights_cache import cache_folder, read_cache, write_cache
from engine.runtime.progress import Reporter, Steps

__all__ = ["WeightsError", "load_model", "load_gguf", "load_hf_dir", "gguf_config", "convert_gguf"]

Params = dict[str, Any]
Fetch = Callable[[str, int], np.ndarray]
"""fetch(role, layer) -> float32 tensor in the checkpoint's (out, in) orientation."""

_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_LAYER_LEAVES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attn_norm",), "qkv": ("q", "k", "v"), "q_norm": ("q_norm",), "k_norm": ("k_norm",),
    "o": ("o",), "post_attn_norm": ("post_attn_norm",), "pre_ffw_norm": ("pre_ffw_norm",),
    "gate_up": ("gate", "up"), "down": ("down",), "post_ffw_norm": ("post_ffw_norm",),
}
"""Each stacked leaf and the checkpoint roles it is built from (columns in order)."""
_GGUF_NAMES = {
    "embed": "token_embd.weight", "final_norm": "output_norm.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "o": "blk.{i}.attn_output.weight", "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "pre_ffw_norm": "blk.{i}.ffn_norm.weight", "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
    "post_ffw_norm": "blk.{i}.post_ffw_norm.weight",
}


def role_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint shape of each role, (out, in) for matrices."""
    d, f, h = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    norms = {r: (d,) for r in ("final_norm", "attn_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm")}
    return {
        **norms, "embed": (cfg.vocab_size, d), "q": (cfg.q_dim, d), "k": (cfg.kv_dim, d),
        "v": (cfg.kv_dim, d), "q_norm": (h,), "k_norm": (h,), "o": (d, cfg.q_dim),
        "gate": (f, d), "up": (f, d), "down": (d, f),
    }


def leaf_names() -> list[str]:
    """Flat names of all leaves: "embed", "final_norm", "layers.<leaf>"."""
    return ["embed", "final_norm", *(f"layers.{k}" for k in _LAYER_LEAVES)]


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _make_config(dims: dict[str, int], extra: dict[str, Any], name: str, where: Path) -> ModelConfig:
    """Name and attention scale from the matching preset (else the path's name and head_dim)."""
    preset = next(
        (p for p in PRESETS.values()
         if all(getattr(p, k) == v for k, v in dims.items() if k != "vocab_size")),
        None,
    )
    scalar = preset.query_pre_attn_scalar if preset else float(dims["head_dim"])
    extra = {"query_pre_attn_scalar": scalar, **extra}
    try:
        return ModelConfig(name=preset.name if preset else name, **dims, **extra)
    except (TypeError, ValueError) as exc:
        raise WeightsError(f"{where}: invalid architecture: {exc}") from exc


def _dtype(dtype: Any) -> np.dtype:
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return _DTYPES[name]


# ------------------------------------------------------------ leaf builder ---


def build_leaf(name: str, cfg: ModelConfig, fetch: Fetch, norm_offset: float, dtype: np.dtype) -> np.ndarray:
    """One leaf of the pytree on the host, e.g. "layers.qkv" -> [L, d, q_dim + 2 kv_dim]."""
    if name in ("embed", "final_norm"):
        arr = fetch(name, -1)
        return (arr + norm_offset if name == "final_norm" else arr).astype(dtype, copy=False)
    roles = _LAYER_LEAVES[name.removeprefix("layers.")]
    out: np.ndarray | None = None
    for i in range(cfg.n_layers):
        parts = [fetch(r, i) for r in roles]
        layer = parts[0] + norm_offset if parts[0].ndim == 1 else np.concatenate([p.T for p in parts], axis=1)
        if out is None:
            out = np.empty((cfg.n_layers, *layer.shape), dtype)
        out[i] = layer
    assert out is not None
    return out


def _checked(name: str, arr: np.ndarray, expected: tuple[int, ...], where: Path) -> np.ndarray:
    if tuple(arr.shape) != expected:
        raise WeightsError(f"{where}: tensor {name} has shape {tuple(arr.shape)}, expected {expected}")
    return arr


def _unflatten(flat: dict[str, Any]) -> Params:
    layers = {k.removeprefix("layers."): v for k, v in flat.items() if k.startswith("layers.")}
    return {"embed": flat["embed"], "final_norm": flat["final_norm"], "layers": layers}


def _to_device(host: Iterator[tuple[str, np.ndarray]], dtype: np.dtype) -> Params:
    """Move leaves to JAX one at a time (each host copy is dropped before the next).

    A read-only, aligned host array (a cache memory map) is aliased, not copied.
    """
    flat = {}
    for name, arr in host:
        flat[name] = jax.device_put(arr.astype(dtype, copy=False))
        del arr
    return _unflatten(flat)


# -------------------------------------------------------------------- GGUF ---


def gguf_config(gf: GGUFFile) -> ModelConfig:
    """The architecture from a GGUF header; what the file lacks is Gemma 3's default."""
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise WeightsError(
            f"{gf.path} holds a {arch!r} model (general.architecture); a Gemma 3 GGUF ('gemma3') was expected"
        )
    if "token_embd.weight" not in gf.tensors:
        raise WeightsError(f"{gf.path}: tensor token_embd.weight is missing")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"gemma3.{name}", default)
        if value is None:
            raise WeightsError(f"{gf.path}: metadata key gemma3.{name} is missing")
        return value

    tokens = meta.get("tokenizer.ggml.tokens") or []
    dims = dict(
        vocab_size=gf.tensors["token_embd.weight"].shape[0], d_model=key("embedding_length"),
        n_layers=key("block_count"), n_heads=key("attention.head_count"),
        n_kv_heads=key("attention.head_count_kv"), head_dim=key("attention.key_length"),
        ffn_dim=key("feed_forward_length"),
    )
    extra = dict(
        sliding_window=key("attention.sliding_window"),
        rope_base_global=_f32(key("rope.freq_base", 1_000_000.0)),
        rope_scale_global=_f32(key("rope.scaling.factor", 1.0)),
        rms_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=key("context_length", 32_768),
        bos_id=meta.get("tokenizer.ggml.bos_token_id", 2), eos_id=meta.get("tokenizer.ggml.eos_token_id", 1),
        pad_id=meta.get("tokenizer.ggml.padding_token_id", 0),
        start_of_turn_id=tokens.index("<start_of_turn>") if "<start_of_turn>" in tokens else 105,
        end_of_turn_id=tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else 106,
    )
    return _make_config({k: int(v) for k, v in dims.items()}, extra, gf.path.stem, gf.path)


def _gguf_fetch(gf: GGUFFile, cfg: ModelConfig, bar: Steps) -> Fetch:
    shapes = role_shapes(cfg)

    def fetch(role: str, layer: int) -> np.ndarray:
        name = _GGUF_NAMES[role].format(i=layer)
        if name not in gf.tensors:
            raise WeightsError(f"{gf.path}: tensor {name} is missing")
        bar.advance()
        return _checked(name, gf.read(name), shapes[role], gf.path)

    return fetch


def convert_gguf(gf: GGUFFile, cfg: ModelConfig,
                 progress: Reporter = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (flat name, float32 host array) for every leaf, one at a time; `progress` sees
    each tensor dequantized (engine/runtime/progress.py)."""
    with Steps(progress, f"converting {gf.path.name}", 2 + 13 * cfg.n_layers) as bar:
        fetch = _gguf_fetch(gf, cfg, bar)
        for name in leaf_names():
            yield name, build_leaf(name, cfg, fetch, 0.0, _DTYPES["float32"])


def _ensure_cache(gf: GGUFFile, cfg: ModelConfig, sha: str, dtype: np.dtype, progress: Reporter) -> Path:
    """The cache folder for `dtype`, built if needed (bfloat16 from the float32 one)."""
    f32 = cache_folder(sha, _DTYPES["float32"])
    if not f32.is_dir():
        write_cache(f32, convert_gguf(gf, cfg, progress), _DTYPES["float32"])
    folder = cache_folder(sha, dtype)
    if not folder.is_dir():
        write_cache(folder, read_cache(f32, leaf_names(), _DTYPES["float32"]), dtype)
    return folder


def load_gguf(path: str | Path, dtype: Any = "float32",
              progress: Reporter = True) -> tuple[ModelConfig, Params]:
    """(config, params) from a Gemma 3 GGUF; converted once, then memory-mapped from the cache."""
    np_dtype = _dtype(dtype)
    gf = GGUFFile.open(path)
    cfg = gguf_config(gf)
    sha = file_sha256(gf.path, progress=progress)
    for attempt in range(2):
        try:
            folder = _ensure_cache(gf, cfg, sha, np_dtype, progress)
            return cfg, _to_device(read_cache(folder, leaf_names(), np_dtype), np_dtype)
        except WeightsError:
            raise
        except (OSError, ValueError) as exc:  # a damaged cache: drop it and build it again, once
            with suppress(OSError):
                shutil.rmtree(cache_folder(sha, np_dtype).parent, ignore_errors=True)
            if attempt:  # still failing: the cache is unwritable
                sys.stderr.write(f"warning: cannot cache converted weights ({exc}); converting in memory\n")
    return cfg, _to_device(convert_gguf(gf, cfg, progress), np_dtype)


# ---------------------------------------------------------------- HF dir ---

_HF_NAMES = {
    "embed": "embed_tokens.weight", "final_norm": "norm.weight",
    "attn_norm": "layers.{i}.input_layernorm.weight", "q": "layers.{i}.self_attn.q_proj.weight",
    "k": "layers.{i}.self_attn.k_proj.weight", "v": "layers.{i}.self_attn.v_proj.weight",
    "q_norm": "layers.{i}.self_attn.q_norm.weight", "k_norm": "layers.{i}.self_attn.k_norm.weight",
    "o": "layers.{i}.self_attn.o_proj.weight",
    "post_attn_norm": "layers.{i}.post_attention_layernorm.weight",
    "pre_ffw_norm": "layers.{i}.pre_feedforward_layernorm.weight",
    "gate": "layers.{i}.mlp.gate_proj.weight", "up": "layers.{i}.mlp.up_proj.weight",
    "down": "layers.{i}.mlp.down_proj.weight",
    "post_ffw_norm": "layers.{i}.post_feedforward_layernorm.weight",
}
_HF_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "language_model.", "")
_HF_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072,
    "sliding_window_pattern": 6, "vocab_size": 262_208,
}
"""transformers' Gemma3TextConfig defaults, for fields a config.json leaves out."""


def read_hf_config(root: Path) -> ModelConfig:
    """The architecture from `config.json` (its `text_config` for multimodal checkpoints)."""
    if not root.is_dir():
        raise WeightsError(f"checkpoint directory not found: {root}")
    path = root / "config.json"
    if not path.is_file():
        raise WeightsError(f"{root} has no config.json; a Hugging Face Gemma 3 checkpoint was expected")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise WeightsError(f"{path} is not valid JSON: {exc}") from exc
    text = raw.get("text_config") or raw
    model_type = text.get("model_type") or raw.get("model_type") or "gemma3"
    if not str(model_type).startswith("gemma3"):
        raise WeightsError(f"{path}: model_type is {model_type!r}; a Gemma 3 checkpoint was expected")

    def get(key: str) -> Any:
        value = text.get(key)
        return _HF_DEFAULTS[key] if value is None else value

    dims = dict(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
        n_heads=get("num_attention_heads"), n_kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim"), ffn_dim=get("intermediate_size"),
    )
    theta_global, theta_local, scale = _hf_rope(text, path)
    extra = dict(
        sliding_window=get("sliding_window"), global_every=_hf_global_every(text, dims["n_layers"], path),
        rope_base_global=theta_global, rope_base_local=theta_local, rope_scale_global=scale,
        rms_eps=float(get("rms_norm_eps")), max_position=int(get("max_position_embeddings")),
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        bos_id=_first_int(text.get("bos_token_id", raw.get("bos_token_id")), 2),
        eos_id=_first_int(text.get("eos_token_id", raw.get("eos_token_id")), 1),
        pad_id=_first_int(text.get("pad_token_id", raw.get("pad_token_id")), 0),
    )
    return _make_config({k: int(v) for k, v in dims.items()}, extra, root.name, path)


def _first_int(value: Any, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return default if value is None else int(value)


def _hf_rope(text: dict[str, Any], path: Path) -> tuple[float, float, float]:
    """(global base, local base, global linear scale) from old or new style rope fields."""
    params = text.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    local = params.get("sliding_attention", {})
    scaling = text.get("rope_scaling") or full
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise WeightsError(f"{path}: rope type {kind!r} is not supported (default or linear)")
    scale = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    theta_global = text.get("rope_theta") or full.get("rope_theta") or _HF_DEFAULTS["rope_theta"]
    theta_local = (
        text.get("rope_local_base_freq") or local.get("rope_theta") or _HF_DEFAULTS["rope_local_base_freq"]
    )
    return float(theta_global), float(theta_local), scale


def _hf_global_every(text: dict[str, Any], n_layers: int, path: Path) -> int:
    types = text.get("layer_types")
    if not types:
        return int(text.get("sliding_window_pattern") or _HF_DEFAULTS["sliding_window_pattern"])
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else n_layers + 1
    if len(types) != n_layers or any(((i + 1) % every == 0) != (i in full) for i in range(n_layers)):
        raise WeightsError(f"{path}: layer_types is not a periodic pattern with one global layer per period")
    return every


def _hf_shards(root: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index when there is one."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise WeightsError(f"{index}: not a safetensors index ({exc!r})") from exc
        for file in sorted(set(weight_map.values())):
            if not (root / file).is_file():
                raise WeightsError(f"{root}: shard {file} listed in {index.name} is missing")
        return {k: root / v for k, v in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{root} has no *.safetensors files")
    shards: dict[str, Path] = {}
    for file in files:
        with _open_safetensors(file) as f:
            shards.update(dict.fromkeys(f.keys(), file))
    return shards


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), "numpy")
    except Exception as exc:  # SafetensorError has no stable import path
        raise WeightsError(f"{file}: not a readable safetensors file ({exc})") from exc


def _hf_names(root: Path, keys: dict[str, Path], n_layers: int) -> Callable[[str, int], str]:
    """role, layer -> tensor name; `WeightsError` naming the first missing tensor."""
    prefix = next((p for p in _HF_PREFIXES if p + _HF_NAMES["embed"] in keys), "model.")
    layer_roles = [r for r in _HF_NAMES if r not in ("embed", "final_norm")]
    wanted = [prefix + _HF_NAMES[r] for r in ("embed", "final_norm")]
    wanted += [prefix + _HF_NAMES[r].format(i=i) for i in range(n_layers) for r in layer_roles]
    missing = [k for k in wanted if k not in keys]
    if missing:
        raise WeightsError(f"{root}: tensor {missing[0]} is missing "
                           f"({len(missing)} of {len(wanted)} missing)")
    return lambda role, layer: prefix + _HF_NAMES[role].format(i=layer)


def load_hf_dir(path: str | Path, dtype: Any = "float32",
                progress: Reporter = True) -> tuple[ModelConfig, Params]:
    """(config, params) from a Hugging Face Gemma 3 checkpoint directory (norms get +1)."""
    np_dtype = _dtype(dtype)
    root = Path(path)
    cfg = read_hf_config(root)
    shards = _hf_shards(root)
    names = _hf_names(root, shards, cfg.n_layers)
    shapes = role_shapes(cfg)
    with ExitStack() as stack:
        files = {f: stack.enter_context(_open_safetensors(f)) for f in sorted(set(shards.values()))}
        bar = stack.enter_context(Steps(progress, f"loading {root.name}", len(leaf_names())))

        def fetch(role: str, layer: int) -> np.ndarray:
            name = names(role, layer)
            return _checked(name, files[shards[name]].get_tensor(name).astype(np.float32), shapes[role], root)

        def host() -> Iterator[tuple[str, np.ndarray]]:
            for leaf in leaf_names():
                yield leaf, build_leaf(leaf, cfg, fetch, 1.0, np_dtype)
                bar.advance()

        return cfg, _to_device(host(), np_dtype)


# ----------------------------------------------------------------- public ---


def load_model(
    spec: str | Path | None = None, dtype: Any = "float32", progress: Reporter = True
) -> tuple[ModelConfig, Params]:
    """None -> the default GGUF; a `.gguf` path -> `load_gguf`; a directory -> `load_hf_dir`.

    `progress` (engine/runtime/progress.py) sees assembling, hashing and converting the file."""
    if spec is None:
        return load_gguf(default_gguf_path(progress), dtype, progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_hf_dir(path, dtype, progress)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, dtype, progress)
    if not path.exists():
        raise WeightsError(f"model not found: {path}")
    raise WeightsError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")
