"""The model runner: a model's params and KV pools on the device, and its output layer.

`ModelRunner` holds the (unstacked) params, the KV pools and, after a call, the output tokens'
hidden states and top logprobs; `RunnerConfig` sizes the pools and calls. Every call the engine
makes on them is ragged (engine/execute/ragged_calls.py: the step's rows on one flat token axis; the
layer-stack proposers' in engine/speculation/layer_draft.py). Here too: `output_scores` (the tied output
layer, optionally in bfloat16 with an exact rescoring) and `_verify` (draw and check drafts at
scored positions), which the ragged heads call runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from engine.config import ModelConfig
from engine.execute.penalties import SPARE_ENTRIES
from engine.execute.sampling import (
    Adjust,
    SamplingArrays,
    adjust_logits,
    greedy,
    top_candidates,
    top_logprobs,
    verify,
)
from engine.memory.kv import KVState
from engine.model.gemma import Params, logits, tied_logits, unstack_layers
from engine.quant.formats import QuantWeight
from engine.quant.matmul import greedy_screenable


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Example: bucket(3, (1, 2, 4, 8)) == 4."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class RunnerConfig:
    """Sizes of the pools and calls a runner serves."""

    page_size: int = 16
    """Tokens per KV page."""
    max_batch: int = 64
    """Most sequences in one step."""
    max_chunk: int = 512
    """Most tokens of one prompt a step prefills (at most the local ring's capacity)."""
    max_context: int = 4096
    """Longest sequence, in tokens (a multiple of page_size): the page tables' width."""
    global_pages: int = 1024
    """Pages in the global-layer pool (page 0 is scratch)."""
    local_pages: int = 1024
    """Pages in the local-layer pool (page 0 is scratch)."""
    ring_pages: int = 33
    """Ring length of a sequence in the local pool (window + verify slots)."""
    verify_tokens: tuple[int, ...] = ()
    """1 + the draft depths speculation verifies (the largest bounds the depth); () = none."""
    spec_max_batch: int = 16
    """Largest decode batch that speculates (speculation stops paying beyond)."""
    dtype: str = "float32"
    """Compute dtype of weights and activations."""
    kv_dtype: str = "float32"
    """Storage dtype of the KV pools."""
    fast_output: bool = False
    """Float32 model: score the vocabulary in bfloat16 for 2+ rows, rescoring the top 16 exactly
    (see output_scores; costs a bfloat16 copy of the embedding)."""
    tensor_parallel: int = 1
    """Devices the params and KV pools are split over (engine/model/sharding.py); 1: one device."""

    def __post_init__(self) -> None:
        cap = self.ring_pages * self.page_size
        if self.max_chunk > cap:
            raise ValueError(f"max_chunk {self.max_chunk} exceeds the local ring capacity "
                             f"ring_pages*page_size={cap}")
        if self.max_context % self.page_size:
            raise ValueError(f"max_context {self.max_context} is not a multiple of "
                             f"page_size={self.page_size}")


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


OUTPUT_PARAMS = ("embed", "embed_fast")
"""The params `output_scores` reads: the tied table and its bfloat16 copy, where kept."""


def output_params(params: Params) -> Params:
    """`params` cut to OUTPUT_PARAMS. A jitted call flattens and checks every leaf of its
    arguments on each call, unused ones too (the model's ~300 leaves cost about as much as the
    call's own work at one output row), so calls that only score hidden states take these."""
    return {k: params[k] for k in OUTPUT_PARAMS if k in params}


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


def _adjusted(sc: Scores, adj: Adjust | None):
    """(logits [B * Tl, V], greedy tokens [B * Tl]) after `adj` [B, Tl, H] (None: as scored), and
    the model's own logits when they differ (logprobs report those, as vLLM's raw logprobs)."""
    B, Tl, V = sc.logits.shape
    lg, best = sc.logits.reshape(B * Tl, V), sc.best.reshape(-1)
    if adj is None:  # decided when tracing: calls without penalties or bans skip all of it
        return lg, best, None
    return *adjust_logits(lg, best, jax.tree.map(lambda a: a.reshape(B * Tl, -1), adj)), lg


@jax.jit
def _verify(sc: Scores, cand, samp: SamplingArrays, counter, adj: Adjust | None = None,
            mask: jax.Array | None = None):
    """Target tokens and acceptance at every verified position: logits [B, T, V], cand [B, T];
    `adj` [B, T, H] changes each position's logits first (engine.execute.penalties), then `mask`
    [B, T, W] keeps a grammar's tokens alone (engine/grammar.py)."""
    B, T, V = sc.logits.shape
    rows = jax.tree.map(lambda a: jnp.repeat(a, T, axis=0), samp)
    lg, best, raw = _adjusted(sc, adj)
    tok, acc, lp = verify(lg, cand.reshape(-1), rows, counter.reshape(-1), best=best, raw=raw,
                          mask=None if mask is None else mask.reshape(B * T, -1))
    ti, tl = top_logprobs(sc.logits.reshape(B * T, V), rows)
    return tok.reshape(B, T), acc.reshape(B, T), lp.reshape(B, T), ti.reshape(B, T, -1), tl.reshape(B, T, -1)


class ModelRunner:
    """Device state plus the compiled step for one model."""

    def __init__(self, cfg: ModelConfig, params: Params, rc: RunnerConfig):
        self.cfg, self.params, self.rc = cfg, unstack_layers(params), rc
        rows = max(rc.max_batch, max(rc.verify_tokens, default=1))  # most outputs of one call
        embed = self.params["embed"]
        quantized = isinstance(embed, QuantWeight)
        if rc.fast_output and not quantized and embed.dtype == jnp.float32 and rows >= 2:
            self.params = {**self.params, "embed_fast": embed.astype(jnp.bfloat16)}
        self.kv = KVState.create(cfg, rc.global_pages, rc.local_pages, rc.page_size, jnp.dtype(rc.kv_dtype))
        self.mesh = None
        if rc.tensor_parallel > 1:  # XLA's SPMD partitioner splits every call over the mesh
            if quantized:
                raise ValueError("quantized weights serve on one device: load float ones to split them")
            from engine.model.sharding import make_mesh, shard_kv, shard_params

            self.mesh = make_mesh(rc.tensor_parallel)
            self.params, self.kv = shard_params(cfg, self.params,
                                                self.mesh), shard_kv(cfg, self.kv, self.mesh)
        self._leaves: tuple = (None, None, ())  # (params it flattens, treedef, leaves): param_leaves
        self.out_params = output_params(self.params)
        """The params the ragged heads call reads (`output_params`)."""
        self.screen = self.mesh is None and greedy_screenable(self.params["embed"])
        """Whether the ragged heads take greedy tokens from the table's screen (quant.matmul.qgreedy)."""
        self.warm_compiles: int | None = None
        self.last_hidden = None  # [B, Tl, d] final hidden states of the latest call
        self.last_top = None  # ([B, Tl, k] ids, [B, Tl, k] logprobs) of the latest call, if asked
        self.last_given = None  # [O] logprobs of the latest ragged call's drafts, if asked
        self.open_masks: dict[int, object] = {}  # output count -> its all-ids mask (ragged_calls.open_mask)
        self.adjust_width = rc.max_context + SPARE_ENTRIES
        """Logit entries per position: a context's distinct tokens plus banned stop ids."""

    def param_leaves(self) -> tuple:
        """(treedef, leaves) of `params`, flattened again only when `params` is another object."""
        if self._leaves[0] is not self.params:
            leaves, tree = jax.tree.flatten(self.params)
            self._leaves = (self.params, tree, tuple(leaves))
        return self._leaves[1:]
