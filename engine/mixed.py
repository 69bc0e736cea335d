"""Mixed calls: one forward carries a step's decode rows and a prefill chunk together.

1. The scheduler caps a long prompt's prefill tokens while sequences decode
   (`engine.scheduler.mix_chunk`: a few tokens per decode row, rounded down to
   a prefill bucket), so a step with its chunk stays within about twice a
   plain decode step and running streams keep their pace; short prompts are
   prefilled whole, in calls of their own (engine/step.py carries one chunk).
2. `new_mixed_calls` makes two bucket-padded CallArrays sharing one page-table
   width: the decode segment [Bd, 1] and the prefill segment [Bp, Tp].
3. `_forward_mixed` (jitted) runs `engine.model.forward_segments`: projections
   and MLP once over the Bd + Bp * Tp tokens, attention per segment over its own
   pages; logits only at one position per row, [Bd + Bp, 1]. `_write_mixed`
   (jitted, KV donated) scatters both segments' new K/V in one call.
4. Sampling is `engine.runner._sample` over the Bd + Bp rows; the runner's
   `last_hidden` / `last_top` rows follow the same order (decode rows, then
   prefill rows), so a prefill row j is row Bd + j of the call.
`engine.scheduler.mixed_shapes` lists what warmup compiles (`mixed_jobs`); a step whose
shape is not among them runs its chunk in a call of its own, as before.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.compiles import abstract, any_committed, outputs
from engine.kv import Batch, cache_reader, write_new
from engine.model import forward_segments
from engine.runner import CallArrays, ModelRunner, RunnerConfig, _sample, bucket, output_scores, write_batch
from engine.sampling import Adjust, SamplingArrays
from engine.scheduler import mix_contexts, mixed_shapes


@partial(jax.jit, static_argnames=("cfg", "ring_pages"))
def _forward_mixed(cfg, ring_pages: int, params, kv, batches: tuple[Batch, ...], logit_idx: tuple):
    """Forward over every segment of `batches`; (Scores at logit_idx [sum B_i, Tl], hidden there,
    each segment's new K/V)."""
    segs = tuple((b.tokens, b.positions(), cache_reader(kv, b, ring_pages)) for b in batches)
    hs, new_kv = forward_segments(cfg, params, segs)
    sel = jnp.concatenate([jnp.take_along_axis(h, i[:, :, None], axis=1) for h, i in zip(hs, logit_idx)])
    return output_scores(params, sel), sel, tuple(new_kv)


@partial(jax.jit, static_argnames=("ring_pages",), donate_argnames=("kv",))
def _write_mixed(ring_pages: int, kv, batches: tuple[Batch, ...], new_kv: tuple):
    """Scatter every segment's new K/V into the donated pools (apart from the forward: see
    engine.runner._write)."""
    for b, n in zip(batches, new_kv):
        kv = write_new(kv, b, n, ring_pages)
    return kv


@lru_cache(maxsize=8)
def _shape_set(rc: RunnerConfig) -> frozenset:
    return frozenset(mixed_shapes(rc))


def new_mixed_calls(runner: ModelRunner, decode: int, prefill: int, chunk: int,
                    context: int) -> tuple[CallArrays, CallArrays] | None:
    """Zeroed host arrays of a mixed call (decode segment, prefill segment), or None when no
    compiled mixed shape fits (the caller then runs the chunk apart)."""
    rc = runner.rc
    try:
        B, T, C = bucket(decode, rc.batch_buckets), bucket(chunk, rc.prefill_buckets), bucket(context, mix_contexts(rc))
    except ValueError:
        return None
    if (B, prefill, T, C) not in _shape_set(rc):
        return None
    d, p = runner.new_call(B, 1, C), runner.new_call(prefill, T, C)
    P = C // rc.page_size
    if (d.tokens.shape, d.global_table.shape, p.tokens.shape, p.global_table.shape) != ((B, 1), (B, P), (prefill, T),
                                                                                         (prefill, P)):
        return None  # padded otherwise (rows not a batch bucket, or engine/warm.py still warming)
    return d, p


def run_mixed(runner: ModelRunner, calls: tuple[CallArrays, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Execute one mixed call; (tokens [sum B_i, 1], logprobs [sum B_i, 1]) as numpy."""
    rc = runner.rc
    batches = tuple(c.batch() for c in calls)
    writes = tuple(write_batch(b, rc.page_size, rc.ring_pages, c.local_write) for b, c in zip(batches, calls))
    sc, runner.last_hidden, new_kv = _forward_mixed(runner.cfg, rc.ring_pages, runner.params, runner.kv, batches,
                                                    tuple(c.logit_idx for c in calls))
    runner.kv = _write_mixed(rc.ring_pages, runner.kv, writes, new_kv)
    samp = {k: np.concatenate([c.samp[k] for c in calls]) for k in calls[0].samp}
    adj = None
    if any(c.adjust is not None for c in calls):
        parts = [runner.adjust_arrays(c) for c in calls]
        adj = Adjust(**{k: np.concatenate([a[k] for a in parts]) for k in parts[0]})
    tok, lp, *top = _sample(sc, SamplingArrays(**samp), np.concatenate([c.counter for c in calls]), adj)
    runner.last_top = tuple(map(np.asarray, top)) if samp["want_logprobs"].any() else None
    return np.asarray(tok), np.asarray(lp)


def mixed_jobs(runner: ModelRunner) -> tuple[list, list]:
    """(forward + write thunks, sampling thunks) compiling every `mixed_shapes` call ahead of
    time from array metadata, as ModelRunner._jobs does; the sampling thunks read the layouts
    the forward thunks leave, so they run after them."""
    rc = runner.rc
    params, kv, ring = abstract(runner.params), abstract(runner.kv), rc.ring_pages
    committed = runner.mesh is not None or any_committed(runner.params, runner.kv)
    scores: dict[int, object] = {}

    def forward(b: int, bp: int, t: int, c: int) -> None:
        calls = new_mixed_calls(runner, b, bp, t, c)
        batches = tuple(x.batch() for x in calls)
        fwd = _forward_mixed.lower(runner.cfg, ring, params, kv, batches,
                                   tuple(x.logit_idx for x in calls)).compile()
        sc, _, new_kv = outputs(fwd, committed)
        scores[b + bp] = sc
        writes = tuple(write_batch(x, rc.page_size, ring) for x in batches)
        _write_mixed.lower(ring, kv, writes, new_kv).compile()

    def sampling(rows: int) -> None:
        samp, counter = SamplingArrays(**SamplingArrays.host(rows)), np.zeros((rows, 1), np.int32)
        for adj in (None, Adjust(**Adjust.host((rows, 1, runner.adjust_width)))):
            _sample.lower(scores[rows], samp, counter, adj).compile()

    shapes = mixed_shapes(rc)
    rows = sorted({b + bp for b, bp, _, _ in shapes})
    return [partial(forward, *s) for s in shapes], [partial(sampling, r) for r in rows]
