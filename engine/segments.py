"""Segmented verifies: rows that draft nothing decode beside the drafting rows' verify, in one forward.

Under per-tenant rules (or when a proposer finds no draft for some rows) one
speculative step holds rows that draft d tokens and rows that draft none. A
padded verify (engine/step.py) runs every row at 1 + d positions, so a plain
row pays the layers and the 262k-row output layer d times over for nothing. A
segmented verify runs them as two segments of one forward:

1. plain rows [Bp, 1] and drafting rows [Bv, q] (q = 1 + depth), each padded
   to a batch bucket, sharing one page-table width (`new_segment_calls`);
2. `_forward_segmented` (jitted) runs `engine.model.forward_segments`: the
   dense parts once over Bp + Bv * q tokens, attention per segment over its own
   pages, the output layer per segment; the new K/V are scattered by the
   runner's own `_write` per segment (the shapes plain decoding and verifying
   already compiled);
3. the plain rows sample (`engine.runner._sample` at [Bp, 1]) and the drafting
   rows verify (`engine.runner._verify` at [Bv, q]), again shapes compiled for
   plain decoding and verification; the runner's `last_hidden` / `last_top`
   hold the plain rows first (position 0), then the drafting rows, padded to q
   positions, so row Bp + j of them is drafting row j.

Measured on this CPU (`python -m bench.verify_segments`): 0.55-0.79 of the
padded call's time where half the rows or more draft nothing. Each (Bp, Bv, q,
context) is an executable of its own (~440 memory mappings on XLA:CPU), so
`segment_shapes` keeps a small set: both parts batch buckets, Bv at most half
of RunnerConfig.segment_rows and Bp + Bv at most it, q in SEGMENT_QUERIES, one
context (the largest). Whether a step
runs segmented is `engine.types.segment_split` (the tuner prices steps with
it too); the shapes compile after speculation's others (engine/warm.py) and a
step uses one only once it is compiled (`ModelRunner.segments_ready`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.compiles import abstract
from engine.kv import Batch, cache_reader
from engine.model import forward_segments
from engine.runner import CallArrays, ModelRunner, RunnerConfig, _adjust, _sample, _verify, _write, bucket, output_scores, write_batch
from engine.sampling import SamplingArrays

SEGMENT_QUERIES = (5, 9)
"""Verify lengths (1 + depth) segments compile for: depths 3-4 and 5-8. Measured in the mid-load
phase (`crossover bench tuner --quick --mid-mixed`, bench/README.md "Segmented verifies"): at
batch 8 with ~4.5 plain rows a segmented depth-4 step took 0.77x the padded one's time, a
depth-2 step 0.93-0.97x (two attention segments, two output-layer calls and two writes cost
about what 2 positions a row save). Each shape costs ~500 memory mappings
(engine.loader.MAPS_PER_SEGMENT), so depths 1-2 verify padded as without segments."""


def segment_contexts(rc: RunnerConfig) -> tuple[int, ...]:
    """Page-table widths segmented verifies compile for: speculation's largest only, a shorter
    context padding up (attention costs little at the batches that segment; every context would
    multiply the executables)."""
    return rc.spec_contexts[-1:]


def segment_pairs(rc: RunnerConfig) -> list[tuple[int, int]]:
    """(plain rows, drafting rows) compiled, both batch buckets of speculation.
    Example: buckets (1, 2, 4, 8), segment_rows 8: (1, 1), (1, 2), (1, 4), (2, 1), ... (4, 4)."""
    if not rc.segment_rows or not rc.verify_tokens:
        return []
    bs = [b for b in rc.batch_buckets if b <= rc.spec_max_batch]
    return [(p, v) for p in bs for v in bs if v <= rc.segment_rows // 2 and p + v <= rc.segment_rows]


def segment_shapes(rc: RunnerConfig) -> list[tuple[int, int, int, int]]:
    """(plain rows, drafting rows, 1 + depth, context) of every segmented verify compiled."""
    qs = [q for q in rc.verify_tokens if q in SEGMENT_QUERIES]
    return [(p, v, q, c) for p, v in segment_pairs(rc) for q in qs for c in segment_contexts(rc)]


def new_segment_calls(runner: ModelRunner, plain: int, drafting: int, q: int,
                      context: int) -> tuple[CallArrays, CallArrays] | None:
    """Zeroed host arrays (plain segment [plain, 1], drafting segment [drafting, q]) at one
    page-table width, or None when that shape is not compiled (yet)."""
    try:
        c = bucket(context, segment_contexts(runner.rc))
    except ValueError:
        return None
    if (plain, drafting, q, c) not in runner.segments_ready:
        return None
    p = runner.new_call(plain, 1, c, spec=True)
    v = runner.new_verify_call(drafting, q - 1, c)
    width = c // runner.rc.page_size
    if p.tokens.shape[0] != plain or v.tokens.shape != (drafting, q) or v.global_table.shape[1] != width \
            or p.global_table.shape[1] != width:
        return None
    return p, v


@partial(jax.jit, static_argnames=("cfg", "ring_pages"))
def _forward_segmented(cfg, ring_pages: int, params, kv, plain: Batch, drafting: Batch, verify_idx):
    """Scores of the plain rows [Bp, 1] and of the drafting rows at verify_idx [Bv, q]; the hidden
    states there as one [Bp + Bv, q, d] array (plain rows at position 0, zeros after); each
    segment's new K/V."""
    segs = tuple((b.tokens, b.positions(), cache_reader(kv, b, ring_pages)) for b in (plain, drafting))
    (hp, hv), new_kv = forward_segments(cfg, params, segs)
    hv = jnp.take_along_axis(hv, verify_idx[:, :, None], axis=1)
    hidden = jnp.concatenate([jnp.pad(hp, ((0, 0), (0, hv.shape[1] - 1), (0, 0))), hv])
    return output_scores(params, hp), output_scores(params, hv), hidden, tuple(new_kv)


def run_segmented(runner: ModelRunner, plain: CallArrays, drafting: CallArrays, cand: np.ndarray):
    """Execute one segmented verify; ((tokens, logprobs) [Bp, 1] of the plain rows, (tokens,
    accepted, logprobs) [Bv, q] of the drafting rows) as numpy."""
    rc = runner.rc
    bp, bv = plain.batch(), drafting.batch()
    sp, sv, runner.last_hidden, (kp, kv) = _forward_segmented(runner.cfg, rc.ring_pages, runner.params, runner.kv,
                                                              bp, bv, drafting.logit_idx)
    runner.kv = _write(rc.ring_pages, runner.kv, write_batch(bp, rc.page_size, rc.ring_pages, plain.local_write), kp)
    runner.kv = _write(rc.ring_pages, runner.kv, write_batch(bv, rc.page_size, rc.ring_pages, drafting.local_write),
                       kv)
    tok, lp, *top_p = _sample(sp, SamplingArrays(**plain.samp), plain.counter, _adjust(plain))
    vtok, acc, vlp, *top_v = _verify(sv, cand, SamplingArrays(**drafting.samp), drafting.counter, _adjust(drafting))
    runner.last_top = None
    if plain.samp["want_logprobs"].any() or drafting.samp["want_logprobs"].any():
        q = vtok.shape[1]
        runner.last_top = tuple(np.concatenate([np.pad(np.asarray(a), ((0, 0), (0, q - 1), (0, 0))), np.asarray(b)])
                                for a, b in zip(top_p, top_v))
    return (np.asarray(tok), np.asarray(lp)), (np.asarray(vtok), np.asarray(acc), np.asarray(vlp))


def segment_jobs(runner: ModelRunner) -> list:
    """One thunk per `segment_shapes` entry compiling its forward ahead of time from array
    metadata (as ModelRunner._jobs does) and then marking it usable; the KV writes, sampling
    and verification it calls are plain decoding's and verification's shapes, compiled before."""
    params, kv, ring = abstract(runner.params), abstract(runner.kv), runner.rc.ring_pages

    def forward(p: int, v: int, q: int, c: int) -> None:
        cp, cv = runner.new_call(p, 1, c, spec=True), runner.new_verify_call(v, q - 1, c)
        _forward_segmented.lower(runner.cfg, ring, params, kv, cp.batch(), cv.batch(), cv.logit_idx).compile()
        runner.segments_ready = runner.segments_ready | {(p, v, q, c)}

    return [partial(forward, *s) for s in segment_shapes(runner.rc)]
