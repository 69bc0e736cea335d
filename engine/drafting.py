"""Model-based proposers: MTP heads, early-exit self-drafts and a draft model.

All three draft greedily with small trained heads (engine/heads.py) over a
draft vocabulary, so every proposal is a point mass and verification
(engine/sampling.verify) stays lossless.

- `MtpProposer`: the target's final hidden state at its newest position
  (kept per sequence by the core) and the token the target sampled from it
  go through chained heads, head k drafting the token k+1 places ahead from
  the previous head's state and draft (engine/heads.py); the chain runs in
  one call. Unchained (Medusa) heads all read the hidden state at once.
  Resident: the heads and the draft-vocabulary slices of the tied embedding.
- `EarlyExitProposer`: the first L target layers plus an exit adapter, run
  autoregressively. It reads the target's own KV pages (those layers' keys
  and values are the same) and writes its draft tokens' K/V into the slots
  that verification overwrites next, so it needs no KV of its own.
- `DraftModelProposer`: a separate smaller model with its own paged KV pool,
  caught up on each sequence's tokens before drafting. Its pool holds what the
  policy's pool split lends it (pages withheld from tenants), so drafting
  stops for sequences it cannot hold. For the default 270M target the draft
  is a truncated-layer copy sharing the target's layer buffers.

Warmup: each proposer's `compile_jobs()` lists thunks that compile its shapes
ahead of time from array metadata (engine/compiles.abstract), touching no
device state, so engine/warm.py may run them on a background thread while
the engine serves; `warmup()` runs them in place.

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
from engine.heads import DraftHeads, Head, apply_chain_head, apply_head, head_logits, token_features
from engine.kv import Batch, KVPool, SeqPages, cache_reader
from engine.model import Params, forward
from engine.policy import MAX_POOL_SPLIT, TunedPolicy
from engine.proposers import Proposer
from engine.runner import ModelRunner, RunnerConfig, _write, bucket, prefill_shapes, write_batch
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


@jax.jit
def _mtp_draft(heads: tuple[Head, ...], h, embed_sub, ids):
    """Greedy draft of every head from h [B, d]: [B, K] int32 token ids.

    One output matmul over the stacked head outputs, so the draft-vocabulary
    table is read once per step whatever the depth.
    """
    z = jnp.stack([apply_head(hd, h) for hd in heads], axis=1)  # [B, K, d]
    lg = jnp.einsum("bkd,vd->bkv", z, embed_sub, preferred_element_type=jnp.float32)
    return ids[jnp.argmax(lg, axis=-1)].astype(jnp.int32)


@jax.jit
def _mtp_chain_draft(heads: tuple[Head, ...], h, last, embed, embed_sub, ids):
    """Greedy draft of chained heads from h [B, d] and the newest tokens last [B]: [B, K]."""
    s, tok, out = h, last, []
    for hd in heads:
        s = apply_chain_head(hd, s, token_features(embed, tok))
        lg = jnp.einsum("bd,vd->bv", s, embed_sub, preferred_element_type=jnp.float32)
        tok = ids[jnp.argmax(lg, axis=-1)].astype(jnp.int32)
        out.append(tok)
    return jnp.stack(out, axis=1)


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
        batch = Batch(call.tokens, call.start, call.n_new, call.global_table, call.local_table)
        compiled = _layers_draft.lower(drafter.dcfg, ring, *fixed, kv, batch).compile()
        new_kv = outputs(compiled, committed)[1]
        _write.lower(ring, kv, write_batch(batch, runner.rc.page_size, ring), new_kv).compile()

    return [partial(job, *s) for s in shapes]


class MtpProposer(Proposer):
    """MTP heads over the target's newest final hidden state (and, chained, its newest token)."""

    name = "mtp"
    wants_hidden = True

    def __init__(self, heads: DraftHeads, embed: jax.Array, sizes: tuple[int, ...] = DRAFT_VOCABS,
                 draft_vocab: int = 0):
        if not heads.mtp:
            raise ValueError("the heads file has no MTP heads")
        self.heads = tuple(heads.mtp)
        self.chained = heads.chained
        self.embed = embed
        self.head_bytes = sum(heads.head_bytes(h) for h in self.heads)
        self.slices = _VocabSlices(embed, heads.vocab, sizes)
        self.default_vocab = min((n for n in self.slices.by_size if n), default=0)
        """What a policy's draft_vocab 0 means: the smallest compiled vocabulary (drafting over
        the full 262k ids costs as much as the target's own output layer)."""
        self.draft_vocab = self._vocab(draft_vocab)
        self.max_depth = len(self.heads)
        self._buckets: tuple[int, ...] = (1,)

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.slices.by_size))

    def bind(self, core) -> None:
        self._buckets = _spec_buckets(core.runner.rc)
        self._d = core.cfg.d_model
        self._dtype = core.runner.params["embed"].dtype

    def configure(self, policy: TunedPolicy) -> None:
        self.draft_vocab = self._vocab(policy.draft_vocab)

    def _vocab(self, n: int) -> int:
        return n if n and n in self.slices.by_size else self.default_vocab

    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        k = min(depth, self.max_depth)
        ready = [i for i, s in enumerate(seqs) if s.hidden is not None]
        if not ready or k == 0:
            return [[] for _ in seqs]
        h = np.zeros((bucket(len(seqs), self._buckets), self._d), np.float32)
        last = np.zeros((len(h),), np.int32)
        for i in ready:
            h[i] = seqs[i].hidden
            last[i] = seqs[i].tokens[seqs[i].num_cached]
        emb, ids = self.slices.get(self.draft_vocab)
        toks = np.asarray(self._draft(self._heads_for(k), jnp.asarray(h, self._dtype), last, emb, ids))
        out = [[] for _ in seqs]
        for i in ready:
            out[i] = toks[i, :k].tolist()
        return out

    def _draft(self, heads: tuple[Head, ...], h: jax.Array, last: np.ndarray, emb, ids) -> jax.Array:
        if self.chained:
            return _mtp_chain_draft(heads, h, last, self.embed, emb, ids)
        return _mtp_draft(heads, h, emb, ids)

    def _heads_for(self, k: int) -> tuple[Head, ...]:
        """Heads for depth k: chained, exactly k (each costs a step of the chain); else
        rounded up to a power of two (one call either way, fewer compiled shapes)."""
        if self.chained:
            return self.heads[:k]
        n = 1
        while n < k:
            n *= 2
        return self.heads[: min(n, self.max_depth)]

    def resident_bytes(self) -> int:
        return self.head_bytes + self.slices.nbytes()

    def compile_jobs(self) -> list:
        """One thunk per (batch, draft vocabulary, heads run) `propose` may use."""
        ks = sorted({len(self._heads_for(k)) for k in range(1, self.max_depth + 1)})
        heads, embed = abstract(self.heads), abstract(self.embed)

        def job(b: int, n: int, k: int) -> None:
            emb, ids = abstract(self.slices.get(n))
            h, last = jax.ShapeDtypeStruct((b, self._d), self._dtype), np.zeros((b,), np.int32)
            if self.chained:
                _mtp_chain_draft.lower(heads[:k], h, last, embed, emb, ids).compile()
            else:
                _mtp_draft.lower(heads[:k], h, emb, ids).compile()

        return [partial(job, b, n, k) for b in self._buckets for n in self.vocab_sizes for k in ks]

    def warmup(self, progress: bool = True) -> None:
        for job in self.compile_jobs():
            job()


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

    def warmup(self, progress: bool = True) -> None:
        for job in self.compile_jobs():
            job()


class EarlyExitProposer(_LayerDrafter):
    """The first `layers` target layers + an exit adapter, drafting autoregressively."""

    name = "early_exit"

    def __init__(self, heads: DraftHeads, layers: int | None = None, draft_vocab: int = DRAFT_VOCABS[-1]):
        if not heads.exits:
            raise ValueError("the heads file has no exit adapters")
        self.layers = layers if layers is not None else max(heads.exits)
        if self.layers not in heads.exits:
            raise ValueError(f"no exit adapter after {self.layers} layers (have {sorted(heads.exits)})")
        self._heads, self._n_vocab = heads, draft_vocab
        self.head_bytes = heads.head_bytes(heads.exits[self.layers])

    def bind(self, core) -> None:
        p = core.runner.params
        params = {"embed": p["embed"], "final_norm": p["final_norm"], "layers": p["layers"][: self.layers]}
        slices = _VocabSlices(p["embed"], self._heads.vocab, (self._n_vocab,))
        self._setup(core.cfg, params, self._heads.exits[self.layers], slices, self._n_vocab)
        self._core = core
        self._buckets = _spec_buckets(core.runner.rc)

    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        core = self._core
        toks = self._chain(core.runner, core.pool, seqs, [s.pages for s in seqs], depth)
        return [t.tolist() for t in toks]

    def resident_bytes(self) -> int:
        return self.head_bytes + self.slices.nbytes()

    def compile_jobs(self) -> list:
        """The draft chain's shapes over the target's pools."""
        return _layer_jobs(self, self._core.runner, self._chain_shapes(self._core.runner))


class DraftModelProposer(_LayerDrafter):
    """A smaller model sharing the tokenizer, with its own paged KV from the pool split.

    `cfg`/`params`: the draft model (params with stacked or per-layer weights).
    `head`: an adapter applied before its tied output (identity when None).
    """

    name = "draft"

    def __init__(self, cfg: ModelConfig, params: Params, vocab: np.ndarray, head: Head | None = None,
                 draft_vocab: int = DRAFT_VOCABS[-1], shares_weights: bool = False):
        self._cfg, self._params, self._vocab, self._n_vocab = cfg, params, vocab, draft_vocab
        self._head = head if head is not None else _identity_head(cfg.d_model, params["embed"].dtype)
        self.shares_weights = shares_weights
        self._state: dict[str, tuple[SeqPages, list[int]]] = {}  # request id -> (pages, [cached])

    @staticmethod
    def truncated(target_params: Params, cfg: ModelConfig, heads: DraftHeads, layers: int | None = None,
                  draft_vocab: int = DRAFT_VOCABS[-1]) -> "DraftModelProposer":
        """The first `layers` layers of the target as a separate draft model (sharing buffers)."""
        layers = layers if layers is not None else min(heads.exits)
        if layers not in heads.exits:
            raise ValueError(f"no exit adapter after {layers} layers (have {sorted(heads.exits)})")
        dcfg = cfg.replace(name=f"{cfg.name}-first{layers}", n_layers=layers)
        params = {"embed": target_params["embed"], "final_norm": target_params["final_norm"],
                  "layers": target_params["layers"][:layers]}
        return DraftModelProposer(dcfg, params, heads.vocab, heads.exits[layers], draft_vocab, shares_weights=True)

    def bind(self, core) -> None:
        trc = core.runner.rc
        self.target_pool_bytes = (
            core.pool.global_alloc.num_pages * _page_bytes(core.cfg, trc.page_size, "global", trc.kv_dtype)
            + core.pool.local_alloc.num_pages * _page_bytes(core.cfg, trc.page_size, "local", trc.kv_dtype))
        g_max, l_max = self._max_pages(core, trc)
        rc = RunnerConfig(page_size=trc.page_size, batch_buckets=_spec_buckets(trc),
                          prefill_buckets=trc.prefill_buckets, context_buckets=trc.spec_contexts,
                          global_pages=g_max, local_pages=l_max, ring_pages=trc.ring_pages,
                          spec_max_batch=trc.spec_max_batch, dtype=trc.dtype, kv_dtype=trc.kv_dtype)
        self.runner = ModelRunner(self._cfg, self._params, rc)
        self.pool = KVPool(g_max, l_max, trc.page_size, trc.ring_pages)
        slices = _VocabSlices(core.runner.params["embed"], self._vocab, (self._n_vocab,))
        self._setup(self._cfg, self.runner.params, self._head, slices, self._n_vocab)
        self._buckets = _spec_buckets(trc)
        self.configure(core.policy)

    def _max_pages(self, core, trc: RunnerConfig) -> tuple[int, int]:
        """Pool sizes for the largest split: the bytes it lends, in this model's pages."""
        lend = int(self.target_pool_bytes * MAX_POOL_SPLIT)
        g_b = _page_bytes(self._cfg, trc.page_size, "global", trc.kv_dtype)
        l_b = _page_bytes(self._cfg, trc.page_size, "local", trc.kv_dtype)
        seq_pages = trc.max_context // trc.page_size
        if not g_b:  # no global layers: global pages cost nothing, one table's worth per row
            return seq_pages * trc.spec_max_batch + 1, max(2, lend // max(l_b, 1) + 1)
        share = lend * g_b * seq_pages // (g_b * seq_pages + l_b * trc.ring_pages)
        return max(2, share // g_b + 1), max(2, (lend - share) // max(l_b, 1) + 1)

    def configure(self, policy: TunedPolicy) -> None:
        """Usable pages follow the pool split: the rest of the arrays stay unused."""
        share = policy.pool_split / MAX_POOL_SPLIT
        has_global = bool(self._cfg.global_layers)  # without global layers those pages cost nothing
        for a, costs in ((self.pool.global_alloc, has_global), (self.pool.local_alloc, True)):
            a.reserved = a.num_pages - 1 - int((a.num_pages - 1) * share) if costs else 0

    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        ready, pages = [], []
        for i, s in enumerate(seqs):
            pg = self._catch_up(s, depth)
            if pg is not None:
                ready.append(i)
                pages.append(pg)
        if ready:
            toks = self._chain(self.runner, self.pool, [seqs[i] for i in ready], pages, depth)
            for i, t in zip(ready, toks):
                out[i] = t.tolist()
                self._state[seqs[i].request_id][1][0] = seqs[i].num_cached + depth
        return out

    def _catch_up(self, s: Sequence, depth: int) -> SeqPages | None:
        """Bring the draft's cache to s.num_cached; None when its pool cannot hold s."""
        pages, cached = self._state.setdefault(s.request_id, (SeqPages([], []), [0]))
        cached[0] = min(cached[0], s.num_cached)  # drafts past the accepted prefix are stale
        if not self.pool.grow(pages, s.num_cached + depth):
            self.release(s)
            return None
        while cached[0] < s.num_cached:
            n = min(s.num_cached - cached[0], self.runner.rc.max_chunk)
            c = self.runner.new_call(1, n, cached[0] + n)
            c.tokens[0, :n] = s.tokens[cached[0] : cached[0] + n]
            c.start[0], c.n_new[0] = cached[0], n
            self.pool.fill_tables(pages, c.global_table[0], c.local_table[0])
            batch = Batch(c.tokens, c.start, c.n_new, c.global_table, c.local_table)
            _, new_kv = _layers_draft(self.dcfg, self.runner.rc.ring_pages, self.dparams, self.head, self.emb,
                                      self.ids, self.runner.kv, batch)
            self.runner.kv = _write(self.runner.rc.ring_pages, self.runner.kv,
                                    write_batch(batch, self.runner.rc.page_size, self.runner.rc.ring_pages), new_kv)
            cached[0] += n
        return pages

    def release(self, seq: Sequence) -> None:
        st = self._state.pop(seq.request_id, None)
        if st is not None:
            self.pool.release(st[0])

    def resident_bytes(self) -> int:
        own = 0 if self.shares_weights else _tree_bytes(self._params)
        return own + _tree_bytes(self._head) + self.slices.nbytes()

    def compile_jobs(self) -> list:
        """The draft chain's shapes and the catch-up prefill's, over the draft's own pools."""
        rc = self.runner.rc
        prefills = [(1, t, c) for t, c in prefill_shapes(rc.prefill_buckets, rc.context_buckets)]
        return _layer_jobs(self, self.runner, self._chain_shapes(self.runner) + prefills)


def _identity_head(d: int, dtype) -> Head:
    return {"w1": jnp.zeros((d, 1), dtype), "b1": jnp.zeros((1,), dtype), "w2": jnp.zeros((1, d), dtype)}


def _tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def _page_bytes(cfg: ModelConfig, page_size: int, kind: str, kv_dtype: str) -> int:
    """K+V bytes of one page of one pool kind ("global" or "local")."""
    item = jnp.dtype(kv_dtype).itemsize
    n = {"global": len(cfg.global_layers), "local": len(cfg.local_layers)}[kind]
    return 2 * n * page_size * cfg.n_kv_heads * cfg.head_dim * item


def add_model_proposers(core, heads: DraftHeads, techniques=("mtp", "early_exit", "draft"),
                        exit_layers: int | None = None, draft_layers: int | None = None,
                        vocab_sizes: tuple[int, ...] = DRAFT_VOCABS) -> None:
    """Load the heads-based proposers into an engine core (before its warmup).

    Early exit uses the deepest exit adapter, the draft model the shallowest,
    unless told otherwise. Example: add_model_proposers(core, DraftHeads.load(path)).
    """
    heads.check(core.cfg)
    restricted = min((v for v in vocab_sizes if v), default=0)  # adapters agree best at the trained width
    if "mtp" in techniques and heads.mtp:
        core.add_proposer(MtpProposer(heads, core.runner.params["embed"], vocab_sizes))
    if "early_exit" in techniques and heads.exits:
        core.add_proposer(EarlyExitProposer(heads, exit_layers, restricted))
    if "draft" in techniques and heads.exits:
        core.add_proposer(DraftModelProposer.truncated(core.runner.params, core.cfg, heads, draft_layers, restricted))
