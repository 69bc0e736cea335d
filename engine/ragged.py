"""One forward over a flat token axis: every token of a step, of any row, in one call.

A step's tokens (decode rows, verify rows of any depth, prefill chunks of several prompts) lie
on one axis of N slots; each token carries its row and position, each row its page tables and
how many of its tokens are cached. The shapes are N, the row slots S and the tables' widths; a
caller that picks S from N and the widths from its maximum context compiles one executable per
N, which serves every mix of rows that fits N tokens.

Attention for each token merges three partial softmaxes (running max, sum, weighted values):

1. the step's own keys: a dense [N, N] pass, visible when the key is of the same row at a
   position no later than the query's (and inside the window for a sliding layer);
2. the cache of rows with one new token (decode): per token, block by block;
3. the cache of rows with several new tokens (verify, prefill): the row's tokens in groups of
   up to GROUP consecutive queries, each group reading its row's cache block by block.

The cache reads of 2. and 3. are lists of work items, one per (query group, cache block) pair
that holds keys, built on the host (`RaggedBatch.build`) with each block's page ids and the
position each of its slots holds (the same for every layer of a kind, so no layer computes
them). A loop walks them a chunk at a time (one item per group per iteration), so a call reads
only blocks that hold cached keys and its cost follows the real context of each row, never the
table width. A decode token alone in a
group of one wastes no score compute; a prompt chunk reads each block once per GROUP queries.

The cache is read as it was before the call; the new keys and values come back per layer for
`write`, which scatters them into their pages afterwards (a separate call: see
engine/runner.py `_write` for why XLA:CPU wants it apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.kv import SCRATCH_PAGE, Batch, KVState, write_new
from engine.model import _NEG, Params, _after_attention, attention_inputs, embed, rms_norm

GROUP = 8
"""Queries of one row that share a cache read (a verify row of depth 7 is one group)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Items:
    """Cache reads of one class of query groups (single tokens or groups of GROUP) for one kind
    of layer: item i reads `pages[i]` for group `group[i]`, whose slots hold positions `kpos[i]`
    (-1: empty); `count` of them are real. Built on the host, the same for every layer of the kind."""

    group: jax.Array  # [W] int32
    pages: jax.Array  # [W, block // page_size] int32
    kpos: jax.Array  # [W, block] int32
    count: jax.Array  # [] int32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Groups:
    """Query groups of one class: the flat token index of each query (-1: none) and the row."""

    tokens: jax.Array  # [M, Q] int32
    row: jax.Array  # [M] int32
    global_items: Items
    local_items: Items


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedBatch:
    """One call's tokens on a flat axis and the rows they belong to."""

    tokens: jax.Array  # [N] int32 (padding: 0)
    row: jax.Array  # [N] int32 row of each token (padding: 0)
    pos: jax.Array  # [N] int32 position of each token (padding: -1)
    cached: jax.Array  # [S] int32 tokens of the row already in the cache
    global_table: jax.Array  # [S, Pg] int32 global page ids in logical order (0: scratch)
    local_table: jax.Array  # [S, Pl] int32 ring page ids by ring entry
    single: Groups  # rows with one new token and a cache: one group per token
    multi: Groups  # rows with several new tokens and a cache: groups of up to GROUP

    @staticmethod
    def build(rows, n_tokens: int, n_rows: int, global_width: int, local_width: int, page_size: int,
              ring_pages: int, block: int) -> RaggedBatch:
        """Host arrays for `rows`: (new token ids, tokens cached, global pages, ring pages) each.

        n_tokens, n_rows: the call's token slots and row slots (the call's shape);
        global_width, local_width: page-table widths in pages (padded to whole blocks here);
        block: cache slots per work item, a multiple of page_size.
        """
        if len(rows) > n_rows:
            raise ValueError(f"{len(rows)} rows exceed the call's {n_rows}")
        total = sum(len(r[0]) for r in rows)
        if total > n_tokens:
            raise ValueError(f"{total} tokens exceed the call's {n_tokens}")
        per = block // page_size
        gw, lw = -(-global_width // per) * per, -(-local_width // per) * per
        tokens = np.zeros(n_tokens, np.int32)
        row = np.zeros(n_tokens, np.int32)
        pos = np.full(n_tokens, -1, np.int32)
        cached = np.zeros(n_rows, np.int32)
        gt = np.full((n_rows, gw), SCRATCH_PAGE, np.int32)
        lt = np.full((n_rows, lw), SCRATCH_PAGE, np.int32)
        single: list[tuple[list[int], int]] = []
        multi: list[tuple[list[int], int]] = []
        at = 0
        for r, (new, start, gpages, ring) in enumerate(rows):
            n = len(new)
            if n == 0:
                raise ValueError(f"row {r} has no new token")
            if len(gpages) > global_width or len(ring) > local_width:
                raise ValueError(f"row {r} holds more pages than the tables' widths")
            tokens[at: at + n] = new
            row[at: at + n] = r
            pos[at: at + n] = np.arange(start, start + n)
            cached[r] = start
            gt[r, : len(gpages)] = gpages
            lt[r, : len(ring)] = ring
            if start:
                idx = list(range(at, at + n))
                if n == 1:
                    single.append((idx, r))
                else:
                    multi += [(idx[i: i + GROUP], r) for i in range(0, n, GROUP)]
            at += n
        ring_slots = ring_pages * page_size

        def groups(found, width: int, m: int) -> Groups:
            if len(found) > m:
                raise ValueError(f"{len(found)} query groups exceed the call's {m}")
            toks = np.full((m, width), -1, np.int32)
            grow = np.zeros(m, np.int32)
            for g, (idx, r) in enumerate(found):
                toks[g, : len(idx)] = idx
                grow[g] = r

            def items(table: np.ndarray, ring: int) -> Items:
                width_pages = table.shape[1]
                w = m * (width_pages // per)
                gi = np.zeros(w, np.int32)
                pages = np.zeros((w, per), np.int32)
                kpos = np.full((w, block), -1, np.int32)
                at = 0
                for g, (_, r) in enumerate(found):
                    last = cached[r] - 1
                    held = min(ring, cached[r]) if ring else cached[r]
                    nb = -(-min(held, width_pages * page_size) // block)
                    slots = np.arange(nb * block)
                    if ring:
                        p = np.where(slots < ring, last - np.mod(last - slots, ring), -1)
                    else:
                        p = np.where(slots <= last, slots, -1)
                    gi[at: at + nb] = g
                    pages[at: at + nb] = table[r, : nb * per].reshape(nb, per)
                    kpos[at: at + nb] = np.where(p >= 0, p, -1).reshape(nb, block)
                    at += nb
                return Items(gi, pages, kpos, np.int32(at))

            return Groups(toks, grow, items(gt, 0), items(lt, ring_slots))

        m_single, m_multi = call_groups(n_tokens, n_rows)
        return RaggedBatch(tokens, row, pos, cached, gt, lt, groups(single, 1, m_single),
                           groups(multi, GROUP, m_multi))


def call_groups(n_tokens: int, n_rows: int) -> tuple[int, int]:
    """Query groups a call of n_tokens slots and n_rows rows makes room for: one per row with a
    single token, and for rows with several, one per GROUP of their tokens plus one per row
    (a row's last group may be partial)."""
    return n_rows, min(n_tokens, n_rows + n_tokens // GROUP)


def _visible(kp, qp, window):
    """[..., S, Q] keys at kp [..., S] visible to queries at qp [..., Q] (-1 on either: none)."""
    kp, qp = kp[..., :, None], qp[..., None, :]
    mask = (kp >= 0) & (qp >= 0) & (kp <= qp)
    if window is not None:
        mask &= (qp - kp) < window
    return mask


def _merge(parts):
    """Combine partial softmaxes [(m [..], l [..], acc [.., hd])] into attention outputs."""
    m = parts[0][0]
    for p in parts[1:]:
        m = jnp.maximum(m, p[0])
    l = sum(pl * jnp.exp(pm - m) for pm, pl, _ in parts)
    acc = sum(pa * jnp.exp(pm - m)[..., None] for pm, _, pa in parts)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _own_keys(cfg: ModelConfig, q, k, v, row, pos, window):
    """Partial softmax of every token over the step's own keys of its row: [N, KV, G] m and l,
    [N, KV, G, hd] acc."""
    s = jnp.einsum("nkgd,mkd->nkgm", q, k, preferred_element_type=jnp.float32)
    s = s * (cfg.query_pre_attn_scalar ** -0.5)
    mask = _visible(pos, pos, window).T & (row[:, None] == row[None, :])  # [N(q), N(k)]
    mask = mask[:, None, None, :]
    s = jnp.where(mask, s, _NEG)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("nkgm,mkd->nkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(-1), acc


def _cached(cfg: ModelConfig, q, pos, groups: Groups, items: Items, pool_k, pool_v, layer: int, block: int,
            window):
    """Partial softmax of the grouped queries over their rows' caches, read item by item.
    Returns per-token [N, KV, G] m, l and [N, KV, G, hd] acc (tokens in no group: empty)."""
    N, KV, G, hd = q.shape
    M, Q = groups.tokens.shape
    idx = jnp.maximum(groups.tokens, 0)
    qg = q[idx].transpose(0, 2, 1, 3, 4).reshape(M, KV, Q * G, hd)  # [M, KV, (q, g), hd]
    qp = jnp.where(groups.tokens >= 0, pos[idx], -1)  # [M, Q]
    qp = jnp.repeat(qp, G, axis=1)  # [M, Q*G] in (q, g) order
    W = items.group.shape[0]
    chunk = min(M, W)
    scale = cfg.query_pre_attn_scalar ** -0.5

    def body(c, carry):
        gm, gl, gacc = carry
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk)
        g, pages, kp = sl(items.group), sl(items.pages), sl(items.kpos)  # [C], [C, per], [C, B]
        k = pool_k[layer, pages].reshape(chunk, block, KV, hd).transpose(0, 2, 1, 3)  # [C, KV, B, hd]
        v = pool_v[layer, pages].reshape(chunk, block, KV, hd).transpose(0, 2, 1, 3)
        mask = _visible(kp, qp[g], window)  # [C, B, QG]; padding items hold no position
        mask = mask[:, None]  # [C, 1, B, QG]
        s = jnp.einsum("ckbd,ckqd->ckbq", k.astype(qg.dtype), qg[g], preferred_element_type=jnp.float32)
        s = s * scale
        s = jnp.where(mask, s, _NEG)
        im = s.max(2)  # [C, KV, QG]
        p = jnp.where(mask, jnp.exp(s - im[:, :, None, :]), 0.0)
        il = p.sum(2)
        iacc = jnp.einsum("ckbq,ckbd->ckqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        nm = gm.at[g].max(im)
        fix = jnp.exp(gm - nm)
        w = jnp.exp(im - nm[g])
        return nm, (gl * fix).at[g].add(il * w), (gacc * fix[..., None]).at[g].add(iacc * w[..., None])

    init = (jnp.full((M, KV, Q * G), _NEG, jnp.float32), jnp.zeros((M, KV, Q * G), jnp.float32),
            jnp.zeros((M, KV, Q * G, hd), jnp.float32))
    gm, gl, gacc = jax.lax.fori_loop(0, (items.count + chunk - 1) // chunk, body, init)

    def to_tokens(a, fill):  # [M, KV, Q*G, ...] -> [N, KV, G, ...], tokens outside every group: fill
        a = a.reshape(M, KV, Q, G, *a.shape[3:]).swapaxes(1, 2).reshape(M * Q, KV, G, *a.shape[3:])
        dest = jnp.where(groups.tokens >= 0, groups.tokens, N).reshape(-1)
        out = jnp.full((N, KV, G, *a.shape[3:]), fill, a.dtype)
        return out.at[dest].set(a, mode="drop")

    return to_tokens(gm, _NEG), to_tokens(gl, 0.0), to_tokens(gacc, 0.0)


def attend(cfg: ModelConfig, q, k, v, rb: RaggedBatch, kv: KVState, kind: str, layer: int, block: int,
           window):
    """Attention of the step's queries q [N, H, hd] over their rows' caches and the step's own
    keys k, v [N, KV, hd]. Returns [N, H, hd]."""
    N, H, hd = q.shape
    KV = k.shape[1]
    q = q.reshape(N, KV, H // KV, hd)
    parts = [_own_keys(cfg, q, k, v, rb.row, rb.pos, window)]
    if kind == "global":
        pool_k, pool_v = kv.global_k, kv.global_v
    else:
        pool_k, pool_v = kv.local_k, kv.local_v
    for groups in (rb.single, rb.multi):
        items = groups.global_items if kind == "global" else groups.local_items
        parts.append(_cached(cfg, q, rb.pos, groups, items, pool_k, pool_v, layer, block, window))
    return _merge(parts).reshape(N, H, hd).astype(q.dtype)


def forward(cfg: ModelConfig, params: Params, kv: KVState, rb: RaggedBatch, block: int, capture=()):
    """All layers over the call's tokens. Returns (final-normed h [N, d], new K/V per kind
    {kind: (k, v) [layers_of_kind, N, KV, hd]}, hidden states after the `capture` layers)."""
    x = embed(cfg, params, rb.tokens)  # [N, d]
    N = x.shape[0]
    pos = rb.pos[None, :]  # attention_inputs takes [B, T]
    new = {"global": ([], []), "local": ([], [])}
    hidden = {}
    for i, lp in enumerate(params["layers"]):
        kind = "global" if cfg.is_global(i) else "local"
        q, k, v, window = attention_inputs(cfg, lp, x[None], pos, kind == "global")
        q, k, v = q[0], k[0], v[0]  # one batch row: the flat axis
        ks, vs = new[kind]
        a = attend(cfg, q, k, v, rb, kv, kind, len(ks), block, window)
        ks.append(k)
        vs.append(v)
        x = _after_attention(cfg, lp, x, a.reshape(N, cfg.q_dim))
        if i in capture:
            hidden[i] = x
    new_kv = {kind: (jnp.stack(ks) if ks else jnp.zeros((0, N, cfg.n_kv_heads, cfg.head_dim), x.dtype),
                     jnp.stack(vs) if vs else jnp.zeros((0, N, cfg.n_kv_heads, cfg.head_dim), x.dtype))
              for kind, (ks, vs) in new.items()}
    return rms_norm(x, params["final_norm"], cfg.rms_eps), new_kv, tuple(hidden[i] for i in capture)


def write(kv: KVState, rb: RaggedBatch, new_kv: dict, ring_pages: int) -> KVState:
    """Scatter the call's new keys and values into their pages (padding tokens: the scratch page):
    engine.kv.write_new with each token a row of one token, its row's page tables."""
    one = Batch(rb.tokens[:, None], jnp.maximum(rb.pos, 0), (rb.pos >= 0).astype(jnp.int32),
                rb.global_table[rb.row], rb.local_table[rb.row])
    per_row = {kind: (k[:, :, None], v[:, :, None]) for kind, (k, v) in new_kv.items()}  # [L, N, 1, KV, hd]
    return write_new(kv, one, per_row, ring_pages)
