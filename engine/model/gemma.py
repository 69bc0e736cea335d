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

Served quantized (engine/model/quant_weights.py), every matrix is a `QuantWeight` of the same
W [in, out] (engine/quant/formats.py), layers come per layer, and `embed` holds the tied table
as the output layer's W = embed.T [d, vocab]: lookups take its columns, logits run through
`qmatmul`. `matmul`, `embedding_rows` and `tied_logits` take either form.

Tensor parallelism (engine/model/sharding.py) splits qkv into q, k, v and gate_up
into gate, up; `block` takes either form.

Loaders produce the layers stacked as above; `unstack_layers` turns them into
a list of per-layer dicts, which is what `forward` takes.

Attention reads the paged KV cache *in its state before this call* plus the new
tokens' own keys and values, then returns the new keys and values; the caller
scatters them into the pages after the layer scan (engine/memory/kv.py). Reading the
old cache and writing afterwards lets one function serve prefill chunks,
single-token decode and (1 + depth)-token verification alike, and lets the
sliding-window ring hold just window + verify slots.

Layers are unrolled over per-layer weight buffers (see unstack_layers for why
not a scan); one decode shape of the 270M model compiles in ~3.5 s on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from engine.config import ModelConfig
from engine.quant.formats import QuantWeight, take_columns
from engine.quant.matmul import qmatmul

Params = dict[str, Any]
_NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ W [in, out]: a float matrix, or a `QuantWeight` through `qmatmul` (float32)."""
    return qmatmul(x, w) if isinstance(w, QuantWeight) else x @ w


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


ATTEND_BLOCK = 128
"""Cached key slots attention reads per loop iteration (a multiple of the page size): large enough
that a short context takes one or two iterations, small enough that a long one never gathers its
whole padded context at once."""


@dataclass(frozen=True)
class PagedView:
    """One layer's paged cache as one call reads it: the pool, each row's page table and its
    newest cached position. Attention reads it ATTEND_BLOCK slots at a time, only as far as the
    longest row's cache reaches, so its cost follows the real context, not the table's width.

    Slot s of a row (page table[s // page_size], offset s % page_size) holds position s in a
    global table (`ring` 0); in a sliding-window ring of `ring` slots it holds the newest
    position <= last congruent to s modulo `ring`.
    """

    k: jax.Array  # [layers_of_kind, pages, page_size, kv_heads, hd] the whole pool
    v: jax.Array
    layer: int  # index among the layers of this kind (static)
    table: jax.Array  # [B, W] int32 page ids in slot order (page 0: scratch)
    last: jax.Array  # [B] int32 newest cached position, -1 when nothing is cached
    ring: int = 0  # ring capacity in slots for a sliding-window table; 0: global
    hidden: jax.Array | None = None  # [B, n] positions to leave unread (their keys come anew)

    def slot_positions(self, slots: jax.Array) -> jax.Array:
        """[B, S] position held by each of `slots` [S] (-1: empty or out of range)."""
        last = self.last[:, None]
        if self.ring:
            pos = last - jnp.mod(last - slots[None, :], self.ring)
        else:
            pos = jnp.where(slots[None, :] <= last, slots[None, :], -1)
        inside = slots[None, :] < self.table.shape[1] * self.k.shape[2]
        pos = jnp.where(inside & (pos >= 0), pos, -1)
        if self.hidden is not None:
            pos = jnp.where((pos[:, :, None] == self.hidden[:, None, :]).any(-1), -1, pos)
        return pos

    def slots_to_read(self) -> jax.Array:
        """Slots from 0 that hold every row's cached keys (a scalar)."""
        n = jnp.max(self.last) + 1
        cap = self.table.shape[1] * self.k.shape[2]
        return jnp.minimum(n, min(self.ring, cap) if self.ring else cap)


def _scores(cfg: ModelConfig, qt, k, mask):
    """Scaled, masked scores of queries qt [B, KV, hd, Q] against keys k [B, KV, S, hd]:
    [B, KV, S, Q] float32 (keys as the left operand: XLA:CPU runs this orientation ~4x faster
    than [Q, hd] x [hd, S] when Q is small)."""
    s = jnp.matmul(k, qt, preferred_element_type=jnp.float32) * (cfg.query_pre_attn_scalar ** -0.5)
    return jnp.where(mask, s, _NEG)


def _visible(kp, qp, window: int | None):
    """Mask [B, 1, S, Q] of keys at kp [B, S] visible to queries at qp [B, Q]."""
    kp, qp = kp[:, None, :, None], qp[:, None, None, :]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= (qp - kp) < window
    return mask


def attend(cfg: ModelConfig, q, k_new, v_new, q_pos, cache, window: int | None):
    """Grouped-query attention of new queries over the old cache plus the new keys.

    q: [B, T, H, hd]; k_new, v_new: [B, T, KV, hd]; q_pos: [B, T] (-1 = padding); cache: a
    PagedView (read block by block with a running softmax) or a gathered KVView.
    A key at position kp is visible to a query at qp when 0 <= kp <= qp and,
    for a sliding layer, qp - kp < window. Returns [B, T, H, hd].
    """
    B, T, H, hd = q.shape
    KV = k_new.shape[2]
    G = H // KV
    qt = q.reshape(B, T, KV, G, hd).transpose(0, 2, 4, 1, 3).reshape(B, KV, hd, T * G)  # (t, g) order
    qp = jnp.repeat(q_pos, G, axis=1)  # [B, T*G]
    kv_major = lambda a: a.transpose(0, 2, 1, 3)  # [B, S, KV, hd] -> [B, KV, S, hd]
    if isinstance(cache, KVView):  # already gathered: one softmax over cache and new keys
        k = jnp.concatenate([kv_major(cache.k), kv_major(k_new)], axis=2)
        v = jnp.concatenate([kv_major(cache.v), kv_major(v_new)], axis=2)
        mask = _visible(jnp.concatenate([cache.pos, q_pos], axis=1), qp, window)
        p = jax.nn.softmax(_scores(cfg, qt, k, mask), axis=2).astype(v.dtype)
        out = jnp.einsum("bksq,bksh->bkqh", p, v, preferred_element_type=jnp.float32)
    else:
        out = _attend_paged(cfg, qt, qp, kv_major(k_new), kv_major(v_new), q_pos, cache, window)
    out = out.reshape(B, KV, T, G, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H, hd).astype(q.dtype)


def _attend_paged(cfg: ModelConfig, qt, qp, k_new, v_new, q_pos, cache: PagedView, window: int | None):
    """Online-softmax attention over the cache and the new keys. Returns [B, KV, Q, hd] float32."""
    _, l, acc = paged_softmax(cfg, qt, qp, cache, window, (k_new, v_new, q_pos))
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def paged_softmax(cfg: ModelConfig, qt, qp, cache: PagedView, window: int | None, extra=None,
                  block: int = ATTEND_BLOCK):
    """Partial softmax of queries qt [B, KV, hd, Q] at positions qp [B, Q] over the cache, `block`
    slots at a time up to `cache.slots_to_read()`, and over `extra` keys (k [B, KV, T, hd], v
    likewise, positions [B, T]) if given. With extra keys the first block goes in their pass before
    the loop, so a short context (a decode at under `block` cached slots) runs no loop iteration
    at all; without, the loop reads every block (a peeled first block would only add a copy of
    the loop body to compile). Returns running max m and sum l [B, KV, Q] and weighted values
    acc [B, KV, Q, hd], all float32."""
    ps = cache.k.shape[2]
    per = max(1, block // ps)  # pages per iteration
    table = cache.table
    if table.shape[1] % per:  # pad with scratch pages, which slot_positions masks
        table = jnp.pad(table, ((0, 0), (0, per - table.shape[1] % per)))
    B, KV = qt.shape[:2]

    def cached(j):
        """Block j of the cache: keys, values [B, KV, per * ps, hd] and their mask."""
        pages = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)  # [B, per]
        k = cache.k[cache.layer, pages].reshape(B, per * ps, *cache.k.shape[3:])
        v = cache.v[cache.layer, pages].reshape(B, per * ps, *cache.v.shape[3:])
        kp = cache.slot_positions(j * per * ps + jnp.arange(per * ps, dtype=jnp.int32))
        return k.transpose(0, 2, 1, 3).astype(qt.dtype), v.transpose(0, 2, 1, 3), _visible(kp, qp, window)

    def add(carry, k, v, mask):
        m, l, acc = carry
        s = _scores(cfg, qt, k, mask)
        m_new = jnp.maximum(m, s.max(axis=2))  # [B, KV, Q]
        p = jnp.where(mask, jnp.exp(s - m_new[:, :, None, :]), 0.0)
        fix = jnp.exp(m - m_new)
        pv = jnp.einsum("bksq,bksh->bkqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l * fix + p.sum(axis=2), acc * fix[..., None] + pv

    Q = qt.shape[3]
    init = (jnp.full((B, KV, Q), _NEG, jnp.float32), jnp.zeros((B, KV, Q), jnp.float32),
            jnp.zeros((B, KV, Q, qt.shape[2]), jnp.float32))
    blocks = (cache.slots_to_read() + per * ps - 1) // (per * ps)
    if extra is None:
        return jax.lax.fori_loop(0, blocks, lambda j, c: add(c, *cached(j)), init)
    k0, v0, mask0 = cached(0)
    k_new, v_new, q_pos = extra
    k0 = jnp.concatenate([k0, k_new.astype(qt.dtype)], axis=2)
    v0 = jnp.concatenate([v0.astype(v_new.dtype), v_new], axis=2)
    mask0 = jnp.concatenate([mask0, _visible(q_pos, qp, window)], axis=2)
    return jax.lax.fori_loop(1, blocks, lambda j, c: add(c, *cached(j)), add(init, k0, v0, mask0))


def attention_inputs(cfg: ModelConfig, lp: Params, x, pos, is_global: bool):
    """A layer's normed, rotated queries [B, T, H, hd] and keys and its values [B, T, KV, hd] for
    the residual stream x [B, T, d] at positions pos [B, T], and the layer's window (None: global)."""
    B, T, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    if "qkv" in lp:
        q, k, v = jnp.split(matmul(h, lp["qkv"]), [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
    else:  # unfused (sharding.py: each device holds whole heads; or quantized types that differ)
        q, k, v = matmul(h, lp["q"]), matmul(h, lp["k"]), matmul(h, lp["v"])
    q = rms_norm(q.reshape(B, T, cfg.n_heads, cfg.head_dim), lp["q_norm"], cfg.rms_eps)
    k = rms_norm(k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim), lp["k_norm"], cfg.rms_eps)
    v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    if is_global:
        base, scale, window = cfg.rope_base_global, cfg.rope_scale_global, None
    else:
        base, scale, window = cfg.rope_base_local, 1.0, cfg.sliding_window
    return rope(q, pos, base, scale), rope(k, pos, base, scale), v, window


def block(cfg: ModelConfig, lp: Params, x, pos, cache, is_global: bool):
    """One transformer block. Returns (x, (k_new, v_new)) for the cache write."""
    B, T, _ = x.shape
    q, k, v, window = attention_inputs(cfg, lp, x, pos, is_global)
    a = attend(cfg, q, k, v, pos, cache, window)
    return _after_attention(cfg, lp, x, a.reshape(B, T, cfg.q_dim)), (k, v)


@partial(jax.jit, static_argnames=("cfg", "is_global", "ring"))
def _paged_block(cfg: ModelConfig, is_global: bool, ring: int, lp: Params, x, pos, k, v, layer, table, last,
                 hidden):
    """`block` over a PagedView of pools k, v at pool index `layer` (traced): the layers of a kind
    share one trace and one lowered function, where unrolled each was traced and lowered anew."""
    return block(cfg, lp, x, pos, PagedView(k, v, layer, table, last, ring, hidden), is_global)


def _after_attention(cfg: ModelConfig, lp, x, a):
    """The rest of a layer from the attention output `a`: the output projection's residual, then
    the gated MLP's (shared by `layer` and engine/model/ragged.py's forward)."""
    x = x + rms_norm(matmul(a, lp["o"]), lp["post_attn_norm"], cfg.rms_eps)
    h = rms_norm(x, lp["pre_ffw_norm"], cfg.rms_eps)
    if "gate_up" in lp:
        gate, up = jnp.split(matmul(h, lp["gate_up"]), 2, axis=-1)
    else:
        gate, up = matmul(h, lp["gate"]), matmul(h, lp["up"])
    m = matmul(jax.nn.gelu(gate, approximate=True) * up, lp["down"])
    return x + rms_norm(m, lp["post_ffw_norm"], cfg.rms_eps)


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embedding scaled by sqrt(d_model) (in the compute dtype, as Gemma does)."""
    e = embedding_rows(params["embed"], tokens)
    return e * jnp.asarray(math.sqrt(cfg.d_model), e.dtype)


def embedding_rows(table, ids: jax.Array) -> jax.Array:
    """Rows `ids` [...] of the tied table [vocab, d] (a QuantWeight: its columns, float32): [..., d]."""
    if isinstance(table, QuantWeight):
        return take_columns(table, ids.reshape(-1)).reshape(*ids.shape, table.shape[0])
    return jnp.take(table, ids, axis=0)


def table_vocab(table) -> int:
    """Entries of the tied table, either form."""
    return table.shape[1] if isinstance(table, QuantWeight) else table.shape[0]


def table_dtype(table) -> jnp.dtype:
    """The dtype the model computes in with this table (float32 for a QuantWeight)."""
    return jnp.dtype(jnp.float32) if isinstance(table, QuantWeight) else table.dtype


def logits(params: Params, h: jax.Array) -> jax.Array:
    """Tied output layer on final-normed hidden states: [..., d] -> [..., vocab] f32."""
    return tied_logits(params["embed"], h)


FEW_ROWS = 64
"""Rows up to which `tied_logits` takes the table as the product's left operand."""


def tied_logits(table, h: jax.Array) -> jax.Array:
    """h [..., d] times table [V, d] transposed: [..., V] float32, in h cast to the table's dtype
    (a QuantWeight table is W = table.T already: `qmatmul`).

    For up to FEW_ROWS rows the product runs as table @ rows.T, [V, n], then transposed behind
    an optimization barrier (so the transpose is not folded back into the product): XLA:CPU runs
    a [262k, 640] x [640, n] product 2-4x faster than [n, 640] x [640, 262k] for n from 2 to 32
    (1 row: the same), float32 then beating a bfloat16 table on a CPU without bfloat16 units.
    """
    if isinstance(table, QuantWeight):
        return qmatmul(h, table)
    lead, d = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, d).astype(table.dtype)
    if x.shape[0] > FEW_ROWS:
        out = jnp.einsum("nd,vd->nv", x, table, preferred_element_type=jnp.float32)
    else:
        out = jax.lax.optimization_barrier(jnp.einsum("vd,nd->vn", table, x,
                                                      preferred_element_type=jnp.float32)).T
    return out.reshape(*lead, table.shape[0])


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
    read_cache(kind, index) -> PagedView: the cache of the `index`-th layer of
      `kind` ("global" or "local") for this batch (engine.memory.kv.cache_reader).
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
        view = read_cache(kind, len(ks))
        if isinstance(view, PagedView):  # one traced function per kind, its layer index traced
            x, (k, v) = _paged_block(cfg, kind == "global", view.ring, lp, x, pos, view.k, view.v,
                                     jnp.int32(view.layer), view.table, view.last, view.hidden)
        else:
            x, (k, v) = block(cfg, lp, x, pos, view, kind == "global")
        ks.append(k)
        vs.append(v)
        if i in capture:
            hidden[i] = x
    new_kv = {kind: (_stack(ks, k_like=x, cfg=cfg), _stack(vs, k_like=x, cfg=cfg))
              for kind, (ks, vs) in new.items()}
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    return h, new_kv, tuple(hidden[i] for i in capture)


def _stack(arrs: list, k_like, cfg: ModelConfig):
    """Stack per-layer K or V; an empty kind gives a [0, B, T, KV, hd] array."""
    if arrs:
        return jnp.stack(arrs)
    B, T = k_like.shape[:2]
    return jnp.zeros((0, B, T, cfg.n_kv_heads, cfg.head_dim), k_like.dtype)
