"""The pieces the layer-based proposers share (engine/drafting.py, engine/draft_model.py).

- `DRAFT_VOCABS` and `_VocabSlices`: the tied embedding restricted to a draft
  vocabulary (its first n ids), per n.
- `_layers_draft`: one call of a layer stack over new tokens and a greedy
  draft from each row's last one; `_LayerDrafter._chain` runs it D times.
- `_layer_jobs`: thunks compiling those calls ahead of time from array
  metadata (engine/compiles.abstract), touching no device state.

Draft chain of one step for a layer-based proposer, depth D, newest token b at
position p (p = num_cached): feed b at p -> d1; feed d1 at p+1 -> d2; ... up to
dD. Positions >= p are invisible to later reads (slot validity follows
`start`), so rejected drafts never leak into the target's attention.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.compiles import abstract, any_committed, outputs
from engine.config import ModelConfig
from engine.heads import Head, head_logits
from engine.kv import Batch, KVPool, SeqPages, cache_reader
from engine.model import Params, forward
from engine.proposers import Proposer
from engine.runner import ModelRunner, RunnerConfig, _write, bucket, write_batch
from engine.sequence import Sequence

DRAFT_VOCABS = (8192, 32768)
"""Restricted draft vocabularies compiled for the MTP heads (0 = the full vocabulary)."""


class _VocabSlices:
    """The tied embedding restricted to the first n draft-vocabulary ids, per n."""

    def __init__(self, embed: jax.Array, vocab: np.ndarray, sizes: tuple[int, ...]):
        self.full = embed.shape[0]
        self.by_size: dict[int, tuple[jax.Array, jax.Array]] = {}
        for n in sizes:
            if n == 0 or n >= self.full or n > vocab.size:
                self.by_size[0] = (embed, jnp.arange(self.full, dtype=jnp.int32))
            else:
                ids = jnp.asarray(vocab[:n], jnp.int32)
                self.by_size[n] = (jnp.take(embed, ids, axis=0), ids)

    def get(self, n: int) -> tuple[jax.Array, jax.Array]:
        return self.by_size[n if n in self.by_size else 0]

    def nbytes(self) -> int:
        """Bytes of the slices (the full table is the target's own: not counted)."""
        return sum(int(e.nbytes + i.nbytes) for n, (e, i) in self.by_size.items() if n)


@partial(jax.jit, static_argnames=("cfg", "ring_pages"))
def _layers_draft(cfg: ModelConfig, ring_pages: int, params: Params, head: Head, embed_sub, ids, kv, batch: Batch):
    """Run a layer stack over new tokens; greedy draft from each row's last new token.

    Read-only on kv (the write is `runner._write`, a separate donated call).
    Returns (tokens [B, 1] int32, new_kv).
    """
    h, new_kv, _ = forward(cfg, params, batch.tokens, batch.positions(), cache_reader(kv, batch, ring_pages))
    last = jnp.maximum(batch.n_new - 1, 0)
    hl = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]  # [B, d]
    tok = ids[jnp.argmax(head_logits(head, hl, embed_sub), axis=-1)]
    return tok.astype(jnp.int32)[:, None], new_kv


def _spec_buckets(rc: RunnerConfig) -> tuple[int, ...]:
    return tuple(b for b in rc.batch_buckets if b <= rc.spec_max_batch)


def _layer_jobs(drafter: _LayerDrafter, runner: ModelRunner, shapes: list[tuple[int, int, int]]) -> list:
    """Thunks compiling `drafter`'s layer stack and its KV write at (batch, new tokens, context)
    over `runner`'s pools; see the module docstring."""
    ring = runner.rc.ring_pages
    fixed = abstract((drafter.dparams, drafter.head, drafter.emb, drafter.ids))
    kv = abstract(runner.kv)
    committed = runner.mesh is not None or any_committed(drafter.dparams, drafter.head, drafter.emb, drafter.ids,
                                                         runner.kv)

    def job(b: int, t: int, c: int) -> None:
        call = runner.new_call(b, t, c, spec=True)
        batch = call.batch()
        compiled = _layers_draft.lower(drafter.dcfg, ring, *fixed, kv, batch).compile()
        new_kv = outputs(compiled, committed)[1]
        _write.lower(ring, kv, write_batch(batch, runner.rc.page_size, ring), new_kv).compile()

    return [partial(job, *s) for s in shapes]


def _layer_first_runs(drafter: _LayerDrafter, runner: ModelRunner, shapes: list[tuple[int, int, int]]) -> list:
    """Thunks running `drafter`'s layer stack and its KV write once at each shape `_layer_jobs`
    compiles, on the scratch page (all-zero page tables: engine/first_runs.py)."""
    ring, page = runner.rc.ring_pages, runner.rc.page_size

    def run(b: int, t: int, c: int) -> None:
        call = runner.new_call(b, t, c, spec=True)
        call.n_new[:] = t
        batch = call.batch()
        tokens, new_kv = _layers_draft(drafter.dcfg, ring, drafter.dparams, drafter.head, drafter.emb,
                                       drafter.ids, runner.kv, batch)
        runner.kv = _write(ring, runner.kv, write_batch(batch, page, ring), new_kv)
        np.asarray(tokens)

    return [partial(run, *s) for s in shapes]


class _LayerDrafter(Proposer):
    """Shared by early exit and the draft model: an autoregressive layer-stack chain."""

    wants_hidden = False

    def _setup(self, cfg: ModelConfig, params: Params, head: Head, slices: _VocabSlices, n_vocab: int) -> None:
        self.dcfg, self.dparams, self.head = cfg, params, head
        self.emb, self.ids = slices.get(n_vocab)
        self.slices = slices

    def _chain(self, runner: ModelRunner, pool: KVPool, seqs: list[Sequence], pages: list[SeqPages],
               depth: int) -> np.ndarray:
        """Draft `depth` tokens for every row: [n, depth] int32 (writes draft K/V at positions >= num_cached)."""
        n = len(seqs)
        ctx = max(s.num_cached + depth for s in seqs)
        c = runner.new_call(bucket(n, self._buckets), 1, ctx, spec=True)
        for i, (s, pg) in enumerate(zip(seqs, pages)):
            pool.fill_tables(pg, c.global_table[i], c.local_table[i])
            c.tokens[i, 0] = s.tokens[s.num_cached]
            c.start[i], c.n_new[i] = s.num_cached, 1
        # Host arrays in, device tokens fed straight back: no eager jnp op (each would compile).
        tokens, out = c.tokens, []
        for j in range(depth):
            batch = Batch(tokens, c.start + j, c.n_new, c.global_table, c.local_table)
            tokens, new_kv = _layers_draft(self.dcfg, runner.rc.ring_pages, self.dparams, self.head, self.emb,
                                           self.ids, runner.kv, batch)
            runner.kv = _write(runner.rc.ring_pages, runner.kv,
                               write_batch(batch, runner.rc.page_size, runner.rc.ring_pages), new_kv)
            out.append(tokens)
        return np.concatenate([np.asarray(t) for t in out], axis=1)[:n]

    def _chain_shapes(self, runner: ModelRunner) -> list[tuple[int, int, int]]:
        return [(b, 1, c) for b in self._buckets for c in runner.rc.spec_contexts]

    def _job_shapes(self) -> tuple[ModelRunner, list[tuple[int, int, int]]]:
        """The runner whose pools the layer stack reads and writes, and every (batch, new tokens,
        context) it runs at."""
        raise NotImplementedError

    def compile_jobs(self) -> list:
        return _layer_jobs(self, *self._job_shapes())

    def first_run_jobs(self) -> list:
        """Each compiled shape run once (engine/first_runs.py)."""
        return _layer_first_runs(self, *self._job_shapes())

    def warmup(self, progress: bool = True) -> None:
        for job in self.compile_jobs():
            job()


def _identity_head(d: int, dtype) -> Head:
    return {"w1": jnp.zeros((d, 1), dtype), "b1": jnp.zeros((1,), dtype), "w2": jnp.zeros((1, d), dtype)}


def _tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
