"""Model-based proposers: MTP heads, early-exit self-drafts and a draft model.

All three draft greedily with small trained heads (engine/speculation/heads.py) over a
draft vocabulary, so every proposal is a point mass and verification
(engine/execute/sampling.verify) stays lossless.

- `MtpProposer`: the target's final hidden state at its newest position
  (kept per sequence by the core) and the token the target sampled from it
  go through chained heads, head k drafting the token k+1 places ahead from
  the previous head's state and draft (engine/speculation/heads.py); the chain runs in
  one call. Unchained (Medusa) heads all read the hidden state at once.
  Resident: the heads and the draft-vocabulary slices of the tied embedding.
- `EarlyExitProposer`: the first L target layers plus an exit adapter, run
  autoregressively. It reads the target's own KV pages (those layers' keys
  and values are the same) and writes its draft tokens' K/V into the slots
  that verification overwrites next, so it needs no KV of its own.
- `DraftModelProposer` (engine/speculation/draft_model.py): a separate smaller model,
  caught up on each sequence's tokens before drafting, its KV pages lent by
  the policy's pool split out of the tenants' own pools (pages withheld from
  tenants), so drafting stops for sequences it cannot hold. For the default
  270M target the draft is a truncated-layer copy sharing the target's layer
  buffers and KV arrays.

Warmup: each proposer's `compile_jobs()` lists thunks that compile its shapes
ahead of time from array metadata (engine/runtime/compiles.abstract), touching no
device state, so engine/warmup/warm.py may run them on a background thread while
the engine serves; `warmup()` runs them in place.

The draft vocabularies and the layer-stack drafter both layer-based proposers
share are engine/speculation/layer_draft.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.execute.runner import bucket
from engine.execute.sequence import Sequence
from engine.model.gemma import table_dtype
from engine.policy import TunedPolicy
from engine.runtime.compiles import abstract, compile_ahead
from engine.speculation.draft_model import DraftModelProposer
from engine.speculation.heads import (
    DraftHeads,
    Head,
    apply_chain_head,
    apply_head,
    draft_logits,
    token_features,
)
from engine.speculation.layer_draft import DRAFT_VOCABS, _LayerDrafter, _VocabSlices, spec_batches
from engine.speculation.proposers import Proposer


@jax.jit
def _mtp_draft(heads: tuple[Head, ...], h, embed_sub, ids):
    """Greedy draft of every head from h [B, d]: [B, K] int32 token ids.

    One output matmul over the stacked head outputs, so the draft-vocabulary
    table is read once per step whatever the depth.
    """
    z = jnp.stack([apply_head(hd, h) for hd in heads], axis=1)  # [B, K, d]
    lg = draft_logits(z, embed_sub)
    return ids[jnp.argmax(lg, axis=-1)].astype(jnp.int32)


@jax.jit
def _mtp_chain_draft(heads: Head, h, last, embed, embed_sub, ids, k):
    """Greedy draft of the first k chained heads, stacked ({"w1": [K, 2d, r], ...}), from h [B, d]
    and the newest tokens last [B]: [B, K] (columns k on: 0). k is traced, so one executable
    serves every depth."""
    B, K = h.shape[0], heads["w1"].shape[0]

    def one(j, carry):
        s, tok, out = carry
        s = apply_chain_head({n: a[j] for n, a in heads.items()}, s,
                             token_features(embed, tok)).astype(h.dtype)
        lg = draft_logits(s, embed_sub)
        tok = ids[jnp.argmax(lg, axis=-1)].astype(jnp.int32)
        return s, tok, out.at[:, j].set(tok)

    return jax.lax.fori_loop(0, k, one, (h, last.astype(jnp.int32), jnp.zeros((B, K), jnp.int32)))[2]


class MtpProposer(Proposer):
    """MTP heads over the target's newest final hidden state (and, chained, its newest token)."""

    name = "mtp"
    wants_hidden = True

    def __init__(self, heads: DraftHeads, embed: jax.Array, sizes: tuple[int, ...] = DRAFT_VOCABS,
                 draft_vocab: int = 0):
        if not heads.mtp:
            raise ValueError("the heads file has no MTP heads")
        self.chained = heads.chained
        # chained heads run as one stack (`_mtp_chain_draft`: one executable for every depth)
        self.heads = ({n: jnp.stack([h[n] for h in heads.mtp]) for n in heads.mtp[0]} if self.chained
                      else tuple(heads.mtp))
        self.embed = embed
        self.head_bytes = sum(heads.head_bytes(h) for h in heads.mtp)
        self.slices = _VocabSlices(embed, heads.vocab, sizes)
        self.default_vocab = min((n for n in self.slices.by_size if n), default=0)
        """What a policy's draft_vocab 0 means: the smallest compiled vocabulary (drafting over
        the full 262k ids costs as much as the target's own output layer)."""
        self.draft_vocab = self._vocab(draft_vocab)
        self.max_depth = len(heads.mtp)
        self._buckets: tuple[int, ...] = (1,)

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.slices.by_size))

    def bind(self, core) -> None:
        self._buckets = spec_batches(core.runner.rc)
        self._d = core.cfg.d_model
        self._dtype = table_dtype(core.runner.params["embed"])

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
        toks = np.asarray(self._draft(k, jnp.asarray(h, self._dtype), last, emb, ids))
        out = [[] for _ in seqs]
        for i in ready:
            out[i] = toks[i, :k].tolist()
        return out

    def _draft(self, k: int, h: jax.Array, last: np.ndarray, emb, ids) -> jax.Array:
        """[B, >= k] drafts of depth k."""
        if self.chained:
            return _mtp_chain_draft(self.heads, h, last, self.embed, emb, ids, np.int32(k))
        return _mtp_draft(self._heads_for(k), h, emb, ids)

    def _heads_for(self, k: int) -> tuple[Head, ...]:
        """Unchained heads for depth k: the first k rounded up to a power of two (one call
        either way, fewer compiled shapes)."""
        n = 1
        while n < k:
            n *= 2
        return self.heads[: min(n, self.max_depth)]

    def resident_bytes(self) -> int:
        return self.head_bytes + self.slices.nbytes()

    def _job_shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch, draft vocabulary, heads run) `propose` may use (chained: the stack's
        one executable, run at the deepest depth)."""
        if self.chained:
            ks = [self.max_depth]
        else:
            ks = sorted({len(self._heads_for(k)) for k in range(1, self.max_depth + 1)})
        return [(b, n, k) for b in self._buckets for n in self.vocab_sizes for k in ks]

    def compile_jobs(self) -> list:
        """One thunk per shape of `_job_shapes`."""
        heads, embed = abstract(self.heads), abstract(self.embed)

        def job(b: int, n: int, k: int) -> None:
            emb, ids = abstract(self.slices.get(n))
            h, last = jax.ShapeDtypeStruct((b, self._d), self._dtype), np.zeros((b,), np.int32)
            if self.chained:
                compile_ahead(_mtp_chain_draft.lower(heads, h, last, embed, emb, ids, np.int32(k)))
            else:
                compile_ahead(_mtp_draft.lower(heads[:k], h, emb, ids))

        return [partial(job, *s) for s in self._job_shapes()]

    def first_run_jobs(self) -> list:
        """Each shape of `_job_shapes` run once on zeros, as `propose` calls it
        (engine/warmup/first_runs.py)."""

        def run(b: int, n: int, k: int) -> None:
            emb, ids = self.slices.get(n)
            h = jnp.asarray(np.zeros((b, self._d), np.float32), self._dtype)
            np.asarray(self._draft(k, h, np.zeros((b,), np.int32), emb, ids))

        return [partial(run, *s) for s in self._job_shapes()]

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
        self._core, self.runner = core, core.runner
        self.most_tokens = spec_batches(core.runner.rc)[-1]  # one token per row

    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        toks = self._chain(self._core.pool, seqs, [s.pages for s in seqs], depth)
        return [t.tolist() for t in toks]

    def resident_bytes(self) -> int:
        return self.head_bytes + self.slices.nbytes()


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
        core.add_proposer(DraftModelProposer.truncated(core.runner.params, core.cfg, heads, draft_layers,
                                                       restricted))
