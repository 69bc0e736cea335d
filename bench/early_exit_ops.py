"""The jitted pieces of the compacting early exit (bench/early_exit_decoder.py): a stage of layers
over a compacted row bucket, CALM state propagation, and the K/V write of one step's window.

Each step collects new K/V in buffers bk, bv [L, B, W, KV, hd] with a mask bm [L, B, W]: slot w of
row b is position p0[b] + w, where p0 is the row's first position whose upper layers are still
missing (recompute later) or its newest token (state propagation: W = 1). Only masked-in slots are
written to the pages, so a slot a step did not compute keeps what the pages hold.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench.padded import cache_reader
from engine.config import ModelConfig
from engine.execute.runner import output_scores
from engine.memory.kv import SCRATCH_PAGE, Batch, KVState
from engine.model.gemma import PagedView, block, embed, rms_norm, rope
from engine.speculation.heads import apply_head, head_logits
from engine.types import pow2_bucket


def pending_bucket(n: int) -> int:
    """Pending positions padded to a bucket: 0 stays 0, else a power of two.

    >>> [pending_bucket(n) for n in (0, 1, 2, 3, 4)]
    [0, 1, 2, 4, 4]
    """
    return 0 if n <= 0 else pow2_bucket(n)


def kind_index(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """("global" | "local", index among the layers of that kind), as the KV pools order them."""
    kinds = cfg.global_layers if cfg.is_global(layer) else cfg.local_layers
    return ("global" if cfg.is_global(layer) else "local"), kinds.index(layer)


def _rope_args(cfg: ModelConfig, layer: int) -> tuple[float, float]:
    if cfg.is_global(layer):
        return cfg.rope_base_global, cfg.rope_scale_global
    return cfg.rope_base_local, 1.0


def _without(view: PagedView, pos: jax.Array) -> PagedView:
    """The cache view with the slots of positions in `pos` [n, T] hidden: the segment brings its
    own keys for them (the pages hold nothing valid there for these layers yet)."""
    return dataclasses.replace(view, hidden=pos)


@partial(jax.jit, static_argnames=("cfg", "ring_pages", "lo", "hi", "confidence", "score"),
         donate_argnames=("bk", "bv", "bm"))
def stage(cfg: ModelConfig, ring_pages: int, lo: int, hi: int, confidence: str, score: bool,
          layers, top, kv: KVState, batch: Batch, x, pos, slots, cur, bk, bv, bm, rows, target):
    """Layers [lo, hi) for n rows' segments, then the exit adapter (hi < L) or the output layer (hi == L).

    batch: the rows' tokens [n, 1], start (each row's newest position) and page tables;
    x: [n, T, d] residual entering layer lo per segment token (ignored when lo == 0: T == 1 and the
    tokens are embedded); pos: [n, T] segment positions, causal and ascending (-1: padding);
    slots: [n, T] window slot of each (W: padding, dropped); cur: [n] index of the newest token;
    bk, bv: [L, B, W, KV, hd], bm: [L, B, W] (donated), scattered at `rows` [n] (B: padding);
    target: [n] token whose log-probability to return when `score`.
    Returns (x [n, T, d], tokens [n], confidence [n], logprob [n], bk, bv, bm), all at the newest token.
    """
    if lo == 0:
        x = embed(cfg, top, batch.tokens)
    read = cache_reader(kv, batch, ring_pages)
    for j, lp in enumerate(layers):
        kind, idx = kind_index(cfg, lo + j)
        view = read(kind, idx) if pos.shape[1] == 1 else _without(read(kind, idx), pos)
        x, (k, v) = block(cfg, lp, x, pos, view, kind == "global")
        bk = bk.at[lo + j, rows[:, None], slots].set(k.astype(bk.dtype), mode="drop")
        bv = bv.at[lo + j, rows[:, None], slots].set(v.astype(bv.dtype), mode="drop")
        bm = bm.at[lo + j, rows[:, None], slots].set(True, mode="drop")
    xc = jnp.take_along_axis(x, cur[:, None, None], axis=1)  # [n, 1, d] the newest token
    h = rms_norm(xc, top["final_norm"], cfg.rms_eps)
    n = x.shape[0]
    lp_out = jnp.zeros((n,), jnp.float32)
    if hi == cfg.n_layers:
        tok, conf = output_scores(top, h).best[:, 0], jnp.ones((n,), jnp.float32)
        if score:
            full = jnp.einsum("nd,vd->nv", h[:, 0], top["embed"], preferred_element_type=jnp.float32)
            lp_out = _logprob_at(full, target)
        return x, tok, conf, lp_out, bk, bv, bm
    lg = head_logits(top["head"], h[:, 0], top["embed_sub"])  # [n, V_exit] over the draft vocabulary
    p = jax.nn.softmax(lg, axis=-1)
    if confidence == "margin":
        two = jax.lax.top_k(p, 2)[0]
        conf = two[:, 0] - two[:, 1]
    else:
        conf = jnp.max(p, axis=-1)
    tok = top["ids"][jnp.argmax(lg, axis=-1)].astype(jnp.int32)
    if score:  # an exited position's distribution, for perplexity: the adapter over the whole vocabulary
        z = apply_head(top["head"], h[:, 0])
        full = jnp.einsum("nd,vd->nv", z, top["embed"], preferred_element_type=jnp.float32)
        lp_out = _logprob_at(full, target)
    return x, tok, conf, lp_out, bk, bv, bm


def _logprob_at(lg: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(lg, axis=-1), target[:, None], axis=-1)[:, 0]


def propagate_kv(cfg: ModelConfig, lo: int, kvw: list[dict], x: jax.Array, pos: jax.Array):
    """CALM state propagation: K/V of layers lo.. from one residual x [n, T, d] at pos [n, T].

    kvw[j]: {"attn_norm" [d], "k_norm" [hd], "kv" [d, 2 kv_dim]} of layer lo + j: exactly the
    keys and values `engine.model.gemma.block` computes when x enters that layer. Returns a list of
    (k, v) [n, T, KV, hd].
    """
    n, T, _ = x.shape
    out = []
    for j, w in enumerate(kvw):
        h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
        k, v = jnp.split(h @ w["kv"], 2, axis=-1)
        k = rms_norm(k.reshape(n, T, cfg.n_kv_heads, cfg.head_dim), w["k_norm"], cfg.rms_eps)
        base, scale = _rope_args(cfg, lo + j)
        out.append((rope(k, pos, base, scale), v.reshape(n, T, cfg.n_kv_heads, cfg.head_dim)))
    return out


@partial(jax.jit, static_argnames=("cfg", "lo"), donate_argnames=("bk", "bv", "bm"))
def propagate(cfg: ModelConfig, lo: int, kvw, x, pos, bk, bv, bm, rows):
    """propagate_kv for exited rows (x [n, 1, d]), into window slot 0 of `rows` (B: padding)."""
    for j, (k, v) in enumerate(propagate_kv(cfg, lo, kvw, x, pos)):
        bk = bk.at[lo + j, rows, 0].set(k[:, 0].astype(bk.dtype), mode="drop")
        bv = bv.at[lo + j, rows, 0].set(v[:, 0].astype(bv.dtype), mode="drop")
        bm = bm.at[lo + j, rows, 0].set(True, mode="drop")
    return bk, bv, bm


@partial(jax.jit, static_argnames=("cfg", "ring_pages", "width"), donate_argnames=("kv",))
def write_window(cfg: ModelConfig, ring_pages: int, width: int, kv: KVState, p0, gtab, ltab, bk, bv,
                 bm) -> KVState:
    """The first `width` window slots of the buffers into the pages, masked-in slots only.

    p0: [B] position of slot 0 per row; gtab [B, P], ltab [B, R] page tables; bk, bv [L, B, W, KV, hd];
    bm [L, B, W]. A slot not masked in writes to the scratch page (the ring arithmetic is
    engine.memory.kv.write_new's).
    """
    ps = kv.page_size
    pos = p0[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width]
    off = pos % ps
    g_page = jnp.take_along_axis(gtab, jnp.minimum(pos // ps, gtab.shape[1] - 1), axis=1)
    l_idx = jnp.minimum((pos // ps) % ring_pages, ltab.shape[1] - 1)
    l_page = jnp.take_along_axis(ltab, l_idx, axis=1)
    out = {}
    for kind, ids, page in (("global", cfg.global_layers, g_page), ("local", cfg.local_layers, l_page)):
        ids = jnp.asarray(list(ids), jnp.int32)
        m = bm[ids][:, :, :width]  # [Lk, B, width]
        pg, o = jnp.where(m, page[None], SCRATCH_PAGE), jnp.where(m, off[None], 0)
        li = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None, None]
        out[kind] = [pool.at[li, pg, o].set(b[ids][:, :, :width].astype(pool.dtype))
                     for pool, b in ((getattr(kv, f"{kind}_k"), bk), (getattr(kv, f"{kind}_v"), bv))]
    return KVState(*out["global"], *out["local"])


def kv_weights(cfg: ModelConfig, lp: dict) -> dict:
    """What propagation reads of one layer: its K/V projection sliced once, outside jit."""
    if "qkv" in lp:
        w = lp["qkv"][:, cfg.q_dim:]
    else:
        w = jnp.concatenate([lp["k"], lp["v"]], axis=-1)
    return {"attn_norm": lp["attn_norm"], "k_norm": lp["k_norm"], "kv": jnp.asarray(w)}


def pad(a: np.ndarray, n: int, fill) -> np.ndarray:
    """a [m, ...] padded with `fill` to [n, ...]."""
    a = np.asarray(a)
    out = np.full((n, *a.shape[1:]), fill, a.dtype)
    out[: len(a)] = a[:n]
    return out


def sub_batch(full: Batch, rows: np.ndarray, nb: int) -> Batch:
    """The rows of `full` as a batch of nb (padding rows: row 0's tables, no new tokens)."""
    idx = pad(rows, nb, 0)
    real = np.arange(nb) < len(rows)
    return Batch(np.asarray(full.tokens)[idx], np.asarray(full.start)[idx],
                 np.where(real, np.asarray(full.n_new)[idx], 0).astype(np.int32),
                 np.asarray(full.global_table)[idx], np.asarray(full.local_table)[idx])
