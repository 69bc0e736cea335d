"""Early exit with a compacting batch: an opt-in, LOSSY experiment (issue 19, question 4).

Not part of serving: it lives in bench/, which the engine never imports. It
answers whether rows that leave a decode step early can make the rest of the
step cheaper, on the paged KV pool of engine/memory/kv.py and the model functions of
engine/model/gemma.py (jitted pieces in bench/early_exit_ops.py). One decode step of
a batch of B rows, exit points k_1 < ...:

1. Stage 0 runs layers [0, k_1) for all B rows (reading the paged cache), then
   the exit adapter of engine/speculation/heads.py over the draft vocabulary: each row's
   token and confidence (max softmax probability, or top-1 minus top-2).
2. The host reads the confidences. Rows with confidence >= threshold emit the
   exit token; the others are gathered into the smallest power-of-two bucket
   that holds them (padding rows write nowhere) and run the next stage.
3. An exited row's skipped layers need K/V at that position. `kv_fill`:
   - "propagate" (CALM): for each skipped layer j, K/V = rope(k_norm(
     rms_norm(x_k, attn_norm_j) @ W_kv_j)) from the exit layer's residual x_k:
     only the K/V projections run, at once.
   - "recompute" (later): nothing runs now; the row keeps the position and its
     residual x_k as pending. The next time the row enters a stage starting at
     layer k, its pending positions run that stage with the new token as one
     causal segment (cache slots at the segment's positions hidden, the
     segment's own keys used), so the upper layers never read a missing slot
     and the K/V they write are what the full model writes given the lower
     layers' states. Policy: at most `max_pending` (a power of two) positions
     pend per row; a row holding that many cannot exit (a forced full step).
     Segments pad to 1 + {0, 1, 2, 4, ...} tokens. Pending positions left when
     a run ends are never filled (nothing reads them).
4. The last stage runs the remaining layers and the full output layer
   (engine.execute.runner.output_scores, as the engine scores) for rows still in.
5. Every stage scatters its rows' new K/V into a window buffer [L, B, W, KV, hd]
   with a mask; one donated call writes the masked slots into the pages.

Compiled shapes: each stage per power-of-two row bucket (and segment bucket),
each propagation per row bucket, the write per B (and window bucket). Never
exiting (threshold = inf) is the full model through the same stages; `plain`
runs the engine's own forward for comparison. Exited rows' tokens come from
the draft vocabulary only: the output differs from the full model's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from bench.early_exit_ops import (
    kind_index,
    kv_weights,
    pad,
    pending_bucket,
    propagate,
    propagate_kv,
    stage,
    sub_batch,
    write_window,
)
from bench.padded import forward_and_write
from engine.config import ModelConfig
from engine.memory.kv import Batch, KVState
from engine.model.gemma import Params, unstack_layers
from engine.speculation.heads import DraftHeads
from engine.types import pow2_bucket

__all__ = ["FILLS", "NEVER", "EarlyExit", "Run", "kind_index", "pending_bucket", "pow2_bucket",
           "propagate_kv"]

NEVER = math.inf
"""A threshold no confidence reaches: the full model through the compacting stages."""

FILLS = ("propagate", "recompute")
"""How an exited row's skipped layers get their K/V: CALM state propagation now, or recompute later."""


@dataclass
class Run:
    """What one decode run produced (step 0 is the prefill's token, from the full model)."""

    tokens: np.ndarray  # [B, N] int32 the token predicted at each step
    layers_run: np.ndarray  # [B, N] int32 layers each token took (cfg.n_layers: not exited)
    logprob: np.ndarray | None  # [B, N] float32 log-probability of the fed token (feed runs)
    decode_s: float  # wall time of the N - 1 decode steps
    kv: KVState  # the pages after the run
    tables: tuple[np.ndarray, np.ndarray]  # (global [B, P], local [B, R]) page tables of the rows
    caught_up: int = 0  # pending positions later run through the upper layers (recompute)
    forced: int = 0  # row-steps kept from exiting because max_pending positions pended


class EarlyExit:
    """A compacting early-exit decoder over one model, its exit adapters and a paged KV pool.

    `exits`: exit points (layers run before each adapter), ascending, each in heads.exits.
    `exit_vocab`: draft-vocabulary ids the adapters score (0: the whole vocabulary).
    `max_pending`: positions a row may leave for recompute-later before a forced full step.
    """

    def __init__(self, cfg: ModelConfig, params: Params, heads: DraftHeads, exits: tuple[int, ...],
                 exit_vocab: int = 8192, confidence: str = "prob", page_size: int = 16, max_pending: int = 4):
        if not exits or list(exits) != sorted(set(exits)) or any(k not in heads.exits for k in exits):
            raise ValueError(f"exits {exits} must be ascending exit points of the adapters "
                             f"{sorted(heads.exits)}")
        if confidence not in ("prob", "margin"):
            raise ValueError(f"confidence must be 'prob' or 'margin', got {confidence!r}")
        if max_pending < 1 or max_pending & (max_pending - 1):
            raise ValueError(f"max_pending must be a power of two >= 1, got {max_pending}")
        self.cfg, self.exits, self.confidence, self.page_size = cfg, tuple(exits), confidence, page_size
        self.max_pending = max_pending
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
        self.kvw = [kv_weights(cfg, lp) for lp in p["layers"]]
        self.xdtype = np.asarray(p["final_norm"][:1]).dtype

    def segment_buckets(self, kv_fill: str) -> tuple[int, ...]:
        """Segment lengths (pending positions + the new token) an upper stage compiles for."""
        if kv_fill == "propagate":
            return (1,)
        return (1, *(1 + pending_bucket(1 << i) for i in range(self.max_pending.bit_length())))

    # -- one decode step -----------------------------------------------------------------------
    def step(self, st: _State, tokens: np.ndarray, threshold: float, target: np.ndarray | None):
        """Decode one token for every row of `st`: (tokens [B], layers run [B], logprob [B])."""
        B, L = len(tokens), self.cfg.n_layers
        full = Batch(tokens[:, None], st.start, st.n_new, st.gtab, st.ltab)
        m0 = st.pend_n.copy()  # pending positions at the step's start = the new token's window slot
        p0 = (st.start - m0).astype(np.int32)
        forced = m0 >= self.max_pending
        bm = jnp.zeros((L, B, st.width), bool)
        out_tok, out_layers = np.zeros(B, np.int32), np.full(B, L, np.int32)
        out_lp = np.zeros(B, np.float32)
        rows, xc = np.arange(B), None
        tgt = np.zeros(B, np.int32) if target is None else target
        for s, top in enumerate(self.tops):
            lo, hi = self.bounds[s], self.bounds[s + 1]
            n, nb = len(rows), pow2_bucket(len(rows))
            x, pos, slots, cur, e0 = self._segments(st, rows, lo, m0, p0, xc)
            x_out, tok, conf, lp, st.bk, st.bv, bm = stage(
                self.cfg, st.ring, lo, hi, self.confidence, target is not None, self.params["layers"][lo:hi],
                top, st.kv, sub_batch(full, rows, nb), None if x is None else pad(x, nb, 0),
                pad(pos, nb, -1), pad(slots, nb, st.width), pad(cur, nb, 0), st.bk, st.bv, bm,
                pad(rows, nb, B).astype(np.int32), pad(tgt[rows], nb, 0).astype(np.int32))
            tok, conf = np.asarray(tok)[:n], np.asarray(conf)[:n]
            ex = (conf >= threshold) & ~forced[rows] if hi < L else np.ones(n, bool)
            out_tok[rows[ex]], out_layers[rows[ex]] = tok[ex], hi
            if target is not None:
                out_lp[rows[ex]] = np.asarray(lp)[:n][ex]
            xo = np.asarray(x_out)[:n]  # [n, T, d]
            for i in np.nonzero(cur)[0]:  # segment entries advance to layer hi
                r = rows[i]
                st.pend_x[r, e0[i]:m0[r]], st.pend_d[r, e0[i]:m0[r]] = xo[i, :cur[i]], hi
            xc = xo[np.arange(n), cur]  # [n, d] the new token's residual
            if hi == L:
                st.caught_up += int(m0[rows].sum())
                st.forced += int(forced[rows].sum())
                st.pend_n[rows] = 0
            elif ex.any():
                bm = self._fill_exited(st, rows[ex], xc[ex], hi, m0, bm)
            keep = ~ex
            if not keep.any():
                break
            rows, xc = rows[keep], xc[keep]
        width = 1 + pending_bucket(int(m0.max()))
        st.kv = write_window(self.cfg, st.ring, width, st.kv, p0, st.gtab, st.ltab, st.bk, st.bv, bm)
        st.start = st.start + 1
        return out_tok, out_layers, out_lp

    def _segments(self, st: _State, rows: np.ndarray, lo: int, m0: np.ndarray, p0: np.ndarray, xc):
        """The rows' segments entering layer lo: pending positions stopped at lo, then the new token.

        Returns (x [n, T, d] or None at lo 0, pos [n, T], window slots [n, T], cur [n]: the new
        token's index = pending entries in the segment, e0 [n]: the first of them).
        """
        n = len(rows)
        if lo == 0:
            z = np.zeros(n, np.int32)
            return None, st.start[rows][:, None].astype(np.int32), m0[rows][:, None].astype(np.int32), z, z
        mine = (np.arange(self.max_pending)[None] < m0[rows][:, None]) & (st.pend_d[rows] == lo)
        c = mine.sum(axis=1).astype(np.int32)  # pending positions stopped at lo: a suffix of the row's
        e0 = m0[rows] - c
        T = 1 + pending_bucket(int(c.max()))
        t = np.arange(T, dtype=np.int32)[None]
        slot = e0[:, None] + t
        real = t <= c[:, None]
        pos = np.where(real, p0[rows][:, None] + slot, -1).astype(np.int32)
        slots = np.where(real, slot, st.width).astype(np.int32)
        x = np.zeros((n, T, xc.shape[-1]), xc.dtype)
        for i in np.nonzero(c)[0]:
            x[i, : c[i]] = st.pend_x[rows[i], e0[i]:m0[rows[i]]]
        x[np.arange(n), c] = xc
        return x, pos, slots, c, e0

    def _fill_exited(self, st: _State, rows: np.ndarray, xe: np.ndarray, hi: int, m0: np.ndarray, bm):
        """Rows that exited after layer hi (residual xe [n, d]): pend their position (recompute), or
        propagate their upper layers' K/V now. Returns the write mask bm."""
        if st.recompute:
            st.pend_x[rows, m0[rows]], st.pend_d[rows, m0[rows]] = xe, hi
            st.pend_n[rows] = m0[rows] + 1
            return bm
        ne, B = pow2_bucket(len(rows)), len(st.start)
        pos = pad(st.start[rows], ne, -1)[:, None].astype(np.int32)
        st.bk, st.bv, bm = propagate(self.cfg, hi, self.kvw[hi:], pad(xe[:, None], ne, 0), pos, st.bk, st.bv,
                                     bm, pad(rows, ne, B).astype(np.int32))
        return bm

    # -- whole runs ------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], new_tokens: int, threshold: float | Sequence[float] = NEVER,
            feed: np.ndarray | None = None, plain: bool = False, kv_fill: str = "propagate") -> Run:
        """Greedy decode `new_tokens` per prompt (the first from the prefill).

        threshold: one for every step, or one per step ([new_tokens]; entry 0 unused).
        feed [B, N]: feed these tokens instead of the predicted ones (teacher forcing) and
        return the log-probability each step gives the fed token. plain: the engine's
        forward (bench.padded.forward_and_write) instead of the stages.
        """
        if kv_fill not in FILLS:
            raise ValueError(f"kv_fill must be one of {FILLS}, got {kv_fill!r}")
        B, N = len(prompts), new_tokens
        thr = np.broadcast_to(np.asarray(threshold, np.float64), (N,))
        st, first = self._prefill(prompts, N, kv_fill == "recompute")
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
            toks[:, t], layers[:, t], lp = self.step(st, inp, float(thr[t]), tgt)
            if lps is not None:
                lps[:, t] = lp
        jax.block_until_ready(st.kv)
        return Run(toks, layers, lps, time.perf_counter() - t0, st.kv, (st.gtab, st.ltab), st.caught_up,
                   st.forced)

    def _plain_step(self, st: _State, inp: np.ndarray) -> np.ndarray:
        batch = Batch(inp[:, None], st.start, st.n_new, st.gtab, st.ltab)
        st.kv, sc, _ = forward_and_write(self.cfg, st.ring, self.params, st.kv, batch,
                                         np.zeros((len(inp), 1), np.int32))
        st.start = st.start + 1
        return np.asarray(sc.best)[:, 0]

    def _prefill(self, prompts: list[list[int]], new_tokens: int, recompute: bool = False
                 ) -> tuple[_State, np.ndarray]:
        """Pages for each row and one batched prefill of the prompts through the full model."""
        B, ps, cfg = len(prompts), self.page_size, self.cfg
        lens = np.array([len(p) for p in prompts], np.int32)
        T = pow2_bucket(int(lens.max()))
        P = -(-(int(lens.max()) + new_tokens) // ps)
        # Ring: the window plus the pending positions and the new token (a catch-up segment's first
        # query still sees its whole window), and the whole prompt chunk (R == P: it never wraps).
        R = min(P, max(-(-(cfg.sliding_window + self.max_pending) // ps) + 1, -(-T // ps)))
        gtab = 1 + np.arange(B * P, dtype=np.int32).reshape(B, P)  # page 0 is scratch
        ltab = 1 + np.arange(B * R, dtype=np.int32).reshape(B, R)
        dtype = self.params["embed"].dtype
        kv = KVState.create(cfg, 1 + B * P, 1 + B * R, ps, dtype)
        tokens = np.zeros((B, T), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        batch = Batch(tokens, np.zeros(B, np.int32), lens, gtab, ltab)
        kv, sc, _ = forward_and_write(cfg, R, self.params, kv, batch, (lens - 1)[:, None])
        W, M = (1 + self.max_pending, self.max_pending) if recompute else (1, 1)
        bk = jnp.zeros((cfg.n_layers, B, W, cfg.n_kv_heads, cfg.head_dim), dtype)
        st = _State(kv, gtab, ltab, lens.copy(), np.ones(B, np.int32), R, bk, bk.copy(), recompute,
                    np.zeros(B, np.int32), np.zeros((B, M), np.int32),
                    np.zeros((B, M, cfg.d_model), self.xdtype))
        return st, np.asarray(sc.best)[:, 0]

    def warm(self, batch: int, prompt_len: int, new_tokens: int, score: bool = False,
             reps: int = 0, kv_fill: str = "propagate") -> dict[str, float]:
        """Compile every shape a run of `batch` rows may take with `kv_fill`: each stage (at each
        segment bucket) and propagation at each power-of-two row bucket up to `batch` (padding
        rows only: nothing is written), the write at each window bucket.

        reps > 0: also time each call (fastest of `reps`, ms), keyed "stage{s}@{rows}[x{segment}]",
        "propagate{k}@{rows}", "write@{B}[x{window}]", "plain@{B}"; the step's parts in isolation.
        """
        st, _ = self._prefill([[self.cfg.bos_id] * prompt_len] * batch, new_tokens, kv_fill == "recompute")
        B, L, W = batch, self.cfg.n_layers, st.width
        full = Batch(np.zeros((B, 1), np.int32), st.start, np.zeros(B, np.int32), st.gtab, st.ltab)
        top_b, ms, segs = pow2_bucket(B), {}, self.segment_buckets(kv_fill)
        bm = jnp.zeros((L, B, W), bool)

        def timed(key, fn, state):
            """fn(state) once (it compiles), then `reps` times timed; the last state."""
            state = fn(state)
            for _ in range(reps):
                t0 = time.perf_counter()
                state = jax.block_until_ready(fn(state))
                ms[key] = min(ms.get(key, math.inf), 1e3 * (time.perf_counter() - t0))
            return state

        for nb in (1 << i for i in range(top_b.bit_length())):
            rows, pads, z = np.arange(nb) % B, np.full(nb, B, np.int32), np.zeros(nb, np.int32)
            for s, top in enumerate(self.tops):
                lo, hi = self.bounds[s], self.bounds[s + 1]
                for T in (segs if s > 0 else (1,) if nb == top_b else ()):  # stage 0 runs the whole batch
                    x = None if s == 0 else np.zeros((nb, T, self.cfg.d_model), self.xdtype)
                    args = (self.cfg, st.ring, lo, hi, self.confidence, score, self.params["layers"][lo:hi],
                            top, st.kv, sub_batch(full, rows, nb), x, np.full((nb, T), -1, np.int32),
                            np.full((nb, T), W, np.int32), z)
                    st.bk, st.bv, bm = timed(f"stage{s}@{nb}" + (f"x{T}" if T > 1 else ""),
                                             lambda o: stage(*args, *o, pads, z)[4:],  # noqa: B023
                                             (st.bk, st.bv, bm))
                if hi < L and kv_fill == "propagate":  # any number of a stage's rows may exit
                    pargs = (self.cfg, hi, self.kvw[hi:], np.zeros((nb, 1, self.cfg.d_model), self.xdtype),
                             np.full((nb, 1), -1, np.int32))
                    st.bk, st.bv, bm = timed(f"propagate{hi}@{nb}",
                                             lambda o: propagate(*pargs, *o, pads),  # noqa: B023
                                             (st.bk, st.bv, bm))
        for w in segs:
            p0 = st.start.astype(np.int32)
            st.kv = timed(f"write@{B}" + (f"x{w}" if w > 1 else ""),
                          lambda o: write_window(self.cfg, st.ring, w, o, p0, st.gtab, st.ltab,  # noqa: B023
                                                 st.bk, st.bv, bm), st.kv)
        timed(f"plain@{B}", lambda o: self._plain_step(st, np.zeros(B, np.int32)), None)
        jax.block_until_ready(st.kv)
        return ms


@dataclass
class _State:
    """Device and host state of one run."""

    kv: KVState
    gtab: np.ndarray  # [B, P] int32
    ltab: np.ndarray  # [B, R] int32
    start: np.ndarray  # [B] int32 position of the next token (tokens whose lower layers are cached)
    n_new: np.ndarray  # [B] int32 ones
    ring: int  # ring pages per row
    bk: jax.Array  # [L, B, W, KV, hd] this step's new keys by window slot (W = 1 + max_pending or 1)
    bv: jax.Array
    recompute: bool  # exited rows pend (recompute later) instead of propagating
    pend_n: np.ndarray  # [B] int32 positions before `start` whose upper layers are missing
    pend_d: np.ndarray  # [B, M] int32 layers each pending position has run
    pend_x: np.ndarray  # [B, M, d] its residual entering layer pend_d
    caught_up: int = field(default=0)
    forced: int = field(default=0)

    @property
    def width(self) -> int:
        return self.bk.shape[2]
