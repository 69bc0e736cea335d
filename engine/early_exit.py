"""Early exit with a compacting batch: an opt-in, LOSSY experiment (issue 19, question 4).

Not part of serving: nothing in the engine's step imports this module. It
answers whether rows that leave a decode step early can make the rest of the
step cheaper, on the paged KV pool of engine/kv.py and the model functions of
engine/model.py. One decode step of a batch of B rows, exit points k_1 < ... :

1. Stage 0 runs layers [0, k_1) for all B rows (reading the paged cache), then
   the exit adapter of engine/heads.py over the draft vocabulary: each row's
   token and confidence (max softmax probability, or top-1 minus top-2).
2. The host reads the confidences. Rows with confidence >= threshold emit the
   exit token; the others are gathered into the smallest power-of-two bucket
   that holds them (padding rows write nowhere) and run the next stage.
3. Exited rows get their upper layers' K/V by state propagation (CALM): for
   each skipped layer j, K/V = rope(k_norm(rms_norm(x_k, attn_norm_j) @ W_kv_j))
   from the exit layer's residual x_k: only the K/V projections run.
4. The last stage runs the remaining layers and the full output layer
   (engine.runner.output_scores, as the engine scores) for rows still in.
5. Every stage scatters its rows' new K/V into a per-layer buffer [L, B, KV, hd];
   one donated call writes the buffer into the pages (engine.kv.write_new).

Compiled shapes: each stage and each propagation per power-of-two bucket,
the write per B. Never exiting (threshold = inf) is the full model through
the same stages; `plain` runs the engine's own forward for comparison.
The exited rows' tokens come from the draft vocabulary only; their later
tokens attend to propagated K/V: the output differs from the full model's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.heads import DraftHeads, apply_head, head_logits
from engine.kv import Batch, KVState, cache_reader, write_new
from engine.model import Params, block, embed, rms_norm, rope, unstack_layers
from engine.runner import forward_and_write, output_scores

NEVER = math.inf
"""A threshold no confidence reaches: the full model through the compacting stages."""


def pow2_bucket(n: int) -> int:
    """Smallest power of two >= n (n >= 1). Example: pow2_bucket(5) == 8."""
    return 1 << max(0, (n - 1).bit_length())


def kind_index(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """("global" | "local", index among the layers of that kind), as the KV pools order them."""
    kinds = cfg.global_layers if cfg.is_global(layer) else cfg.local_layers
    return ("global" if cfg.is_global(layer) else "local"), kinds.index(layer)


def _rope_args(cfg: ModelConfig, layer: int) -> tuple[float, float]:
    if cfg.is_global(layer):
        return cfg.rope_base_global, cfg.rope_scale_global
    return cfg.rope_base_local, 1.0


@partial(jax.jit, static_argnames=("cfg", "ring_pages", "lo", "hi", "confidence", "score"),
         donate_argnames=("bk", "bv"))
def _stage(cfg: ModelConfig, ring_pages: int, lo: int, hi: int, confidence: str, score: bool,
           layers, top, kv: KVState, batch: Batch, x, bk, bv, rows, target):
    """Layers [lo, hi) for n rows, then the exit adapter (hi < L) or the output layer (hi == L).

    x: [n, 1, d] residual entering layer lo (ignored when lo == 0: tokens are embedded);
    bk, bv: [L, B, KV, hd] new-K/V buffers (donated), this stage's rows scattered at `rows` [n]
    (B = padding, dropped); target: [n] token whose log-probability to return when `score`.
    Returns (x [n, 1, d], tokens [n], confidence [n], logprob [n], bk, bv).
    """
    pos = batch.positions()
    if lo == 0:
        x = embed(cfg, top, batch.tokens)
    read = cache_reader(kv, batch, ring_pages)
    for j, lp in enumerate(layers):
        kind, idx = kind_index(cfg, lo + j)
        x, (k, v) = block(cfg, lp, x, pos, read(kind, idx), kind == "global")
        bk = bk.at[lo + j, rows].set(k[:, 0].astype(bk.dtype), mode="drop")
        bv = bv.at[lo + j, rows].set(v[:, 0].astype(bv.dtype), mode="drop")
    h = rms_norm(x, top["final_norm"], cfg.rms_eps)  # [n, 1, d]
    lp_out = jnp.zeros(x.shape[:1], jnp.float32)
    if hi == cfg.n_layers:
        tok, conf = output_scores(top, h).best[:, 0], jnp.ones(x.shape[:1], jnp.float32)
        if score:
            full = jnp.einsum("nd,vd->nv", h[:, 0], top["embed"], preferred_element_type=jnp.float32)
            lp_out = _logprob_at(full, target)
        return x, tok, conf, lp_out, bk, bv
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
    return x, tok, conf, lp_out, bk, bv


def _logprob_at(lg: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(lg, axis=-1), target[:, None], axis=-1)[:, 0]


def propagate_kv(cfg: ModelConfig, lo: int, kvw: list[dict], x: jax.Array, pos: jax.Array):
    """CALM state propagation: K/V of layers lo.. from one residual x [n, T, d] at pos [n, T].

    kvw[j]: {"attn_norm" [d], "k_norm" [hd], "kv" [d, 2 kv_dim]} of layer lo + j: exactly the
    keys and values `engine.model.block` computes when x enters that layer. Returns a list of
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


@partial(jax.jit, static_argnames=("cfg", "lo"), donate_argnames=("bk", "bv"))
def _propagate(cfg: ModelConfig, lo: int, kvw, x, pos, bk, bv, rows):
    """propagate_kv for exited rows, scattered into the K/V buffers at `rows` (B = padding)."""
    for j, (k, v) in enumerate(propagate_kv(cfg, lo, kvw, x, pos)):
        bk = bk.at[lo + j, rows].set(k[:, 0].astype(bk.dtype), mode="drop")
        bv = bv.at[lo + j, rows].set(v[:, 0].astype(bv.dtype), mode="drop")
    return bk, bv


@partial(jax.jit, static_argnames=("cfg", "ring_pages"), donate_argnames=("kv",))
def _write_buffers(cfg: ModelConfig, ring_pages: int, kv: KVState, batch: Batch, bk, bv) -> KVState:
    """The step's K/V buffers [L, B, KV, hd] into the pages (write_new wants [L_kind, B, 1, KV, hd])."""
    new = {}
    for kind, ids in (("global", list(cfg.global_layers)), ("local", list(cfg.local_layers))):
        new[kind] = (bk[jnp.asarray(ids, jnp.int32)][:, :, None], bv[jnp.asarray(ids, jnp.int32)][:, :, None])
    return write_new(kv, batch, new, ring_pages)


@dataclass
class Run:
    """What one decode run produced (step 0 is the prefill's token, from the full model)."""

    tokens: np.ndarray  # [B, N] int32 the token predicted at each step
    layers_run: np.ndarray  # [B, N] int32 layers each token took (cfg.n_layers: not exited)
    logprob: np.ndarray | None  # [B, N] float32 log-probability of the fed token (feed runs)
    decode_s: float  # wall time of the N - 1 decode steps
    kv: KVState  # the pages after the run
    tables: tuple[np.ndarray, np.ndarray]  # (global [B, P], local [B, R]) page tables of the rows


class EarlyExit:
    """A compacting early-exit decoder over one model, its exit adapters and a paged KV pool.

    `exits`: exit points (layers run before each adapter), ascending, each in heads.exits.
    `exit_vocab`: draft-vocabulary ids the adapters score (0: the whole vocabulary).
    """

    def __init__(self, cfg: ModelConfig, params: Params, heads: DraftHeads, exits: tuple[int, ...],
                 exit_vocab: int = 8192, confidence: str = "prob", page_size: int = 16):
        if not exits or list(exits) != sorted(set(exits)) or any(k not in heads.exits for k in exits):
            raise ValueError(f"exits {exits} must be ascending exit points of the adapters "
                             f"{sorted(heads.exits)}")
        if confidence not in ("prob", "margin"):
            raise ValueError(f"confidence must be 'prob' or 'margin', got {confidence!r}")
        self.cfg, self.exits, self.confidence, self.page_size = cfg, tuple(exits), confidence, page_size
        self.params = unstack_layers(params)
        p, L = self.params, cfg.n_layers
        n = exit_vocab if 0 < exit_vocab < min(heads.vocab.size + 1, cfg.vocab_size) else 0
        ids = jnp.asarray(heads.vocab[:n] if n else np.arange(cfg.vocab_size), jnp.int32)
        self.exit_vocab = int(ids.shape[0])
        base = {k: v for k, v in p.items() if k != "layers"}
        self.bounds = (0, *self.exits, L)
        sub = jnp.take(p["embed"], ids, axis=0)
        self.tops = [{**base, "head": heads.exits[k], "embed_sub": sub, "ids": ids} for k in self.exits]
        self.tops.append(base)  # the last stage: the full output layer
        self.kvw = [_kv_weights(cfg, lp) for lp in p["layers"]]

    # -- one decode step -----------------------------------------------------------------------
    def step(self, st: "_State", tokens: np.ndarray, threshold: float, target: np.ndarray | None):
        """Decode one token for every row of `st`: (tokens [B], layers run [B], logprob [B])."""
        B, L = len(tokens), self.cfg.n_layers
        full = Batch(tokens[:, None], st.start, st.n_new, st.gtab, st.ltab)
        out_tok, out_layers = np.zeros(B, np.int32), np.full(B, L, np.int32)
        out_lp = np.zeros(B, np.float32)
        rows, x = np.arange(B), None
        tgt = np.zeros(B, np.int32) if target is None else target
        for s, top in enumerate(self.tops):
            lo, hi = self.bounds[s], self.bounds[s + 1]
            nb = pow2_bucket(len(rows))
            sub, prow = _sub_batch(full, rows, nb, B), _pad(rows, nb, B)
            x_in = None if x is None else _pad_rows(x, nb)
            x_out, tok, conf, lp, st.bk, st.bv = _stage(
                self.cfg, st.ring, lo, hi, self.confidence, target is not None, self.params["layers"][lo:hi],
                top, st.kv, sub, x_in, st.bk, st.bv, prow, _pad(tgt[rows], nb, 0))
            n = len(rows)
            tok, conf = np.asarray(tok)[:n], np.asarray(conf)[:n]
            lp = np.asarray(lp)[:n] if target is not None else lp
            ex = conf >= threshold if hi < L else np.ones(n, bool)
            out_tok[rows[ex]], out_layers[rows[ex]] = tok[ex], hi
            if target is not None:
                out_lp[rows[ex]] = lp[ex]
            if hi < L and ex.any():
                xe = np.asarray(x_out)[:n][ex]
                ne = pow2_bucket(len(xe))
                pos = _pad(st.start[rows[ex]], ne, -1)[:, None].astype(np.int32)
                st.bk, st.bv = _propagate(self.cfg, hi, self.kvw[hi:], _pad_rows(xe, ne), pos, st.bk, st.bv,
                                          _pad(rows[ex], ne, B))
            keep = ~ex
            if not keep.any():
                break
            x, rows = np.asarray(x_out)[:n][keep], rows[keep]
        st.kv = _write_buffers(self.cfg, st.ring, st.kv, full, st.bk, st.bv)
        st.start = st.start + 1
        return out_tok, out_layers, out_lp

    # -- whole runs ------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], new_tokens: int, threshold: float = NEVER,
            feed: np.ndarray | None = None, plain: bool = False) -> Run:
        """Greedy decode `new_tokens` per prompt (the first from the prefill).

        feed [B, N]: feed these tokens instead of the predicted ones (teacher forcing) and
        return the log-probability each step gives the fed token. plain: the engine's
        forward (engine.runner.forward_and_write) instead of the stages.
        """
        B, N = len(prompts), new_tokens
        st, first = self._prefill(prompts, N)
        toks, layers = np.zeros((B, N), np.int32), np.full((B, N), self.cfg.n_layers, np.int32)
        lps = np.zeros((B, N), np.float32) if feed is not None else None
        toks[:, 0] = first
        jax.block_until_ready(st.kv)
        t0 = time.perf_counter()
        for t in range(1, N):
            inp = (feed[:, t - 1] if feed is not None else toks[:, t - 1]).astype(np.int32)
            tgt = feed[:, t].astype(np.int32) if feed is not None else None
            if plain:
                toks[:, t] = self._plain_step(st, inp)
                continue
            toks[:, t], layers[:, t], lp = self.step(st, inp, threshold, tgt)
            if lps is not None:
                lps[:, t] = lp
        jax.block_until_ready(st.kv)
        return Run(toks, layers, lps, time.perf_counter() - t0, st.kv, (st.gtab, st.ltab))

    def _plain_step(self, st: "_State", inp: np.ndarray) -> np.ndarray:
        batch = Batch(inp[:, None], st.start, st.n_new, st.gtab, st.ltab)
        st.kv, sc, _ = forward_and_write(self.cfg, st.ring, self.params, st.kv, batch,
                                         np.zeros((len(inp), 1), np.int32))
        st.start = st.start + 1
        return np.asarray(sc.best)[:, 0]

    def _prefill(self, prompts: list[list[int]], new_tokens: int) -> tuple["_State", np.ndarray]:
        """Pages for each row and one batched prefill of the prompts through the full model."""
        B, ps = len(prompts), self.page_size
        lens = np.array([len(p) for p in prompts], np.int32)
        T = pow2_bucket(int(lens.max()))
        P = -(-(int(lens.max()) + new_tokens) // ps)
        # Ring: the window plus the new token, and the whole prompt chunk (R == P: it never wraps).
        R = min(P, max(-(-self.cfg.sliding_window // ps) + 1, -(-T // ps)))
        gtab = 1 + np.arange(B * P, dtype=np.int32).reshape(B, P)  # page 0 is scratch
        ltab = 1 + np.arange(B * R, dtype=np.int32).reshape(B, R)
        dtype = self.params["embed"].dtype
        kv = KVState.create(self.cfg, 1 + B * P, 1 + B * R, ps, dtype)
        tokens = np.zeros((B, T), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        batch = Batch(tokens, np.zeros(B, np.int32), lens, gtab, ltab)
        kv, sc, _ = forward_and_write(self.cfg, R, self.params, kv, batch, (lens - 1)[:, None])
        bk = jnp.zeros((self.cfg.n_layers, B, self.cfg.n_kv_heads, self.cfg.head_dim), dtype)
        st = _State(kv, gtab, ltab, lens.copy(), np.ones(B, np.int32), R, bk, bk.copy())
        return st, np.asarray(sc.best)[:, 0]

    def warm(self, batch: int, prompt_len: int, new_tokens: int, score: bool = False,
             reps: int = 0) -> dict[str, float]:
        """Compile every shape a run of `batch` rows may take: each stage and propagation at each
        power-of-two bucket up to `batch` (padding rows only: nothing is written).

        reps > 0: also time each call (fastest of `reps`, ms), keyed "stage{s}@{rows}",
        "propagate{k}@{rows}", "write@{B}", "plain@{B}"; the step's parts in isolation.
        """
        st, _ = self._prefill([[self.cfg.bos_id] * prompt_len] * batch, new_tokens)
        B, L = batch, self.cfg.n_layers
        full = Batch(np.zeros((B, 1), np.int32), st.start, np.zeros(B, np.int32), st.gtab, st.ltab)
        x = np.zeros((1, 1, self.cfg.d_model), np.asarray(self.params["final_norm"]).dtype)
        top_b, ms = pow2_bucket(B), {}

        def timed(key, fn, state):
            """fn(state) once (it compiles), then `reps` times timed; the last state."""
            state = fn(state)
            for _ in range(reps):
                t0 = time.perf_counter()
                state = jax.block_until_ready(fn(state))
                ms[key] = min(ms.get(key, math.inf), 1e3 * (time.perf_counter() - t0))
            return state

        for nb in (1 << i for i in range(top_b.bit_length())):
            rows, pad = np.arange(nb) % B, np.full(nb, B, np.int32)
            x_nb, tail = _pad_rows(x, nb), (pad, np.zeros(nb, np.int32))
            for s, top in enumerate(self.tops):
                lo, hi = self.bounds[s], self.bounds[s + 1]
                if s > 0 or nb == top_b:  # the first stage always runs the whole batch
                    args = (self.cfg, st.ring, lo, hi, self.confidence, score, self.params["layers"][lo:hi],
                            top, st.kv, _sub_batch(full, rows, nb, B), None if s == 0 else x_nb)
                    st.bk, st.bv = timed(f"stage{s}@{nb}", lambda o: _stage(*args, *o, *tail)[4:],  # noqa: B023
                                         (st.bk, st.bv))
                if hi < L:  # any number of a stage's rows may exit
                    pargs = (self.cfg, hi, self.kvw[hi:], x_nb, np.full((nb, 1), -1, np.int32))
                    st.bk, st.bv = timed(f"propagate{hi}@{nb}", lambda o: _propagate(*pargs, *o, pad),  # noqa: B023
                                         (st.bk, st.bv))
        st.kv = timed(f"write@{B}", lambda o: _write_buffers(self.cfg, st.ring, o, full, st.bk, st.bv), st.kv)
        timed(f"plain@{B}", lambda o: self._plain_step(st, np.zeros(B, np.int32)), None)
        jax.block_until_ready(st.kv)
        return ms


@dataclass
class _State:
    """Device and host state of one run."""

    kv: KVState
    gtab: np.ndarray  # [B, P] int32
    ltab: np.ndarray  # [B, R] int32
    start: np.ndarray  # [B] int32 tokens cached per row
    n_new: np.ndarray  # [B] int32 ones
    ring: int  # ring pages per row
    bk: jax.Array  # [L, B, KV, hd] this step's new keys
    bv: jax.Array


def _kv_weights(cfg: ModelConfig, lp: dict) -> dict:
    """What propagation reads of one layer: its K/V projection sliced once, outside jit."""
    if "qkv" in lp:
        w = lp["qkv"][:, cfg.q_dim:]
    else:
        w = jnp.concatenate([lp["k"], lp["v"]], axis=-1)
    return {"attn_norm": lp["attn_norm"], "k_norm": lp["k_norm"], "kv": jnp.asarray(w)}


def _pad(a: np.ndarray, n: int, fill) -> np.ndarray:
    """a [m] padded with `fill` to [n]."""
    out = np.full((n, *a.shape[1:]), fill, np.asarray(a).dtype)
    out[: len(a)] = a
    return out


def _pad_rows(x: np.ndarray, n: int) -> np.ndarray:
    """x [m, ...] padded with zero rows to [n, ...]."""
    x = np.asarray(x)
    out = np.zeros((n, *x.shape[1:]), x.dtype)
    out[: len(x)] = x[:n]
    return out


def _sub_batch(full: Batch, rows: np.ndarray, nb: int, B: int) -> Batch:
    """The rows of `full` as a batch of nb (padding rows: row 0's tables, no new tokens)."""
    idx = _pad(rows, nb, 0)
    real = np.arange(nb) < len(rows)
    return Batch(np.asarray(full.tokens)[idx], np.asarray(full.start)[idx],
                 np.where(real, np.asarray(full.n_new)[idx], 0).astype(np.int32),
                 np.asarray(full.global_table)[idx], np.asarray(full.local_table)[idx])
