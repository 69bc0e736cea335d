"""Gemma 3 text decoder as pure functions over a params pytree.

Layout of `params` (matrices are (in, out): the model computes ``x @ W``)::

    embed           [vocab, d]            tied input/output embedding
    final_norm      [d]                   RMSNorm multiplier (HF's 1 + w)
    layers/attn_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm  [L, d]
    layers/qkv      [L, d, q_dim + 2 kv_dim]   columns: q | k | v
    layers/q_norm, k_norm  [L, head_dim]
    layers/o        [L, q_dim, d]
    layers/gate_up  [L, d, 2 ffn]         columns: gate | up
    layers/down     [L, ffn, d]

Tensor parallelism (engine/sharding.py) splits qkv into q, k, v and gate_up
into gate, up; `block` takes either form.

Loaders produce the layers stacked as above; `unstack_layers` turns them into
a list of per-layer dicts, which is what `forward` takes.

Attention reads the paged KV cache *as it was before this call* plus the new
tokens' own keys and values, then returns the new keys and values; the caller
scatters them into the pages after the layer scan (engine/kv.py). Reading the
old cache and writing afterwards lets one function serve prefill chunks,
single-token decode and (1 + depth)-token verification alike, and lets the
sliding-window ring hold just window + verify slots.

Layers are unrolled over per-layer weight buffers (see unstack_layers for why
not a scan); one decode shape of the 270M model compiles in ~3.5 s on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from engine.config import ModelConfig

Params = dict[str, Any]
_NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32 with a multiplier weight; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, pos: jax.Array, base: float, scale: float) -> jax.Array:
    """Half-split (NeoX) rotary embedding.

    x: [B, T, heads, hd]; pos: [B, T] int32. Example: at pos 0 rope is the identity.
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = (pos.astype(jnp.float32) / scale)[..., None] * inv_freq  # [B, T, hd/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVView:
    """The cached keys/values one call may read, already gathered per sequence."""

    k: jax.Array  # [B, S, kv_heads, hd] one layer's cached keys, slot order
    v: jax.Array  # [B, S, kv_heads, hd]
    pos: jax.Array  # [B, S] int32 position held by each slot, -1 where empty


def attend(cfg: ModelConfig, q, k_new, v_new, q_pos, cache: KVView, window: int | None):
    """Grouped-query attention of new queries over the old cache plus the new keys.

    q: [B, T, H, hd]; k_new, v_new: [B, T, KV, hd]; q_pos: [B, T] (-1 = padding).
    A key at position kp is visible to a query at qp when 0 <= kp <= qp and,
    for a sliding layer, qp - kp < window. Returns [B, T, H, hd].
    """
    B, T, H, hd = q.shape
    KV = k_new.shape[2]
    G = H // KV
    # Heads-major layouts make both products plain batched matmuls over (b, kv):
    # XLA:CPU runs these ~2.5x faster than the 5-D einsum over (b, t, k, g, h).
    k = jnp.concatenate([cache.k, k_new], axis=1).transpose(0, 2, 1, 3)  # [B, KV, S+T, hd]
    v = jnp.concatenate([cache.v, v_new], axis=1).transpose(0, 2, 1, 3)
    kpos = jnp.concatenate([cache.pos, q_pos], axis=1)  # [B, S+T]
    qg = q.reshape(B, T, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, KV, T * G, hd)
    s = jnp.einsum("bkqh,bksh->bkqs", qg, k, preferred_element_type=jnp.float32)
    s = s * (cfg.query_pre_attn_scalar ** -0.5)
    qp = jnp.repeat(q_pos, G, axis=1)[:, :, None]  # [B, T*G, 1] in (t, g) order
    kp = kpos[:, None, :]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= (qp - kp) < window
    s = jnp.where(mask[:, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bksh->bkqh", p, v, preferred_element_type=jnp.float32)
    out = out.reshape(B, KV, T, G, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H, hd).astype(q.dtype)


def block(cfg: ModelConfig, lp: Params, x, pos, cache: KVView, is_global: bool):
    """One transformer block. Returns (x, (k_new, v_new)) for the cache write."""
    B, T, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    if "qkv" in lp:
        q, k, v = jnp.split(h @ lp["qkv"], [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
    else:  # unfused (engine/sharding.py): each device holds whole heads of q, k, v
        q, k, v = h @ lp["q"], h @ lp["k"], h @ lp["v"]
    q = rms_norm(q.reshape(B, T, cfg.n_heads, cfg.head_dim), lp["q_norm"], cfg.rms_eps)
    k = rms_norm(k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim), lp["k_norm"], cfg.rms_eps)
    v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    if is_global:
        base, scale, window = cfg.rope_base_global, cfg.rope_scale_global, None
    else:
        base, scale, window = cfg.rope_base_local, 1.0, cfg.sliding_window
    q, k = rope(q, pos, base, scale), rope(k, pos, base, scale)
    a = attend(cfg, q, k, v, pos, cache, window)
    return _after_attention(cfg, lp, x, a.reshape(B, T, cfg.q_dim)), (k, v)


def _after_attention(cfg: ModelConfig, lp, x, a):
    """The rest of a layer from the attention output `a`: the output projection's residual, then
    the gated MLP's (shared by `layer` and `forward_segments`)."""
    x = x + rms_norm(a @ lp["o"], lp["post_attn_norm"], cfg.rms_eps)
    h = rms_norm(x, lp["pre_ffw_norm"], cfg.rms_eps)
    if "gate_up" in lp:
        gate, up = jnp.split(h @ lp["gate_up"], 2, axis=-1)
    else:
        gate, up = h @ lp["gate"], h @ lp["up"]
    m = (jax.nn.gelu(gate, approximate=True) * up) @ lp["down"]
    return x + rms_norm(m, lp["post_ffw_norm"], cfg.rms_eps)


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embedding scaled by sqrt(d_model) (in the compute dtype, as Gemma does)."""
    e = params["embed"]
    return jnp.take(e, tokens, axis=0) * jnp.asarray(math.sqrt(cfg.d_model), e.dtype)


def logits(params: Params, h: jax.Array) -> jax.Array:
    """Tied output layer on final-normed hidden states: [..., d] -> [..., vocab] f32."""
    return jnp.einsum("...d,vd->...v", h, params["embed"], preferred_element_type=jnp.float32)


def unstack_layers(params: Params) -> Params:
    """Split stacked [L, ...] layer weights into a list of per-layer dicts.

    XLA:CPU copies a weight slice taken inside a jitted function every call:
    slicing stacked layers in the forward (or scanning over them) made decode
    4x slower than separate per-layer buffers, and compiled no faster.
    Idempotent: an already split tree is returned as is.
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = next(iter(layers.values())).shape[0]
    split = [{k: jnp.array(v[i]) for k, v in layers.items()} for i in range(n)]
    return {**params, "layers": split}


def forward(cfg: ModelConfig, params: Params, tokens, pos, read_cache, capture=()):
    """Run all layers over new tokens.

    params: with per-layer weights (see unstack_layers).
    tokens, pos: [B, T] int32 (pos -1 marks padding).
    read_cache(kind, index) -> KVView: the cache of the `index`-th layer of
      `kind` ("global" or "local"), gathered for this batch.
    capture: layer indices whose output hidden states to return (for MTP
      heads and early exit); static.
    Returns (h_final_normed [B,T,d], new_kv, captured) where new_kv maps kind to
    (k, v) of shape [layers_of_kind, B, T, KV, hd] in layer order.
    """
    x = embed(cfg, params, tokens)
    new: dict[str, tuple[list, list]] = {"global": ([], []), "local": ([], [])}
    hidden = {}
    for i, lp in enumerate(params["layers"]):
        kind = "global" if cfg.is_global(i) else "local"
        ks, vs = new[kind]
        x, (k, v) = block(cfg, lp, x, pos, read_cache(kind, len(ks)), kind == "global")
        ks.append(k)
        vs.append(v)
        if i in capture:
            hidden[i] = x
    new_kv = {kind: (_stack(ks, k_like=x, cfg=cfg), _stack(vs, k_like=x, cfg=cfg)) for kind, (ks, vs) in new.items()}
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    return h, new_kv, tuple(hidden[i] for i in capture)


def _stack(arrs: list, k_like, cfg: ModelConfig):
    """Stack per-layer K or V; an empty kind gives a [0, B, T, KV, hd] array."""
    if arrs:
        return jnp.stack(arrs)
    B, T = k_like.shape[:2]
    return jnp.zeros((0, B, T, cfg.n_kv_heads, cfg.head_dim), k_like.dtype)


def forward_segments(cfg: ModelConfig, params: Params, segments):
    """`forward` over several batches of new tokens at once (a mixed step: decode rows and
    prefill chunks): the dense parts (projections, MLP, norms, rotary) run once over all their
    tokens flattened, [sum of B_i * T_i, d]; attention runs per segment over its own cache.

    segments: tuple of (tokens [B_i, T_i], pos [B_i, T_i], read_cache_i) as `forward` takes.
    Returns (per segment: final-normed h [B_i, T_i, d]; per segment: new_kv as `forward`'s).
    """
    shapes = [tok.shape for tok, _, _ in segments]
    sizes = [b * t for b, t in shapes]
    cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    x = jnp.concatenate([embed(cfg, params, tok).reshape(-1, cfg.d_model) for tok, _, _ in segments])
    pos = jnp.concatenate([p.reshape(-1) for _, p, _ in segments])[:, None]  # [N, 1]: one token a row
    new = [{"global": ([], []), "local": ([], [])} for _ in segments]
    for i, lp in enumerate(params["layers"]):
        kind = "global" if cfg.is_global(i) else "local"
        is_global = kind == "global"
        h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
        if "qkv" in lp:
            q, k, v = jnp.split(h @ lp["qkv"], [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
        else:
            q, k, v = h @ lp["q"], h @ lp["k"], h @ lp["v"]
        q = rms_norm(q.reshape(-1, 1, cfg.n_heads, cfg.head_dim), lp["q_norm"], cfg.rms_eps)
        k = rms_norm(k.reshape(-1, 1, cfg.n_kv_heads, cfg.head_dim), lp["k_norm"], cfg.rms_eps)
        v = v.reshape(-1, 1, cfg.n_kv_heads, cfg.head_dim)
        if is_global:
            base, scale, window = cfg.rope_base_global, cfg.rope_scale_global, None
        else:
            base, scale, window = cfg.rope_base_local, 1.0, cfg.sliding_window
        q, k = rope(q, pos, base, scale), rope(k, pos, base, scale)
        outs = []
        for s, ((B, T), (_, p, read), qs, ks, vs) in enumerate(zip(
                shapes, segments, jnp.split(q, cuts), jnp.split(k, cuts), jnp.split(v, cuts))):
            ks, vs = ks.reshape(B, T, *ks.shape[2:]), vs.reshape(B, T, *vs.shape[2:])
            kl, vl = new[s][kind]
            a = attend(cfg, qs.reshape(B, T, *qs.shape[2:]), ks, vs, p, read(kind, len(kl)), window)
            kl.append(ks)
            vl.append(vs)
            outs.append(a.reshape(B * T, cfg.q_dim))
        x = _after_attention(cfg, lp, x, jnp.concatenate(outs))
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    hs = [part.reshape(B, T, cfg.d_model) for (B, T), part in zip(shapes, jnp.split(h, cuts))]
    kvs = [{kind: (_stack(ks, k_like=hh, cfg=cfg), _stack(vs, k_like=hh, cfg=cfg)) for kind, (ks, vs) in n.items()}
           for n, hh in zip(new, hs)]
    return hs, kvs
