"""The pieces the layer-based proposers share (drafting.py and draft_model.py, beside this file).

- `DRAFT_VOCABS` and `_VocabSlices`: the tied embedding restricted to a draft
  vocabulary (its first n ids), per n.
- `_layers_draft`: one ragged call (engine/model/ragged.py) of a layer stack over new tokens, and a
  greedy draft from each row's last one; `_LayerDrafter._chain` runs it D times.
- `_layer_jobs`: thunks compiling those calls ahead of time from array
  metadata (engine/runtime/compiles.abstract), touching no device state.

Draft chain of one step for a layer-based proposer, depth D, newest token b at
position p (p = num_cached): feed b at p -> d1; feed d1 at p+1 -> d2; ... up to
dD. A drafter with a cache of its own feeds, in the first call, the tokens its
cache lacks before b (its catch-up: the tokens accepted since it last drafted),
so that call's rows have several tokens, the others one each. Positions >= p are
invisible to later reads of the target (a row reads its first num_cached), so
rejected drafts never leak into the target's attention.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.execute.ragged_calls import TOKEN_BUCKETS, _write, table_width, token_buckets
from engine.execute.runner import ModelRunner, bucket
from engine.execute.sequence import Sequence
from engine.memory.kv import KVPool, SeqPages
from engine.model import ragged
from engine.model.gemma import ATTEND_BLOCK, Params, embedding_rows, table_vocab
from engine.model.ragged import RaggedBatch
from engine.quant.formats import select_columns, selectable
from engine.runtime.compiles import abstract, any_committed, compile_ahead, outputs
from engine.speculation.heads import Head, head_logits
from engine.speculation.proposers import Proposer

DRAFT_VOCABS = (8192, 32768)
"""Restricted draft vocabularies compiled for the MTP heads (0 = the full vocabulary)."""
CATCH_UP_TOKENS = 128
"""Most tokens of a drafting call: a drafter with a cache of its own catches up on a long
prompt in calls of this many (a call's cost is about linear in its tokens from 32 on)."""


class _VocabSlices:
    """The tied embedding restricted to the first n draft-vocabulary ids, per n: float rows of a
    float table, the table's own quantized columns of a quantized one (a quarter of the bytes)."""

    def __init__(self, embed, vocab: np.ndarray, sizes: tuple[int, ...]):
        self.full = table_vocab(embed)
        self.by_size: dict[int, tuple[jax.Array, jax.Array]] = {}
        for n in sizes:
            if n == 0 or n >= self.full or n > vocab.size:
                self.by_size[0] = (embed, jnp.arange(self.full, dtype=jnp.int32))
            else:
                ids = jnp.asarray(vocab[:n], jnp.int32)
                own = selectable(embed, n)
                self.by_size[n] = (select_columns(embed, ids) if own else embedding_rows(embed, ids), ids)

    def get(self, n: int) -> tuple[jax.Array, jax.Array]:
        return self.by_size[n if n in self.by_size else 0]

    def nbytes(self) -> int:
        """Bytes of the slices (the full table is the target's own: not counted)."""
        return sum(int(e.nbytes + i.nbytes) for n, (e, i) in self.by_size.items() if n)


@partial(jax.jit, static_argnames=("cfg", "block"))
def _layers_draft(cfg: ModelConfig, params: Params, head: Head, embed_sub, ids, kv, rb: RaggedBatch, last,
                  block: int = ATTEND_BLOCK):
    """A layer stack over the call's tokens, reading the pools (engine/model/ragged.py), and a greedy
    draft at each row's last token, flat index `last` [R].

    Read-only on kv (the write is engine.execute.ragged_calls._write, a separate donated call).
    Returns (tokens [R] int32, new K/V).
    """
    h, new_kv, _ = ragged.forward(cfg, params, kv, rb, block=block)
    tok = ids[jnp.argmax(head_logits(head, h[last], embed_sub), axis=-1)]
    return tok.astype(jnp.int32), new_kv


def spec_batches(rc) -> tuple[int, ...]:
    """Batch sizes speculation's own small calls pad to (MTP heads): powers of two up to the one
    holding the most rows that speculate."""
    return tuple(token_buckets(min(rc.spec_max_batch, rc.max_batch)))


def draft_rows(rc, n_tokens: int) -> int:
    """Row slots of a drafting call of n_tokens token slots: each token its own row, up to the
    most rows that speculate."""
    return min(n_tokens, rc.spec_max_batch, rc.max_batch)


def _draft_call(rc, rows: list[tuple]) -> tuple[RaggedBatch, np.ndarray]:
    """A drafting call's RaggedBatch over `rows` ((tokens, start, global pages, ring, ring
    written) each), padded to a token bucket, and each row's last flat index [R]."""
    lens = [len(r[0]) for r in rows]
    N = bucket(sum(lens), TOKEN_BUCKETS)
    R = draft_rows(rc, N)
    rb = RaggedBatch.build(rows, N, R, table_width(rc), rc.ring_pages)
    last = np.zeros(R, np.int32)
    last[: len(rows)] = np.cumsum(lens) - 1
    return jax.tree.map(np.asarray, rb), last


def _layer_jobs(drafter: _LayerDrafter) -> list:
    """Thunks compiling `drafter`'s layer stack and its KV write at each of its token buckets over
    its runner's pools; see the module docstring."""
    runner = drafter.runner
    rc = runner.rc
    fixed = abstract((drafter.dparams, drafter.head, drafter.emb, drafter.ids))
    kv = abstract(runner.kv)
    committed = runner.mesh is not None or any_committed(drafter.dparams, drafter.head, drafter.emb,
                                                         drafter.ids, runner.kv)

    def job(n: int) -> None:
        R = draft_rows(rc, n)
        rb = jax.tree.map(np.asarray, RaggedBatch.build([], n, R, table_width(rc), rc.ring_pages))
        compiled = compile_ahead(_layers_draft.lower(drafter.dcfg, *fixed, kv, rb, np.zeros(R, np.int32)))
        compile_ahead(_write.lower(kv, rb, outputs(compiled, committed)[1]))

    return [partial(job, n) for n in drafter.token_slots()]


def _layer_first_runs(drafter: _LayerDrafter) -> list:
    """Thunks running `drafter`'s layer stack and its KV write once at each token bucket
    `_layer_jobs` compiles, as one row on the scratch page (all-zero page tables:
    engine/warmup/first_runs.py)."""
    def run(n: int) -> None:
        np.asarray(drafter._call([((0,) * n, 1, (0,), (0,))]))

    return [partial(run, n) for n in drafter.token_slots()]


class _LayerDrafter(Proposer):
    """Shared by early exit and the draft model: an autoregressive layer-stack chain over the
    pools of `runner` (set by `bind`)."""

    wants_hidden = False
    runner: ModelRunner
    most_tokens = 16
    """Most tokens of one of its calls (the largest token bucket it compiles)."""

    def _setup(self, cfg: ModelConfig, params: Params, head: Head, slices: _VocabSlices,
               n_vocab: int) -> None:
        self.dcfg, self.dparams, self.head = cfg, params, head
        self.emb, self.ids = slices.get(n_vocab)
        self.slices = slices

    def token_slots(self) -> list[int]:
        """The token buckets its calls run at."""
        return token_buckets(self.most_tokens)

    def _call(self, rows: list[tuple]) -> jax.Array:
        """One drafting call over `rows`, its K/V written: the drafts [R] on the device."""
        return self._run(*_draft_call(self.runner.rc, rows))

    def _run(self, rb: RaggedBatch, last: np.ndarray) -> jax.Array:
        runner = self.runner
        tokens, new_kv = _layers_draft(self.dcfg, self.dparams, self.head, self.emb, self.ids, runner.kv, rb,
                                       last)
        runner.kv = _write(runner.kv, rb, new_kv)
        return tokens

    def _chain(self, pool: KVPool, seqs: list[Sequence], pages: list[SeqPages], depth: int,
               fed: list[int] | None = None) -> np.ndarray:
        """Draft `depth` tokens for every row: [n, depth] int32. Row i's first call feeds its
        tokens from position fed[i] (default num_cached: its newest token alone) through its
        newest; the K/V of every token fed is written (drafts at positions >= num_cached)."""
        rc, n = self.runner.rc, len(seqs)

        def tables(i: int, cached: int) -> tuple[np.ndarray, ...]:
            g = np.zeros(table_width(rc), np.int32)
            ring, write = np.zeros(rc.ring_pages, np.int32), np.zeros(rc.ring_pages, np.int32)
            pool.fill_tables(pages[i], g, ring, write, cached)
            return g, ring, write

        start = [s.num_cached for s in seqs] if fed is None else list(fed)
        pending = [s.num_cached + 1 - a for s, a in zip(seqs, start)]
        while sum(pending) > self.most_tokens:  # catch-up too long for one call: the longest goes first
            i = max(range(n), key=pending.__getitem__)
            k = min(pending[i] - 1, self.most_tokens)
            self._call([(seqs[i].tokens[start[i]: start[i] + k], start[i], *tables(i, start[i]))])
            start[i] += k
            pending[i] -= k
        tokens = self._call([(s.tokens[a: s.num_cached + 1], a, *tables(i, a))
                             for i, (s, a) in enumerate(zip(seqs, start))])
        out = [tokens]
        for j in range(1, depth):
            rb, last = _draft_call(rc, [((0,), s.num_cached + j, *tables(i, s.num_cached + j))
                                        for i, s in enumerate(seqs)])
            # Each row's one token sits at its row's flat index: the previous drafts feed
            # straight in, on the device, when the slots match (else a host copy: no eager jnp
            # op, each would compile).
            N = len(rb.tokens)
            if tokens.shape[0] == N:
                fed_in = tokens
            else:
                fed_in = np.zeros(N, np.int32)
                fed_in[:n] = np.asarray(tokens)[:n]
            tokens = self._run(replace(rb, tokens=fed_in), last)
            out.append(tokens)
        return np.stack([np.asarray(t)[:n] for t in out], axis=1)

    def compile_jobs(self) -> list:
        return _layer_jobs(self)

    def first_run_jobs(self) -> list:
        """Each compiled shape run once (engine/warmup/first_runs.py)."""
        return _layer_first_runs(self)

    def warmup(self, progress: bool = True) -> None:
        for job in self.compile_jobs():
            job()


def _identity_head(d: int, dtype) -> Head:
    return {"w1": jnp.zeros((d, 1), dtype), "b1": jnp.zeros((1,), dtype), "w2": jnp.zeros((1, d), dtype)}


def _tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
