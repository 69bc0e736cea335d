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

Parts 2. and 3. read the cache as engine.model.gemma.paged_softmax does for a padded batch, each
query group a row of its view: block by block with a running softmax. The groups of a class are
laid out longest cache first and read CHUNK groups at a time, each chunk only as far as its
own longest cache reaches, and only the chunks that hold a real group: a call's cost follows
its real groups and their real contexts, never its padded group slots or the table's width (a
short decode row beside a long prompt's chunk reads its own few blocks). A decode token alone
in a group of one wastes no score compute; a prompt chunk reads each block once per GROUP
queries. The local table's width is the ring (ring_pages entries).

On CPU, engine/kernels/attention.py computes the same attention as one custom call per layer
where it serves (`attend` dispatches to it): it reads the pool in place, so none of the loops
above run. The jnp parts are its reference and every other backend's path.

The cache is read in its state before the call; the new keys and values come back per layer for
`write`, which scatters them into their pages afterwards (a separate call: see
engine/execute/runner.py `_write` for why XLA:CPU wants it apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.kernels import attention as attention_kernel
from engine.memory.kv import SCRATCH_PAGE, Batch, KVState, write_new
from engine.model.gemma import (
    _NEG,
    ATTEND_BLOCK,
    PagedView,
    Params,
    _after_attention,
    attention_inputs,
    embed,
    paged_softmax,
    rms_norm,
)

GROUP = 8
"""Queries of one row that share a cache read (a verify row of depth 7 is one group)."""
CHUNK = 4
"""Query groups read together, block by block, as far as the longest of them reaches."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Groups:
    """Query groups of one class (single tokens, or up to GROUP tokens of one row): each group's
    flat token indices (-1: none) and row, real groups first, longest cache first, and for each
    flat token its index among the groups' queries, tokens.reshape(-1) (-1: in no group of this
    class)."""

    tokens: jax.Array  # [M, Q] int32
    row: jax.Array  # [M] int32
    src: jax.Array  # [N] int32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedBatch:
    """One call's tokens on a flat axis and the rows they belong to."""

    tokens: jax.Array  # [N] int32 (padding: 0)
    row: jax.Array  # [N] int32 row of each token (padding: 0)
    pos: jax.Array  # [N] int32 position of each token (padding: -1)
    cached: jax.Array  # [S] int32 tokens of the row already in the cache
    global_table: jax.Array  # [S, Pg] int32 global page ids in logical order (0: scratch)
    local_table: jax.Array  # [S, Pl] int32 ring page ids by ring entry, as read
    local_write: jax.Array  # [S, Pl] int32 ring page ids the new tokens are written to
    single: Groups  # rows with one new token and a cache: one group per token
    multi: Groups  # rows with several new tokens and a cache: groups of up to GROUP

    @staticmethod
    def build(rows, n_tokens: int, n_rows: int, global_width: int, local_width: int) -> RaggedBatch:
        """Host arrays for `rows`: (new token ids, tokens cached, global pages, ring pages[, ring
        pages written]) each; the pages written differ from those read where a prefix-cached ring
        entry got a new page on wrap (engine.memory.kv.KVPool.prepare); None or absent: the same.

        n_tokens, n_rows: the call's token slots and row slots (the call's shape);
        global_width, local_width: page-table widths in pages.
        """
        if len(rows) > n_rows:
            raise ValueError(f"{len(rows)} rows exceed the call's {n_rows}")
        total = sum(len(r[0]) for r in rows)
        if total > n_tokens:
            raise ValueError(f"{total} tokens exceed the call's {n_tokens}")
        tokens = np.zeros(n_tokens, np.int32)
        row = np.zeros(n_tokens, np.int32)
        pos = np.full(n_tokens, -1, np.int32)
        cached = np.zeros(n_rows, np.int32)
        gt = np.full((n_rows, global_width), SCRATCH_PAGE, np.int32)
        lt = np.full((n_rows, local_width), SCRATCH_PAGE, np.int32)
        lw = np.full((n_rows, local_width), SCRATCH_PAGE, np.int32)
        single: list[tuple[list[int], int]] = []
        multi: list[tuple[list[int], int]] = []
        at = 0
        for r, (new, start, gpages, ring, *written) in enumerate(rows):
            n = len(new)
            if n == 0:
                raise ValueError(f"row {r} has no new token")
            if len(gpages) > global_width or len(ring) > local_width:
                raise ValueError(f"row {r} holds more pages than the tables' widths")
            if n == 1:  # a decode row: scalar stores, no arange
                tokens[at], row[at], pos[at] = new[0], r, start
            else:
                tokens[at: at + n] = new
                row[at: at + n] = r
                pos[at: at + n] = np.arange(start, start + n)
            cached[r] = start
            gt[r, : len(gpages)] = gpages
            lt[r, : len(ring)] = ring
            write_ring = written[0] if written and written[0] is not None else ring
            if len(write_ring) != len(ring):
                raise ValueError(f"row {r} writes {len(write_ring)} ring pages but reads {len(ring)}")
            lw[r, : len(ring)] = write_ring
            if start:
                if n == 1:
                    single.append(([at], r, start))
                else:
                    idx = list(range(at, at + n))
                    multi += [(idx[i: i + GROUP], r, start) for i in range(0, n, GROUP)]
            at += n

        def groups(found, width: int, m: int) -> Groups:
            if len(found) > m:
                raise ValueError(f"{len(found)} query groups exceed the call's {m}")
            toks = np.full((m, width), -1, np.int32)
            grow = np.zeros(m, np.int32)
            src = np.full(n_tokens, -1, np.int32)
            found = sorted(found, key=lambda f: -f[2])  # longest cache first: see _cached
            for g, (idx, r, _) in enumerate(found):
                # idx is a run of consecutive token slots: slices, not an index array (numpy's
                # fancy indexing allocates iterator buffers on every call)
                a, k = idx[0], len(idx)
                toks[g, :k] = np.arange(a, a + k) if k > 1 else a
                grow[g] = r
                src[a: a + k] = np.arange(g * width, g * width + k) if k > 1 else g * width
            return Groups(toks, grow, src)

        m_single, m_multi = call_groups(n_tokens, n_rows)
        return RaggedBatch(tokens, row, pos, cached, gt, lt, lw, groups(single, 1, m_single),
                           groups(multi, GROUP, m_multi))


def call_groups(n_tokens: int, n_rows: int) -> tuple[int, int]:
    """Query groups a call of n_tokens slots and n_rows rows makes room for: one per row with a
    single token, and for rows with several, one per GROUP of their tokens plus one per row
    (a row's last group may be partial); none of those below 2 tokens."""
    return min(n_rows, n_tokens), (min(n_tokens, n_rows + n_tokens // GROUP) if n_tokens > 1 else 0)


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


def _cached(cfg: ModelConfig, q, pos, groups: Groups, table, cached, pool_k, pool_v, layer: int, ring: int,
            window, block: int, chunk: int):
    """Partial softmax of the grouped queries over their rows' caches: engine.model.gemma.paged_softmax
    with each group a row of the view, `chunk` groups at a time over the chunks holding a real
    group (they come first; each chunk reads as far as its own longest cache). Returns per-token
    [N, KV, G] m, l and [N, KV, G, hd] acc (tokens in no group: empty)."""
    N, KV, G, hd = q.shape
    M, Q = groups.tokens.shape
    C = min(chunk, M)
    Mp = -(-M // C) * C
    pad = lambda a, fill: jnp.pad(a, ((0, Mp - M),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)
    valid = groups.tokens[:, 0] >= 0
    idx = jnp.maximum(groups.tokens, 0)
    qt = pad(q[idx].transpose(0, 2, 4, 1, 3).reshape(M, KV, hd, Q * G), 0)  # [Mp, KV, hd, (q, g)]
    qp = pad(jnp.repeat(jnp.where(groups.tokens >= 0, pos[idx], -1), G, axis=1), -1)  # [Mp, Q*G]
    gtable = pad(jnp.where(valid[:, None], table[groups.row], SCRATCH_PAGE), SCRATCH_PAGE)
    last = pad(jnp.where(valid, cached[groups.row] - 1, -1), -1)

    def one(c, carry):
        at = c * C
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, at, C, axis=0)
        view = PagedView(pool_k, pool_v, layer, cut(gtable), cut(last), ring)
        got = paged_softmax(cfg, cut(qt), cut(qp), view, window, block=block)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, g, at, axis=0) for a, g in zip(carry, got))

    init = (jnp.full((Mp, KV, Q * G), _NEG, jnp.float32), jnp.zeros((Mp, KV, Q * G), jnp.float32),
            jnp.zeros((Mp, KV, Q * G, hd), jnp.float32))
    m, l, acc = (a[:M] for a in jax.lax.fori_loop(0, (valid.sum() + C - 1) // C, one, init))

    def to_tokens(a, fill):  # [M, KV, Q*G, ...] -> [N, KV, G, ...]
        a = a.reshape(M, KV, Q, G, *a.shape[3:]).swapaxes(1, 2).reshape(M * Q, KV, G, *a.shape[3:])
        got = a[jnp.maximum(groups.src, 0)]
        return jnp.where((groups.src >= 0).reshape(N, *(1,) * (got.ndim - 1)), got, fill)

    return to_tokens(m, _NEG), to_tokens(l, 0.0), to_tokens(acc, 0.0)


def attend(cfg: ModelConfig, q, k, v, rb: RaggedBatch, kv: KVState, kind: str, layer: int, block: int,
           window, chunk: int = CHUNK, kernel: bool = True):
    """Attention of the step's queries q [N, H, hd] over their rows' caches and the step's own
    keys k, v [N, KV, hd]. Returns [N, H, hd]. Where engine.kernels.attention serves the call (and
    `kernel`), one custom call computes it; else the jnp parts the module docstring describes."""
    N, H, hd = q.shape
    KV = k.shape[1]
    if kind == "global":
        pools, table, ring = (kv.global_k, kv.global_v), rb.global_table, 0
    else:
        pools, table, ring = (kv.local_k, kv.local_v), rb.local_table, rb.local_table.shape[1] * kv.page_size
    if kernel and attention_kernel.serves(q, k, v, *pools):  # CPU: one custom call instead of the loops below
        return attention_kernel.ragged_attention(
            q, k, v, rb.row, rb.pos, rb.cached, table, *pools, layer,
            scale=cfg.query_pre_attn_scalar ** -0.5, window=window, ring=ring).astype(q.dtype)
    q = q.reshape(N, KV, H // KV, hd)
    parts = [_own_keys(cfg, q, k, v, rb.row, rb.pos, window)]
    for groups in (rb.single, rb.multi):
        if groups.tokens.shape[0]:
            parts.append(_cached(cfg, q, rb.pos, groups, table, rb.cached, *pools, layer, ring, window,
                                 block, chunk))
    return _merge(parts).reshape(N, H, hd).astype(q.dtype)


@partial(jax.jit, static_argnames=("cfg", "kind", "block", "chunk"))
def _layer(cfg: ModelConfig, kind: str, block: int, chunk: int, lp: Params, x, rb: RaggedBatch, kv: KVState,
           layer):
    """One layer of `kind` over the call's tokens x [N, d], its pool index `layer` traced: every
    layer of a kind is then one trace and one lowered function that each layer calls, where
    unrolled they were 18 (tracing and lowering took most of a cached forward's start-up).
    Returns (x after the layer, its new k and v [N, KV, hd])."""
    q, k, v, window = attention_inputs(cfg, lp, x[None], rb.pos[None, :], kind == "global")
    q, k, v = q[0], k[0], v[0]  # one batch row: the flat axis
    a = attend(cfg, q, k, v, rb, kv, kind, layer, block, window, chunk)
    return _after_attention(cfg, lp, x, a.reshape(x.shape[0], cfg.q_dim)), k, v


def forward(cfg: ModelConfig, params: Params, kv: KVState, rb: RaggedBatch, capture=(),
            block: int = ATTEND_BLOCK, chunk: int = CHUNK):
    """All layers over the call's tokens. Returns (final-normed h [N, d], new K/V per kind
    {kind: (k, v) [layers_of_kind, N, KV, hd]}, hidden states after the `capture` layers)."""
    x = embed(cfg, params, rb.tokens)  # [N, d]
    N = x.shape[0]
    new = {"global": ([], []), "local": ([], [])}
    hidden = {}
    for i, lp in enumerate(params["layers"]):
        kind = "global" if cfg.is_global(i) else "local"
        ks, vs = new[kind]
        x, k, v = _layer(cfg, kind, block, chunk, lp, x, rb, kv, jnp.int32(len(ks)))
        ks.append(k)
        vs.append(v)
        if i in capture:
            hidden[i] = x
    new_kv = {kind: (jnp.stack(ks) if ks else jnp.zeros((0, N, cfg.n_kv_heads, cfg.head_dim), x.dtype),
                     jnp.stack(vs) if vs else jnp.zeros((0, N, cfg.n_kv_heads, cfg.head_dim), x.dtype))
              for kind, (ks, vs) in new.items()}
    return rms_norm(x, params["final_norm"], cfg.rms_eps), new_kv, tuple(hidden[i] for i in capture)


def write(kv: KVState, rb: RaggedBatch, new_kv: dict) -> KVState:
    """Scatter the call's new keys and values into their pages (padding tokens: the scratch page):
    engine.memory.kv.write_new with each token a row of one token, its row's page tables."""
    one = Batch(rb.tokens[:, None], jnp.maximum(rb.pos, 0), (rb.pos >= 0).astype(jnp.int32),
                rb.global_table[rb.row], rb.local_write[rb.row])
    per_row = {kind: (k[:, :, None], v[:, :, None]) for kind, (k, v) in new_kv.items()}  # [L, N, 1, KV, hd]
    return write_new(kv, one, per_row, rb.local_table.shape[1])
