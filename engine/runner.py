"""The model runner: owns the params and device state; buckets and runs padded calls.

1. A caller asks `new_call` for one call's numpy arrays (tokens, page tables, ...), padded to
   the smallest configured bucket (batch, new tokens, page-table width), and fills them.
2. `_forward` (jitted) runs the layers over the cache; `_write` (jitted, KV donated) scatters
   the new K/V in place; `_verify` (jitted apart: its shapes ignore the context) draws tokens
   and checks drafts.
3. The runner keeps the new KV state and returns numpy.
The engine's steps run as ragged calls on this runner's params and KV state
(engine/ragged_calls.py: every row on a flat token axis). The padded [B, T] calls here serve
the proposers (engine/drafting.py, engine/layer_draft.py, engine/draft_model.py,
engine/early_exit.py), which draft and catch up in calls of their own, and the memory probe
(bench/memory_probe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.compiles import abstract, any_committed, outputs
from engine.config import ModelConfig
from engine.kv import Batch, KVState, cache_reader, write_new
from engine.model import Params, forward, logits, tied_logits, unstack_layers
from engine.penalties import SPARE_ENTRIES
from engine.sampling import Adjust, SamplingArrays, adjust_logits, greedy, top_candidates, top_logprobs, verify


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Example: bucket(3, (1, 2, 4, 8)) == 4."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class RunnerConfig:
    """Shapes and sizes the runner compiles for."""

    page_size: int = 16
    """Tokens per KV page."""
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Decode batch sizes compiled; the largest is the max batch."""
    prefill_buckets: tuple[int, ...] = (32, 128, 512)
    """Prefill chunk lengths compiled; the largest is the max chunk."""
    context_buckets: tuple[int, ...] = (1024, 4096)
    """Page-table widths compiled, in tokens; the largest is the max context."""
    global_pages: int = 1024
    """Pages in the global-layer pool (page 0 is scratch)."""
    local_pages: int = 1024
    """Pages in the local-layer pool (page 0 is scratch)."""
    ring_pages: int = 33
    """Ring length of a sequence in the local pool (window + verify slots)."""
    verify_tokens: tuple[int, ...] = ()
    """Token counts (1 + draft depth) compiled for speculative verification; () = none."""
    spec_max_batch: int = 16
    """Largest decode batch compiled for verification (speculation stops paying beyond)."""
    spec_context_buckets: tuple[int, ...] = ()
    """Page-table widths compiled for verification and layer-chain drafting: the largest ones of
    context_buckets (a shorter context pads up to the smallest of them); () = all of them."""
    dtype: str = "float32"
    """Compute dtype of weights and activations."""
    kv_dtype: str = "float32"
    """Storage dtype of the KV pools."""
    fast_output: bool = False
    """Float32 model: score the vocabulary in bfloat16 for 2+ rows, rescoring the top 16 exactly
    (see output_scores; costs a bfloat16 copy of the embedding)."""
    tensor_parallel: int = 1
    """Devices the params and KV pools are split over (engine/sharding.py); 1: one device."""

    def __post_init__(self) -> None:
        cap = self.ring_pages * self.page_size
        if self.prefill_buckets[-1] > cap:
            raise ValueError(
                f"largest prefill chunk {self.prefill_buckets[-1]} exceeds the local ring "
                f"capacity ring_pages*page_size={cap}"
            )
        for c in self.context_buckets:
            if c % self.page_size:
                raise ValueError(f"context bucket {c} is not a multiple of page_size={self.page_size}")
        spec = self.spec_context_buckets
        if spec and (spec != self.context_buckets[-len(spec):]):
            raise ValueError(f"spec_context_buckets {spec} must be the largest of context_buckets "
                             f"{self.context_buckets}")

    @property
    def spec_contexts(self) -> tuple[int, ...]:
        """The page-table widths speculation's calls use."""
        return self.spec_context_buckets or self.context_buckets

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def max_context(self) -> int:
        return self.context_buckets[-1]

    @property
    def max_chunk(self) -> int:
        return self.prefill_buckets[-1]


FAST_OUTPUT_MIN_ROWS = 2
"""Output rows (batch x logits per row) from which a float32 model scores the vocabulary in bfloat16."""
RESCORE = 16
"""Candidates per row rescored exactly in float32 after the bfloat16 pass."""
@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Scores:
    """What the output layer hands to sampling for [B, Tl] positions."""

    logits: jax.Array  # [B, Tl, V] float32
    best: jax.Array  # [B, Tl] int32: the greedy token (lowest id on ties)


def output_scores(params: Params, hs: jax.Array) -> Scores:
    """Tied output layer on [B, Tl, d]: logits [B, Tl, V] float32 and the greedy token.

    With a bfloat16 copy of the table (`params["embed_fast"]`, kept by a float32
    runner on a CPU with bfloat16 units: engine.loader.cpu_has_bf16) and at least
    FAST_OUTPUT_MIN_ROWS rows, the 262k-row product runs in bfloat16 (a single row
    runs far slower so) and the top RESCORE candidates of each row are recomputed
    in float32. The greedy token is the best float32-rescored candidate, so it
    is the float32 argmax unless that falls outside the bfloat16 top 16, and no
    second pass over the vocabulary is needed to find it; the logits' tail
    keeps bfloat16-rounded inputs (sampling and logprobs read it).
    """
    fast = params.get("embed_fast")
    B, Tl, _ = hs.shape
    if fast is None or B * Tl < FAST_OUTPUT_MIN_ROWS:
        lg = logits(params, hs)
        return Scores(lg, greedy(lg.reshape(B * Tl, -1)).reshape(B, Tl))
    approx = tied_logits(fast, hs)
    top = jnp.sort(top_candidates(approx, RESCORE), axis=-1)  # [B, Tl, k], ascending ids: ties go low
    exact = jnp.einsum("btd,btkd->btk", hs, jnp.take(params["embed"], top, axis=0),
                       preferred_element_type=jnp.float32)
    best = jnp.take_along_axis(top, jnp.argmax(exact, axis=-1)[..., None], axis=-1)[..., 0]
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(Tl)[None, :, None]
    return Scores(approx.at[b, t, top].set(exact), best.astype(jnp.int32))


@partial(jax.jit, static_argnames=("cfg", "ring_pages"))
def _forward(cfg: ModelConfig, ring_pages: int, params: Params, kv: KVState, batch: Batch, logit_idx):
    """One forward over [B, T] new tokens reading the paged cache; logits at logit_idx [B, Tl].

    Returns (Scores at logit_idx, final hidden states there [B, Tl, d] for the
    MTP proposer, the new tokens' K/V for `_write`).
    """
    h, new_kv, _ = forward(cfg, params, batch.tokens, batch.positions(), cache_reader(kv, batch, ring_pages))
    hs = jnp.take_along_axis(h, logit_idx[:, :, None], axis=1)  # [B, Tl, d]
    return output_scores(params, hs), hs, new_kv


@partial(jax.jit, static_argnames=("ring_pages",), donate_argnames=("kv",))
def _write(ring_pages: int, kv: KVState, batch: Batch, new_kv):
    """Scatter the new K/V into the donated pools, in place.

    A separate call on purpose: when the same jit also gathers from the pools,
    XLA:CPU copies the whole pool before the scatter (measured: 1 s per step
    with a 1 GiB pool instead of 0).
    """
    return write_new(kv, batch, new_kv, ring_pages)


def forward_and_write(cfg: ModelConfig, ring_pages: int, params: Params, kv: KVState, batch: Batch, logit_idx,
                      local_write: np.ndarray | None = None):
    """(new kv, Scores, hidden) for one call."""
    sc, hs, new_kv = _forward(cfg, ring_pages, params, kv, batch, logit_idx)
    return _write(ring_pages, kv, write_batch(batch, kv.page_size, ring_pages, local_write), new_kv), sc, hs


def write_batch(b: Batch, page_size: int, ring_pages: int, local_write: np.ndarray | None = None) -> Batch:
    """The host Batch `_write` needs for `b`'s new tokens: only the pages they land in.

    T new tokens starting anywhere in a page span at most W = (T + page_size - 2) // page_size + 1
    pages; `start` is re-based to the first of them. So a write's shape depends on (B, T)
    alone, not on the context bucket, and one write executable serves every context.
    Example: page_size 4, start 6, T 3 (positions 6, 7, 8): W 2, pages 1 and 2 of the table,
    start 2.
    """
    T = b.tokens.shape[1]
    start = np.asarray(b.start, np.int32)
    width = (T + page_size - 2) // page_size + 1
    base = start // page_size
    cols = base[:, None] + np.arange(width, dtype=np.int32)[None, :]  # [B, W] logical pages
    gt, lt = np.asarray(b.global_table), np.asarray(b.local_table if local_write is None else local_write)
    g = np.where(cols < gt.shape[1], np.take_along_axis(gt, np.minimum(cols, gt.shape[1] - 1), axis=1), 0)
    lcols = cols[:, : min(width, ring_pages)] % ring_pages  # ring entries, narrowed as kv.write_new does
    loc = np.take_along_axis(lt, np.minimum(lcols, lt.shape[1] - 1), axis=1)
    return Batch(np.zeros(b.tokens.shape, np.int32), start - base * page_size, np.asarray(b.n_new, np.int32),
                 g.astype(np.int32), loc.astype(np.int32))


def prefill_shapes(prefills: tuple[int, ...], contexts: tuple[int, ...]) -> list[tuple[int, int]]:
    """(chunk bucket, context bucket) pairs a prefill can reach: a chunk padded to bucket t has
    more tokens than the bucket below (2 at least: 1 token decodes), so its context is larger too.
    Example: prefill_shapes((32, 128), (64, 512)) == [(32, 64), (32, 512), (128, 64), (128, 512)];
    prefill_shapes((32, 512), (64, 512)) == [(32, 64), (32, 512), (512, 512)]."""
    return [(t, c) for i, t in enumerate(prefills) for c in contexts if c > (prefills[i - 1] if i else 1)]


def _adjusted(sc: Scores, adj: Adjust | None):
    """(logits [B * Tl, V], greedy tokens [B * Tl]) after `adj` [B, Tl, H] (None: as scored), and
    the model's own logits when they differ (logprobs report those, as vLLM's raw logprobs)."""
    B, Tl, V = sc.logits.shape
    lg, best = sc.logits.reshape(B * Tl, V), sc.best.reshape(-1)
    if adj is None:  # decided when tracing: calls without penalties or bans skip all of it
        return lg, best, None
    return *adjust_logits(lg, best, jax.tree.map(lambda a: a.reshape(B * Tl, -1), adj)), lg


@jax.jit
def _verify(sc: Scores, cand, samp: SamplingArrays, counter, adj: Adjust | None = None):
    """Target tokens and acceptance at every verified position: logits [B, T, V], cand [B, T];
    `adj` [B, T, H] changes each position's logits first (engine.penalties)."""
    B, T, V = sc.logits.shape
    rows = jax.tree.map(lambda a: jnp.repeat(a, T, axis=0), samp)
    lg, best, raw = _adjusted(sc, adj)
    tok, acc, lp = verify(lg, cand.reshape(-1), rows, counter.reshape(-1), best=best, raw=raw)
    ti, tl = top_logprobs(sc.logits.reshape(B * T, V), rows)
    return tok.reshape(B, T), acc.reshape(B, T), lp.reshape(B, T), ti.reshape(B, T, -1), tl.reshape(B, T, -1)


@dataclass
class CallArrays:
    """Host arrays of one call, already padded to a bucket."""

    tokens: np.ndarray  # [B, T] int32
    start: np.ndarray  # [B] int32
    n_new: np.ndarray  # [B] int32
    global_table: np.ndarray  # [B, P] int32
    local_table: np.ndarray  # [B, R] int32
    logit_idx: np.ndarray  # [B, Tl] int32
    counter: np.ndarray  # [B, Tl] int32
    samp: dict[str, np.ndarray] = field(default_factory=dict)
    local_write: np.ndarray | None = None
    """[B, R] int32 ring pages the new tokens are written to, where they differ from the pages
    read (a prefix-cached ring entry replaced on wrap: engine.kv.KVPool.prepare); None: local_table."""

    def batch(self) -> Batch:
        """The arrays a forward reads (engine.kv.Batch)."""
        return Batch(self.tokens, self.start, self.n_new, self.global_table, self.local_table)


class ModelRunner:
    """Device state plus the compiled step for one model."""

    def __init__(self, cfg: ModelConfig, params: Params, rc: RunnerConfig):
        self.cfg, self.params, self.rc = cfg, unstack_layers(params), rc
        rows = max(rc.max_batch, max(rc.verify_tokens, default=1))  # a verify has 1 + depth rows
        if rc.fast_output and self.params["embed"].dtype == jnp.float32 and rows >= 2:
            self.params = {**self.params, "embed_fast": self.params["embed"].astype(jnp.bfloat16)}
        self.kv = KVState.create(cfg, rc.global_pages, rc.local_pages, rc.page_size, jnp.dtype(rc.kv_dtype))
        self.mesh = None
        if rc.tensor_parallel > 1:  # XLA's SPMD partitioner splits every call over the mesh
            from engine.sharding import make_mesh, shard_kv, shard_params

            self.mesh = make_mesh(rc.tensor_parallel)
            self.params, self.kv = shard_params(cfg, self.params, self.mesh), shard_kv(cfg, self.kv, self.mesh)
        self.warm_compiles: int | None = None
        self.last_hidden = None  # [B, Tl, d] final hidden states of the latest call
        self.last_top = None  # ([B, Tl, k] ids, [B, Tl, k] logprobs) of the latest call, if asked
        self.adjust_width = rc.max_context + SPARE_ENTRIES
        """Logit entries per position: a context's distinct tokens plus banned stop ids."""

    def new_call(self, batch: int, new_tokens: int, context: int, logits_per_row: int = 1,
                 spec: bool = False) -> CallArrays:
        """Zeroed, bucket-padded host arrays (scratch pages, padding rows); `spec`: a call of
        speculation (verify, drafting), padded to RunnerConfig.spec_contexts."""
        rc = self.rc
        B = bucket(batch, rc.batch_buckets)
        T = 1 if new_tokens == 1 else bucket(new_tokens, rc.prefill_buckets)
        P = bucket(context, rc.spec_contexts if spec else rc.context_buckets) // rc.page_size
        return CallArrays(
            tokens=np.zeros((B, T), np.int32),
            start=np.zeros(B, np.int32),
            n_new=np.zeros(B, np.int32),
            global_table=np.zeros((B, P), np.int32),
            local_table=np.zeros((B, min(rc.ring_pages, P)), np.int32),
            local_write=np.zeros((B, min(rc.ring_pages, P)), np.int32),
            logit_idx=np.zeros((B, logits_per_row), np.int32),
            counter=np.zeros((B, logits_per_row), np.int32),
            samp=SamplingArrays.host(B),
        )

    def new_verify_call(self, batch: int, depth: int, context: int) -> CallArrays:
        """Host arrays for verifying up to `depth` drafts per row: T = bucket(1 + depth)."""
        rc = self.rc
        B = bucket(batch, tuple(b for b in rc.batch_buckets if b <= rc.spec_max_batch))
        T = bucket(1 + depth, rc.verify_tokens)
        c = self.new_call(B, 1, context, logits_per_row=T, spec=True)
        c.tokens = np.zeros((B, T), np.int32)
        c.logit_idx[:] = np.arange(T, dtype=np.int32)
        return c

    def run_verify(self, c: CallArrays, cand: np.ndarray):
        """Forward over [last token, drafts...] and verify: (tokens, accepted, logprobs) [B, T]."""
        self.kv, sc, self.last_hidden = forward_and_write(self.cfg, self.rc.ring_pages, self.params, self.kv,
                                                          c.batch(), c.logit_idx, c.local_write)
        tok, acc, lp, *top = _verify(sc, cand, SamplingArrays(**c.samp), c.counter)
        self.last_top = tuple(map(np.asarray, top)) if c.samp["want_logprobs"].any() else None
        return np.asarray(tok), np.asarray(acc), np.asarray(lp)

    def forward_jobs(self, shapes: list[tuple[int, int, int]]) -> list:
        """One thunk per (batch, new tokens, context) of `shapes` compiling its padded forward and
        KV write ahead of time from the arrays' metadata (engine.compiles.abstract; no device
        buffer read), as `new_call` lays them out (bench/memory_probe.py measures what each
        costs the host)."""
        params, kv, ring = abstract(self.params), abstract(self.kv), self.rc.ring_pages

        def forward(b: int, t: int, context: int) -> None:
            call = self.new_call(b, t, context)
            batch = call.batch()
            fwd = _forward.lower(self.cfg, ring, params, kv, batch, call.logit_idx).compile()
            _, _, new_kv = outputs(fwd, self.mesh is not None or any_committed(self.params, self.kv))
            _write.lower(ring, kv, write_batch(batch, self.rc.page_size, ring), new_kv).compile()

        return [partial(forward, *s) for s in shapes]
