"""A padded [B, T] forward over the paged KV pools: the reference the ragged forward replaced.

The engine runs every call on a flat token axis (engine/execute/ragged_calls.py). The compacting
early-exit experiment (bench/early_exit_decoder.py) runs its stages as padded [B, T] calls,
and tests check the paged model against a dense reference with them, so the padded call
lives on here: `padded_call` lays out one call's host arrays ([B, T] tokens, page tables of
the runner's maximum context), `forward_and_write` runs the forward (`_forward`, logits at
chosen positions) and writes the new K/V into the pools in a call of its own (`_write`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.execute.runner import RunnerConfig, output_scores
from engine.execute.sampling import SamplingArrays
from engine.memory.kv import Batch, KVState, write_new
from engine.model.gemma import PagedView, Params, forward


def cache_reader(kv: KVState, batch: Batch, ring_pages: int):
    """Returns read_cache(kind, layer_index) -> PagedView for engine.model.gemma.forward.

    The local table may be narrower than the ring (short contexts): its slots
    are read as they are, positions still follow the full ring's arithmetic.
    """
    last = batch.start - 1  # [B] newest cached position
    cap = ring_pages * kv.page_size

    def read(kind: str, idx) -> PagedView:
        if kind == "global":
            return PagedView(kv.global_k, kv.global_v, idx, batch.global_table, last)
        return PagedView(kv.local_k, kv.local_v, idx, batch.local_table, last, ring=cap)

    return read


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
    read (a prefix-cached ring entry replaced on wrap: engine.memory.kv.KVPool.prepare); None: local_table."""

    def batch(self) -> Batch:
        """The arrays a forward reads (engine.memory.kv.Batch)."""
        return Batch(self.tokens, self.start, self.n_new, self.global_table, self.local_table)


def padded_call(rc: RunnerConfig, batch: int, new_tokens: int, logits_per_row: int = 1) -> CallArrays:
    """Zeroed host arrays of one [batch, new_tokens] call (scratch pages), its page tables as
    wide as rc's maximum context."""
    P = rc.max_context // rc.page_size
    R = min(rc.ring_pages, P)
    return CallArrays(
        tokens=np.zeros((batch, new_tokens), np.int32),
        start=np.zeros(batch, np.int32),
        n_new=np.zeros(batch, np.int32),
        global_table=np.zeros((batch, P), np.int32),
        local_table=np.zeros((batch, R), np.int32),
        local_write=np.zeros((batch, R), np.int32),
        logit_idx=np.zeros((batch, logits_per_row), np.int32),
        counter=np.zeros((batch, logits_per_row), np.int32),
        samp=SamplingArrays.host(batch),
    )
