"""The model runner: owns device state, buckets shapes, compiles once, runs steps.

1. The scheduler hands over numpy arrays for one call (tokens, page tables, ...).
2. `bucket_shape` pads them to the smallest configured bucket (batch, new
   tokens, page-table width), so only warmed-up shapes reach `jax.jit`.
3. `_forward` (jitted) runs the layers over the cache; `_write` (jitted, KV
   donated) scatters the new K/V in place;
   `_sample` (jitted apart, its shapes do not depend on context) picks tokens.
4. The runner keeps the new KV state and returns tokens/logprobs as numpy.
A process-wide counter of jit compilations lets tests prove that serving
after `warmup()` compiles nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.kv import Batch, KVState, cache_reader, write_new
from engine.model import Params, forward, logits, unstack_layers
from engine.progress import Reporter, Steps, note
from engine.penalties import SPARE_ENTRIES
from engine.sampling import (Adjust, SamplingArrays, adjust_logits, greedy, sample, top_candidates, top_logprobs,
                             verify)

_compiles = 0
_compiles_lock = threading.Lock()


def _on_event(name: str, *_args, **_kw) -> None:
    global _compiles
    # Lowering runs on every in-memory jit cache miss, also when the persistent
    # compilation cache then supplies the executable: it counts new shapes.
    if name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        with _compiles_lock:
            _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Jit compilations (cache misses) in this process so far, any function."""
    return _compiles


def memory_mappings() -> int | None:
    """Memory mappings of this process (Linux), None where unknown."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """The mappings compiled code may take in this process (None: no known cap, or not XLA:CPU,
    whose kernels live on the host; see engine.loader.MAPS_PER_SHAPE)."""
    if jax.default_backend() != "cpu":
        return None
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def enable_persistent_cache(path: str | None = None) -> str:
    """Keep compiled executables on disk so a restart (or the next test run) skips XLA.

    Defaults to $CROSSOVER_CACHE/jax (or ~/.cache/crossover/jax).
    """
    import os

    if path is None:
        root = os.environ.get("CROSSOVER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "crossover")
        path = os.path.join(root, "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


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
    dtype: str = "float32"
    """Compute dtype of weights and activations."""
    kv_dtype: str = "float32"
    """Storage dtype of the KV pools."""
    fast_output: bool = False
    """Float32 model: score the vocabulary in bfloat16 for 2+ rows, rescoring the top 16 exactly
    (see output_logits; costs a bfloat16 copy of the embedding)."""
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
    runner) and at least FAST_OUTPUT_MIN_ROWS rows, the 262k-row product runs
    in bfloat16 (XLA:CPU: 1.5-2x faster than float32 from 2 rows on, ~8x slower
    for a single row) and the top RESCORE candidates of each row are recomputed
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
    approx = jnp.einsum("btd,vd->btv", hs.astype(fast.dtype), fast, preferred_element_type=jnp.float32)
    top = jnp.sort(top_candidates(approx, RESCORE), axis=-1)  # [B, Tl, k], ascending ids: ties go low
    exact = jnp.einsum("btd,btkd->btk", hs, jnp.take(params["embed"], top, axis=0),
                       preferred_element_type=jnp.float32)
    best = jnp.take_along_axis(top, jnp.argmax(exact, axis=-1)[..., None], axis=-1)[..., 0]
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(Tl)[None, :, None]
    return Scores(approx.at[b, t, top].set(exact), best.astype(jnp.int32))


def output_logits(params: Params, hs: jax.Array) -> jax.Array:
    """The logits of output_scores, [B, Tl, V] float32."""
    return output_scores(params, hs).logits


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


def forward_and_write(cfg: ModelConfig, ring_pages: int, params: Params, kv: KVState, batch: Batch, logit_idx):
    """(new kv, Scores, hidden) for one call."""
    sc, hs, new_kv = _forward(cfg, ring_pages, params, kv, batch, logit_idx)
    return _write(ring_pages, kv, batch, new_kv), sc, hs


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


@jax.jit
def _sample(sc: Scores, samp: SamplingArrays, counter, adj: Adjust | None = None):
    """Sampling is compiled apart from the forward: its shapes do not depend on context."""
    B, Tl, V = sc.logits.shape
    rows = jax.tree.map(lambda a: jnp.repeat(a, Tl, axis=0), samp)
    lg, best, raw = _adjusted(sc, adj)
    tok, lp = sample(lg, rows, counter.reshape(-1), best=best, raw=raw)
    ti, tl = top_logprobs(sc.logits.reshape(B * Tl, V), rows)
    return tok.reshape(B, Tl), lp.reshape(B, Tl), ti.reshape(B, Tl, -1), tl.reshape(B, Tl, -1)


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
    adjust: dict[str, np.ndarray] | None = None
    """engine.sampling.Adjust buffers [B, Tl, H] once a row has penalties or banned ids."""


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

    def new_call(self, batch: int, new_tokens: int, context: int, logits_per_row: int = 1) -> CallArrays:
        """Zeroed, bucket-padded host arrays (scratch pages, padding rows)."""
        rc = self.rc
        B = bucket(batch, rc.batch_buckets)
        T = 1 if new_tokens == 1 else bucket(new_tokens, rc.prefill_buckets)
        P = bucket(context, rc.context_buckets) // rc.page_size
        return CallArrays(
            tokens=np.zeros((B, T), np.int32),
            start=np.zeros(B, np.int32),
            n_new=np.zeros(B, np.int32),
            global_table=np.zeros((B, P), np.int32),
            local_table=np.zeros((B, min(rc.ring_pages, P)), np.int32),
            logit_idx=np.zeros((B, logits_per_row), np.int32),
            counter=np.zeros((B, logits_per_row), np.int32),
            samp=SamplingArrays.host(B),
        )

    def new_verify_call(self, batch: int, depth: int, context: int) -> CallArrays:
        """Host arrays for verifying up to `depth` drafts per row: T = bucket(1 + depth)."""
        rc = self.rc
        B = bucket(batch, tuple(b for b in rc.batch_buckets if b <= rc.spec_max_batch))
        T = bucket(1 + depth, rc.verify_tokens)
        c = self.new_call(B, 1, context, logits_per_row=T)
        c.tokens = np.zeros((B, T), np.int32)
        c.logit_idx[:] = np.arange(T, dtype=np.int32)
        return c

    def top_at(self, row: int, n: int) -> list[list[tuple[int, float]]] | None:
        """The latest call's most likely (token, logprob) pairs, best first, at the first n
        positions of `row`; None when no row of it asked for logprobs."""
        if self.last_top is None:
            return None
        ids, lps = self.last_top
        return [list(zip(ids[row, j].tolist(), lps[row, j].tolist(), strict=True)) for j in range(n)]

    def adjust_arrays(self, c: CallArrays) -> dict[str, np.ndarray]:
        """c's logit-adjustment buffers (engine.penalties fills them), made on first use."""
        if c.adjust is None:
            c.adjust = Adjust.host((*c.counter.shape, self.adjust_width))
        return c.adjust

    def run(self, c: CallArrays) -> tuple[np.ndarray, np.ndarray]:
        """Execute one call; returns (tokens [B, Tl], logprobs [B, Tl]) as numpy."""
        batch = Batch(c.tokens, c.start, c.n_new, c.global_table, c.local_table)
        self.kv, sc, self.last_hidden = forward_and_write(self.cfg, self.rc.ring_pages, self.params, self.kv, batch, c.logit_idx)
        tok, lp, *top = _sample(sc, SamplingArrays(**c.samp), c.counter, _adjust(c))
        self.last_top = tuple(map(np.asarray, top)) if c.samp["want_logprobs"].any() else None
        return np.asarray(tok), np.asarray(lp)

    def run_verify(self, c: CallArrays, cand: np.ndarray):
        """Forward over [last token, drafts...] and verify: (tokens, accepted, logprobs) [B, T]."""
        batch = Batch(c.tokens, c.start, c.n_new, c.global_table, c.local_table)
        self.kv, sc, self.last_hidden = forward_and_write(self.cfg, self.rc.ring_pages, self.params, self.kv, batch, c.logit_idx)
        tok, acc, lp, *top = _verify(sc, cand, SamplingArrays(**c.samp), c.counter, _adjust(c))
        self.last_top = tuple(map(np.asarray, top)) if c.samp["want_logprobs"].any() else None
        return np.asarray(tok), np.asarray(acc), np.asarray(lp)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch, new_tokens, context) the engine may call with."""
        rc = self.rc
        out = [(b, 1, c) for b in rc.batch_buckets for c in rc.context_buckets]
        out += [(1, t, c) for t in rc.prefill_buckets for c in rc.context_buckets]
        return out

    def verify_shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch, 1 + depth, context) speculation may verify with."""
        rc = self.rc
        bs = [b for b in rc.batch_buckets if b <= rc.spec_max_batch]
        return [(b, t, c) for b in bs for t in rc.verify_tokens for c in rc.context_buckets]

    def warmup(self, progress: Reporter = True) -> None:
        """Compile (and run once, harmlessly on scratch) every bucketed shape; `progress`
        (engine/progress.py) sees each shape compiled."""
        shapes = [(s, False) for s in self.shapes()] + [(s, True) for s in self.verify_shapes()]
        t0 = time.perf_counter()
        with Steps(progress, "warmup: compiling shapes", len(shapes)) as bar:
            for (b, t, c), is_verify in shapes:
                if is_verify:
                    call = self.new_verify_call(b, t - 1, c)
                    self.run_verify(call, np.full(call.tokens.shape, -1, np.int32))
                else:
                    self.run(self.new_call(b, t, c))
                bar.advance()
        self._warm_adjusted(shapes)
        note(progress, f"warmup: {len(shapes)} shapes compiled in {time.perf_counter() - t0:.1f}s")
        self.warm_compiles = compile_count()

    def _warm_adjusted(self, shapes) -> None:
        """Compile the sampling of calls with logit adjustments (penalties, min_tokens) at each
        (batch, logits per row) the calls use; sampling's shapes do not depend on context, so no
        forward runs."""
        V = self.params["embed"].shape[0]
        for b, t, is_verify in sorted({(b, t if v else 1, v) for (b, t, _), v in shapes}):
            sc = Scores(jnp.zeros((b, t, V), jnp.float32), jnp.zeros((b, t), jnp.int32))
            if self.mesh is not None:  # the scores of a real call, laid out over the mesh as serving's are
                sc = self._mesh_scores(b, t, is_verify)
            samp, counter = SamplingArrays(**SamplingArrays.host(b)), np.zeros((b, t), np.int32)
            adj = Adjust(**Adjust.host((b, t, self.adjust_width)))
            if is_verify:
                _verify(sc, np.full((b, t), -1, np.int32), samp, counter, adj)
            else:
                _sample(sc, samp, counter, adj)


    def _mesh_scores(self, b: int, t: int, is_verify: bool) -> Scores:
        """Scores of a harmless scratch forward at (b, t), placed as a served call's are."""
        c = (self.new_verify_call(b, t - 1, self.rc.context_buckets[0]) if is_verify
             else self.new_call(b, 1, self.rc.context_buckets[0]))
        batch = Batch(c.tokens, c.start, c.n_new, c.global_table, c.local_table)
        self.kv, sc, _ = forward_and_write(self.cfg, self.rc.ring_pages, self.params, self.kv, batch, c.logit_idx)
        return sc


def _adjust(c: CallArrays) -> Adjust | None:
    return None if c.adjust is None else Adjust(**c.adjust)
