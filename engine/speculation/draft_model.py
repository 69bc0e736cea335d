"""The draft-model proposer: a smaller model drafting autoregressively, its KV lent by the pool split.

1. The policy's pool split withholds `pool_split` of each KV pool from the
   tenants (engine/memory/kv.KVPool.set_split): the reservation.
2. A truncated-layer draft (the target's first L layers, the default) has the
   target's KV shape, so its sequences hold pages of the engine's own pools,
   taken from the reservation (`PageAllocator.alloc(lend=True)`), and it
   reads and writes the first L layers of `core.runner.kv`: no KV arrays of its
   own. A draft without global layers takes no global pages. Split 0 lends
   nothing: the draft cannot draft.
3. Lent pages come back whenever the tenant pages of their sequence do
   (finished, aborted, preempted, a failed admission: the pool's "release"),
   when the reservation shrinks below what the draft holds (a new split or
   the split yielding to a long request: "split"; whole sequences go back,
   the largest first, and drafting stops for them until pages are free), and
   before the pools are cleared (engine recover(): "reset"). They are never
   shared into the prefix cache: taken fresh, never registered, freed to the
   free list.
4. A draft model of another shape (not the target's leading layers) keeps
   separate KV arrays sized for the largest split's bytes; the split caps the
   pages it uses, and `resident_bytes` counts those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.execute.runner import ModelRunner, RunnerConfig
from engine.execute.sequence import Sequence
from engine.memory.kv import KVPool, SeqPages
from engine.model.gemma import Params, table_dtype
from engine.policy import MAX_POOL_SPLIT, TunedPolicy
from engine.speculation.heads import DraftHeads, Head
from engine.speculation.layer_draft import (
    CATCH_UP_TOKENS,
    DRAFT_VOCABS,
    _identity_head,
    _LayerDrafter,
    _tree_bytes,
    _VocabSlices,
)


@dataclass
class _Held:
    """The draft's cache of one sequence."""

    seq: Sequence
    pages: SeqPages = field(default_factory=lambda: SeqPages([], []))
    cached: int = 0
    """Positions whose draft K/V are written (drafts past the accepted prefix are stale)."""


def kv_prefix(draft: ModelConfig, target: ModelConfig) -> bool:
    """Whether `draft`'s layers have the KV shape of `target`'s first layers (same kinds, heads,
    head size and window): its K/V can live in the target's page arrays."""
    return (draft.n_layers <= target.n_layers and draft.n_kv_heads == target.n_kv_heads
            and draft.head_dim == target.head_dim and draft.sliding_window == target.sliding_window
            and all(draft.is_global(i) == target.is_global(i) for i in range(draft.n_layers)))


class DraftModelProposer(_LayerDrafter):
    """A smaller model sharing the tokenizer, its KV pages lent by the pool split.

    `cfg`/`params`: the draft model (params with stacked or per-layer weights).
    `head`: an adapter applied before its tied output (identity when None).
    """

    name = "draft"

    def __init__(self, cfg: ModelConfig, params: Params, vocab: np.ndarray, head: Head | None = None,
                 draft_vocab: int = DRAFT_VOCABS[-1], shares_weights: bool = False):
        self._cfg, self._params, self._vocab, self._n_vocab = cfg, params, vocab, draft_vocab
        self._head = head if head is not None else _identity_head(cfg.d_model, table_dtype(params["embed"]))
        self.shares_weights = shares_weights
        self.lends = False
        """Whether its KV lives in the target's pools (set by `bind`)."""
        self._state: dict[str, _Held] = {}  # request id -> its draft cache

    @staticmethod
    def truncated(target_params: Params, cfg: ModelConfig, heads: DraftHeads, layers: int | None = None,
                  draft_vocab: int = DRAFT_VOCABS[-1]) -> DraftModelProposer:
        """The first `layers` layers of the target as a separate draft model (sharing buffers)."""
        layers = layers if layers is not None else min(heads.exits)
        if layers not in heads.exits:
            raise ValueError(f"no exit adapter after {layers} layers (have {sorted(heads.exits)})")
        dcfg = cfg.replace(name=f"{cfg.name}-first{layers}", n_layers=layers)
        params = {"embed": target_params["embed"], "final_norm": target_params["final_norm"],
                  "layers": target_params["layers"][:layers]}
        return DraftModelProposer(dcfg, params, heads.vocab, heads.exits[layers], draft_vocab,
                                  shares_weights=True)

    def bind(self, core) -> None:
        trc = core.runner.rc
        self._core = core
        self.lends = self.shares_weights and kv_prefix(self._cfg, core.cfg)
        if self.lends:
            self.runner, self.pool, params = core.runner, core.pool, self._params
            core.pool.on_lend = self._on_lend
        else:
            g_max, l_max = self._max_pages(core, trc)
            rc = replace(trc, global_pages=g_max, local_pages=l_max, fast_output=False, tensor_parallel=1)
            self.runner = ModelRunner(self._cfg, self._params, rc)
            self.pool = KVPool(g_max, l_max, trc.page_size, trc.ring_pages)
            params = self.runner.params
        slices = _VocabSlices(core.runner.params["embed"], self._vocab, (self._n_vocab,))
        self._setup(self._cfg, params, self._head, slices, self._n_vocab)
        self.most_tokens = max(CATCH_UP_TOKENS, min(trc.spec_max_batch, trc.max_batch))
        self.configure(core.policy)

    def _max_pages(self, core, trc: RunnerConfig) -> tuple[int, int]:
        """Separate arrays: pool sizes for the largest split, the bytes it lends in this model's pages."""
        pool = core.pool
        lend = int(MAX_POOL_SPLIT * (pool.global_alloc.num_pages * _page_bytes(core.cfg, trc, "global")
                                     + pool.local_alloc.num_pages * _page_bytes(core.cfg, trc, "local")))
        g_b, l_b = _page_bytes(self._cfg, trc, "global"), _page_bytes(self._cfg, trc, "local")
        seq_pages = trc.max_context // trc.page_size
        if not g_b:  # no global layers: global pages cost nothing, one table's worth per row
            return seq_pages * trc.spec_max_batch + 1, max(2, lend // max(l_b, 1) + 1)
        share = lend * g_b * seq_pages // (g_b * seq_pages + l_b * trc.ring_pages)
        return max(2, share // g_b + 1), max(2, (lend - share) // max(l_b, 1) + 1)

    def configure(self, policy: TunedPolicy) -> None:
        """Lent pages follow the engine pool's split (set just before); separate arrays: the
        split's share of them is usable, the rest stays unused."""
        if self.lends:
            return
        share = policy.pool_split / MAX_POOL_SPLIT
        has_global = bool(self._cfg.global_layers)  # without global layers those pages cost nothing
        for a, costs in ((self.pool.global_alloc, has_global), (self.pool.local_alloc, True)):
            a.reserved = a.num_pages - 1 - int((a.num_pages - 1) * share) if costs else 0

    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        ready, pages, fed = [], [], []
        for i, s in enumerate(seqs):
            held = self._hold(s, depth)
            if held is not None:
                ready.append(i)
                pages.append(held.pages)
                fed.append(held.cached)
        if ready:
            toks = self._chain(self.pool, [seqs[i] for i in ready], pages, depth, fed)
            for i, t in zip(ready, toks):
                out[i] = t.tolist()
                self._state[seqs[i].request_id].cached = seqs[i].num_cached + depth
        return out

    def _hold(self, s: Sequence, depth: int) -> _Held | None:
        """The draft's cache of s with pages up to its drafts; None when it cannot hold s. Its
        `cached` tokens are valid: the chain feeds the rest (its catch-up) before drafting."""
        held = self._state.setdefault(s.request_id, _Held(s))
        held.seq, held.cached = s, min(held.cached, s.num_cached)
        if not self._grow(held.pages, s.num_cached + depth):
            self._give_back(s.request_id)
            return None
        return held

    def _grow(self, pages: SeqPages, length: int) -> bool:
        """Pages for positions [0, length): lent from the engine's reservation, or from its own pool."""
        if not self.lends:
            return self.pool.grow(pages, length)
        g, r = self.pool.needed(pages, length)  # never shared, so no spare pages
        ga, la = self.pool.global_alloc, self.pool.local_alloc
        got = ga.alloc(g, lend=True) if g and self._cfg.global_layers else []
        ring = la.alloc(r, lend=True) if r and got is not None else []
        if got is None or ring is None:
            ga.free(got or [])
            return False
        pages.global_pages += got
        pages.ring_block += range(len(pages.ring), len(pages.ring) + r)
        pages.ring += ring
        return True

    def _give_back(self, request_id: str) -> None:
        held = self._state.pop(request_id, None)
        if held is not None:
            self.pool.release(held.pages)

    def _on_lend(self, event: str, pages: SeqPages | None = None) -> None:
        """engine/memory/kv.KVPool's notice (module docstring, step 3)."""
        if event == "release":
            for rid, held in list(self._state.items()):
                if held.seq.pages is pages:
                    self._give_back(rid)
        elif event == "split":
            self.shed()
        elif event == "reset":
            self._state.clear()

    def shed(self) -> None:
        """Give whole sequences' pages back, the largest first, until the draft holds no more
        than the reservation lends."""
        allocs = (self.pool.global_alloc, self.pool.local_alloc)
        by_size = sorted(self._state,
                         key=lambda r: -len(self._state[r].pages.global_pages + self._state[r].pages.ring))
        for rid in by_size:
            if all(len(a.lent) <= a.reserved for a in allocs):
                return
            self._give_back(rid)

    def release(self, seq: Sequence) -> None:
        self._give_back(seq.request_id)

    def held_pages(self) -> int:
        """Pages the draft's sequences hold now (lent ones, or of its own pool)."""
        return sum(len(h.pages.global_pages) + len(h.pages.ring) for h in self._state.values())

    def resident_bytes(self) -> int:
        own = 0 if self.shares_weights else _tree_bytes(self._params)
        arrays = 0 if self.lends or not hasattr(self, "runner") else self.runner.kv.nbytes()
        return own + arrays + _tree_bytes(self._head) + self.slices.nbytes()


def _page_bytes(cfg: ModelConfig, rc: RunnerConfig, kind: str) -> int:
    """K+V bytes of one page of one pool kind ("global" or "local")."""
    item = jnp.dtype(rc.kv_dtype).itemsize
    n = {"global": len(cfg.global_layers), "local": len(cfg.local_layers)}[kind]
    return 2 * n * rc.page_size * cfg.n_kv_heads * cfg.head_dim * item
