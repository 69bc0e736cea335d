"""A runner's model and pools over a flat token axis: every row of a step, of any kind, in one call.

`new_call(runner, rows)` lays the rows (RaggedRow: new tokens after a cached prefix, page ids,
outputs wanted, drafts to check) out as engine/model/ragged.py's RaggedBatch, padded to a
TOKEN_BUCKETS size of tokens only; `run(runner, call)` runs the forward (hidden states of every
token), writes the new K/V into the pools in a call of its own, then `_heads` scores the output
tokens alone and draws, or verifies drafts, there. The output slots are padded to an
OUTPUT_BUCKETS size, so a call compiles one forward per token count and one head per output
count, whatever the mix of rows; the slots of rows with penalties or banned ids are drawn
again by heads calls with those logit adjustments, up to ADJUST_OUTPUTS slots each. `run` is
`launch` (dispatch, no wait) then `fetch` (read); `follow` dispatches a call whose token slots take
a launched call's draws on the device, before the host reads them (engine/step/ahead.py). The
engine's steps run as such calls (engine/step/ragged_step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.execute.runner import ModelRunner, bucket, output_scores
from engine.execute.runner import _verify as verify_scores
from engine.execute.sampling import TOP_LOGPROBS, Adjust, SamplingArrays, given_logprobs
from engine.memory.kv import KVState
from engine.model import ragged
from engine.model.gemma import ATTEND_BLOCK, Params, table_vocab
from engine.model.ragged import RaggedBatch
from engine.quant.matmul import qgreedy
from engine.runtime.compiles import abstract, any_committed, compile_ahead, outputs

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Token slots a ragged call (engine/model/ragged.py) compiles for; the largest is a step's token budget."""
OUTPUT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Output slots the heads compile for: finer than the token buckets, since each slot costs a row
of the output layer (262k rows for Gemma 3), where a token slot costs far less of the forward;
every token bucket is one of them, so a call's outputs never pad past its tokens."""
ADJUST_OUTPUTS = 16
"""Most output slots of one heads call with logit adjustments (penalties, banned ids): the
adjusted variant compiles for the output buckets up to this only (`_adjusted_heads`)."""


@partial(jax.jit, static_argnames=("cfg", "tree", "block"))
def _forward(cfg: ModelConfig, tree, leaves: tuple, kv: KVState, rb: RaggedBatch, block: int = ATTEND_BLOCK):
    """Final hidden states of every token of the call, zero-padded to [TOKEN_BUCKETS[-1], d] (so
    that `_heads` compiles per output count alone, whatever the call's token count), and its new
    K/V for `_write`. The params come as their leaves and treedef (`ModelRunner.param_leaves`):
    a call then flattens a tuple, not the nested dicts and weight dataclasses, which made up a
    good part of a one-token step's dispatch."""
    h, new_kv, _ = ragged.forward(cfg, jax.tree.unflatten(tree, leaves), kv, rb, block=block)
    return jax.numpy.pad(h, ((0, TOKEN_BUCKETS[-1] - h.shape[0]), (0, 0))), new_kv


@partial(jax.jit, donate_argnames=("kv",))
def _write(kv: KVState, rb: RaggedBatch, new_kv):
    """The call's new K/V into the donated pools, in place (a call apart from the reads: see
    engine.execute.runner._write)."""
    return ragged.write(kv, rb, new_kv)


@partial(jax.jit, static_argnames=("screen",))
def _heads(params: Params, h, out_idx, cand, samp: SamplingArrays, counter, mask, adj: Adjust | None = None,
           screen: bool = False):
    """The output layer (`params`: engine.execute.runner.output_params, the table alone) at the
    call's output tokens h[out_idx] [O, d] (h is always `_forward`'s padded [TOKEN_BUCKETS[-1], d],
    so the heads compile per output count O alone), then at each a token drawn (greedy or sampled)
    and the draft `cand` [O] (-1: none) accepted when it is that token, as
    engine.execute.sampling.verify; `adj` [O, 1, H] changes the logits first, and a grammar's
    `mask` [O, W] (-1 words: every id) keeps its tokens alone. Returns (tokens, accepted, logprobs
    [O], top ids and logprobs [O, k], the model's logprob of `cand` [O] (a scored prompt's next
    token), the hidden states [O, d]). With `screen` (the runner's `screen`: a table `qgreedy`
    serves), a call that only wants greedy tokens takes them from `qgreedy` (the same tokens,
    without the [O, vocab] logits) instead."""
    hs = h[out_idx]

    def scored():
        sc = output_scores(params, hs[:, None])
        tok, acc, lp, ti, tl = verify_scores(sc, cand[:, None], samp, counter[:, None], adj, mask[:, None])
        return tok[:, 0], acc[:, 0], lp[:, 0], ti[:, 0], tl[:, 0], given_logprobs(sc.logits[:, 0], cand, samp)

    if not screen or adj is not None:
        return *scored(), hs

    def screened():  # greedy tokens without the logits; nothing else is asked for
        tok = qgreedy(hs, params["embed"])
        O, k = hs.shape[0], min(TOP_LOGPROBS, table_vocab(params["embed"]))
        return (tok, cand == tok, jnp.zeros(O, jnp.float32), jnp.zeros((O, k), jnp.int32),
                jnp.zeros((O, k), jnp.float32), jnp.zeros(O, jnp.float32))

    plain = (~(samp.temperature > 0).any() & ~samp.want_logprobs.any() & (mask == -1).all()
             & jnp.isfinite(hs).all())
    return *jax.lax.cond(plain, screened, scored), hs


@dataclass(frozen=True)
class RaggedRow:
    """One row of a ragged call: new token ids after `start` cached ones, its page ids (the ring's
    read pages, and where they differ the pages written: engine.memory.kv.KVPool.prepare), and logits at
    its last `outputs` tokens, where output j checks draft `cand[j]` (none past `cand`)."""

    tokens: Sequence[int]
    start: int
    global_pages: Sequence[int]  # any int sequence, a numpy row too (RaggedBatch.build copies it)
    ring: Sequence[int]
    ring_write: Sequence[int] | None = None
    outputs: int = 1
    cand: Sequence[int] = ()


@dataclass
class RaggedCall:
    """Host arrays of one ragged call: its RaggedBatch and its O output slots (the first
    sum(row.outputs) real, in row order)."""

    batch: RaggedBatch
    out_idx: np.ndarray  # [O] int32 flat token index
    cand: np.ndarray  # [O] int32 draft to check (-1: none)
    counter: np.ndarray  # [O] int32 position being sampled (folds the row's key)
    out_rows: list[slice]  # per row, its slots of out_*
    samp: dict[str, np.ndarray] = field(default_factory=dict)
    adjust: dict[str, np.ndarray] | None = None
    """engine.execute.sampling.Adjust buffers [O, 1, H] once a row has penalties or banned ids."""
    mask: np.ndarray | None = None
    """[O, W] int32 grammar masks (engine/grammar.py) once a row is constrained; -1 (every id)
    elsewhere. None: `open_mask`, kept on the device."""


def new_call(runner: ModelRunner, rows: list[RaggedRow]) -> RaggedCall:
    """The host arrays of one ragged call over `rows`, padded to the smallest token bucket that
    holds their tokens, output slots to the smallest that holds their outputs; sampling
    greedy until the caller fills `samp`."""
    n = sum(len(r.tokens) for r in rows)
    N = bucket(n, TOKEN_BUCKETS)
    n_out = sum(r.outputs for r in rows)
    O = bucket(max(n_out, 1), OUTPUT_BUCKETS)  # <= N: every output is a token
    rb = RaggedBatch.build([(r.tokens, r.start, r.global_pages, r.ring, r.ring_write) for r in rows],
                           N, row_slots(runner, N), table_width(runner.rc), runner.rc.ring_pages)
    out_idx, cand = np.zeros(O, np.int32), np.full(O, -1, np.int32)
    counter, out_rows, at, o = np.zeros(O, np.int32), [], 0, 0
    for r in rows:
        k = r.outputs
        if k > len(r.tokens) or len(r.cand) > k:
            raise ValueError(f"a row of {len(r.tokens)} tokens asks {k} outputs checking "
                             f"{len(r.cand)} drafts")
        first = at + len(r.tokens) - k
        if k == 1:  # a decode row or a chunk: scalar stores
            out_idx[o], counter[o] = first, r.start + len(r.tokens)
        else:
            out_idx[o: o + k] = np.arange(first, first + k)
            counter[o: o + k] = r.start + len(r.tokens) - k + 1 + np.arange(k)
        if len(r.cand):
            cand[o: o + len(r.cand)] = r.cand
        out_rows.append(slice(o, o + k))
        at, o = at + len(r.tokens), o + k
    return RaggedCall(rb, out_idx, cand, counter, out_rows, SamplingArrays.host(O))  # rb: numpy already


def mask_words(vocab_size: int) -> int:
    """int32 words of one output slot's grammar mask: a bit per vocabulary id."""
    return (vocab_size + 31) // 32


def table_width(rc) -> int:
    """Global page-table width of every ragged call, in pages: the maximum context's."""
    return rc.max_context // rc.page_size


def token_buckets(max_tokens: int) -> list[int]:
    """The TOKEN_BUCKETS a runner compiles: up to the one holding `max_tokens` (a step's most
    tokens; a step with more runs as several calls, engine/step/ragged_step.py)."""
    top = bucket(min(max_tokens, TOKEN_BUCKETS[-1]), TOKEN_BUCKETS)
    return [b for b in TOKEN_BUCKETS if b <= top]


def output_buckets(max_outputs: int) -> list[int]:
    """The OUTPUT_BUCKETS a runner compiles: up to the one holding `max_outputs`."""
    return [b for b in OUTPUT_BUCKETS if b <= bucket(max_outputs, OUTPUT_BUCKETS)]


def row_slots(runner: ModelRunner, n_tokens: int) -> int:
    """Row slots of a call of n_tokens token slots: every token its own row, up to the most rows
    a step runs."""
    return min(n_tokens, runner.rc.max_batch)


@dataclass
class Launched:
    """A ragged call dispatched to the device and not yet read: its outputs as device arrays."""

    call: RaggedCall
    h: jax.Array  # the forward's hidden states (for heads with logit adjustments)
    out: list  # _heads' (tokens, accepted, logprobs, top ids, top logprobs, given logprobs)
    hidden: jax.Array  # [O, d] the output slots' hidden states


def run(runner: ModelRunner, c: RaggedCall) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Execute one ragged call: (tokens, accepted, logprobs) [O] as numpy; the output slots'
    hidden states stay in `last_hidden` [O, d], top logprobs in `last_top` ([O, k] ids,
    [O, k] logprobs; `top_in` reads them) and the drafts' (`cand`) logprobs in `last_given` [O]
    (both only when some row wants logprobs). Slots with logit adjustments are drawn again in
    heads calls of their own (`_adjusted_heads`). `launch` then `fetch`."""
    return fetch(runner, launch(runner, c))


def launch(runner: ModelRunner, c: RaggedCall) -> Launched:
    """Dispatch call `c` (forward, KV write, heads) without waiting for it; `c.batch.tokens` may
    be a device array (`follow`)."""
    h, new_kv = _forward(runner.cfg, *runner.param_leaves(), runner.kv, c.batch)
    runner.kv = _write(runner.kv, c.batch, new_kv)
    mask = c.mask if c.mask is not None else open_mask(runner, len(c.out_idx))
    *out, hidden = _heads(runner.out_params, h, c.out_idx, c.cand, SamplingArrays(**c.samp), c.counter, mask,
                          screen=runner.screen)
    return Launched(c, h, out, hidden)


def follow(runner: ModelRunner, c: RaggedCall, prev: Launched) -> Launched:
    """Dispatch call `c`, whose token slot j takes the token `prev` draws at its output slot j,
    before `prev` is read: the device runs it right after `prev`, while the host reads `prev`'s
    results. `prev.call` has as many output slots as `c` has token slots (one-token rows whose
    output bucket is their token bucket), and `c`'s padding slots take `prev`'s padding draws,
    which no position reads."""
    if len(prev.call.out_idx) != len(c.batch.tokens):
        raise ValueError(f"{len(prev.call.out_idx)} output slots cannot feed "
                         f"{len(c.batch.tokens)} token slots")
    return launch(runner, replace(c, batch=replace(c.batch, tokens=prev.out[0])))


def fetch(runner: ModelRunner, launched: Launched) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wait for a launched call: (tokens, accepted, logprobs) [O] as numpy, with `last_hidden`,
    `last_top` and `last_given` as `run` sets them."""
    c, out = launched.call, launched.out
    runner.last_hidden = launched.hidden
    if c.adjust is not None:
        out = _adjusted_heads(runner, launched.h, c, out)
    wanted = c.samp["want_logprobs"].any()
    runner.last_top = (np.asarray(out[3]), np.asarray(out[4])) if wanted else None
    runner.last_given = np.asarray(out[5]) if wanted else None
    return np.asarray(out[0]), np.asarray(out[1]), np.asarray(out[2])


def open_mask(runner: ModelRunner, n: int):
    """[n, W] -1 words, allowing every id: the mask of a call without constraints, made once per
    output count and kept on the device (a runner over a mesh takes it from the host, as the
    call's other host arrays, whose placement its compiled calls expect)."""
    masks = runner.open_masks
    if n not in masks:
        words = np.full((n, mask_words(runner.cfg.vocab_size)), -1, np.int32)
        masks[n] = words if runner.mesh is not None else jax.device_put(words)
    return masks[n]


def _adjusted_heads(runner: ModelRunner, h, c: RaggedCall, out: list) -> list[np.ndarray]:
    """`out` (tokens, accepted, logprobs, top ids and logprobs, given logprobs) with the slots that
    carry logit adjustments drawn again with them (and their grammar masks), ADJUST_OUTPUTS slots a call:
    the heads then compile the adjusted variant for those few output counts only, and a call's
    other slots neither wait for nor carry the adjustments' [O, 1, H] buffers."""
    slots = np.flatnonzero((c.adjust["ids"] >= 0).any(axis=(1, 2)))
    out = [np.array(a) for a in out]  # writable host copies
    words = mask_words(runner.cfg.vocab_size)
    mask = c.mask if c.mask is not None else np.full((len(c.out_idx), words), -1, np.int32)
    for at in range(0, len(slots), ADJUST_OUTPUTS):
        part = slots[at: at + ADJUST_OUTPUTS]
        n, O = len(part), bucket(len(part), OUTPUT_BUCKETS)
        spare_samp, spare_adj = SamplingArrays.host(O - n), Adjust.host((O - n, *c.adjust["ids"].shape[1:]))
        idle = np.zeros(O - n, np.int32)
        got = _heads(runner.out_params, h, _take(c.out_idx, part, idle), _take(c.cand, part, idle - 1),
                     SamplingArrays(**{k: _take(v, part, spare_samp[k]) for k, v in c.samp.items()}),
                     _take(c.counter, part, idle), _take(mask, part, np.full((O - n, words), -1, np.int32)),
                     Adjust(**{k: _take(v, part, spare_adj[k]) for k, v in c.adjust.items()}))
        for dst, src in zip(out, got[:6]):
            dst[part] = np.asarray(src)[:n]
    return out


def _take(a: np.ndarray, part: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """a's rows at `part`, then the `spare` rows that pad them to a bucket."""
    return np.concatenate([a[part], spare])


def top_in(runner: ModelRunner, slots: slice) -> list[list[tuple[int, float]]] | None:
    """The latest ragged call's most likely (token, logprob) pairs, best first, at output
    `slots`; None when no row of it asked for logprobs."""
    if runner.last_top is None:
        return None
    ids, lps = runner.last_top
    return [list(zip(ids[j].tolist(), lps[j].tolist(), strict=True))
            for j in range(*slots.indices(len(ids)))]


def compile_jobs(runner: ModelRunner, max_tokens: int, max_outputs: int) -> tuple[list, list]:
    """Thunks compiling every ragged call of `runner` ahead of time from the arrays' metadata
    (engine.runtime.compiles.abstract; no device buffer read): (one per token bucket up to `max_tokens`:
    its forward and KV write; then one per output bucket up to `max_outputs`: its heads,
    and up to ADJUST_OUTPUTS those with logit adjustments too). The second list reads the first's output
    layouts: run it after. Make them on the runner's thread."""
    rc, cfg = runner.rc, runner.cfg
    tree, leaves = runner.param_leaves()
    leaves, kv, out_params = abstract(leaves), abstract(runner.kv), abstract(runner.out_params)
    committed = runner.mesh is not None or any_committed(runner.params, runner.kv)
    width = table_width(rc)
    hidden: dict[int, jax.ShapeDtypeStruct] = {}

    def forward(n: int) -> None:
        rb = jax.tree.map(np.asarray, RaggedBatch.build([], n, row_slots(runner, n), width, rc.ring_pages))
        h, new_kv = outputs(compile_ahead(_forward.lower(cfg, tree, leaves, kv, rb)), committed)
        hidden[n] = h
        compile_ahead(_write.lower(kv, rb, new_kv))

    def heads(o: int) -> None:
        h = hidden[max(hidden)]  # every forward's output has one shape (`_forward`)
        samp, idx = SamplingArrays(**SamplingArrays.host(o)), np.zeros(o, np.int32)
        mask = np.zeros((o, mask_words(cfg.vocab_size)), np.int32)
        compile_ahead(_heads.lower(out_params, h, idx, idx, samp, idx, mask, screen=runner.screen))
        if o <= ADJUST_OUTPUTS:
            adj = Adjust(**Adjust.host((o, 1, runner.adjust_width)))
            compile_ahead(_heads.lower(out_params, h, idx, idx, samp, idx, mask, adj))

    tokens = token_buckets(max_tokens)
    return ([partial(forward, n) for n in tokens],
            [partial(heads, o) for o in output_buckets(min(max_outputs, tokens[-1]))])


def first_run_shapes(max_tokens: int, max_outputs: int) -> list[tuple[int, int]]:
    """(token slots, output slots) that run every compiled forward and every compiled head once:
    each token bucket with the most outputs it can hold, then each output bucket left at the
    smallest token bucket holding it."""
    tokens = token_buckets(max_tokens)
    outs = output_buckets(min(max_outputs, tokens[-1]))
    shapes = [(n, max(o for o in outs if o <= n)) for n in tokens]
    done = {o for _, o in shapes}
    return shapes + [(bucket(o, TOKEN_BUCKETS), o) for o in outs if o not in done]


def run_padding(runner: ModelRunner, n_tokens: int, n_outputs: int) -> None:
    """One call of n_tokens token slots and n_outputs output slots that only writes the scratch
    page (a first execution is slower than the next: engine/warmup/first_runs.py runs them while idle)."""
    rc = runner.rc
    # Rows whose positions stay inside the page tables, unless the call has too few row slots
    # for that (a max-batch-1 engine): then longer rows, whose positions past the tables still
    # land on the scratch page (the table index is clamped, every entry is 0).
    size = max(1, rc.max_context // 2, -(-n_tokens // row_slots(runner, n_tokens)))
    rows, left = [], n_outputs
    for at in range(0, n_tokens, size):
        k = min(size, n_tokens - at)
        rows.append(RaggedRow((0,) * k, 0, (0,) * table_width(rc), (0,) * rc.ring_pages,
                              outputs=min(k, left)))
        left -= rows[-1].outputs
    run(runner, new_call(runner, rows))
