"""Token sampling inside the jitted step: logit adjustments, greedy, temperature, top-k,
min-p, top-p, seeds.

Every row carries its own settings as arrays, so one compiled function serves
any mix of greedy and sampled requests. Randomness is a per-request
key folded with the position being sampled: the same seed gives the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

CANDIDATES = 256  # top-k / top-p thresholds are looked up among this many best logits


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings."""

    temperature: jax.Array  # [N] f32, 0 = greedy
    top_k: jax.Array  # [N] int32, 0 = off
    top_p: jax.Array  # [N] f32, 1 = off
    key: jax.Array  # [N, 2] uint32 raw PRNG key data per request
    want_logprobs: jax.Array  # [N] bool
    min_p: jax.Array  # [N] f32, 0 = off: keep tokens at least min_p times as likely as the best

    @staticmethod
    def host(n: int) -> dict[str, np.ndarray]:
        """Zeroed numpy buffers for n rows (greedy, filters off)."""
        return {
            "temperature": np.zeros(n, np.float32),
            "top_k": np.zeros(n, np.int32),
            "top_p": np.ones(n, np.float32),
            "key": np.zeros((n, 2), np.uint32),
            "want_logprobs": np.zeros(n, bool),
            "min_p": np.zeros(n, np.float32),
        }

    @staticmethod
    def fill(samp: dict[str, np.ndarray], at, sp, key) -> None:
        """A request's settings (engine.types.SamplingParams `sp`, its key data) into `host`
        buffers at `at`: a row index, or slots (a ragged call's outputs of one row)."""
        for name, value in (("temperature", sp.temperature), ("top_k", sp.top_k), ("top_p", sp.top_p),
                            ("key", key), ("want_logprobs", sp.logprobs), ("min_p", sp.min_p)):
            samp[name][at] = value


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Adjust:
    """Sparse changes to the logits before sampling (built by engine.execute.penalties): per row at most
    one entry per token id; x -> (x / scale if x > 0 else x * scale) + add."""

    ids: jax.Array  # [N, H] int32 token ids, -1 = unused entry
    scale: jax.Array  # [N, H] f32 repetition penalty (1 = none)
    add: jax.Array  # [N, H] f32 added after scaling (-inf bans the token)

    @staticmethod
    def host(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Empty numpy buffers shaped `shape` (e.g. [B, T, H]): no entry anywhere."""
        return {"ids": np.full(shape, -1, np.int32), "scale": np.ones(shape, np.float32),
                "add": np.zeros(shape, np.float32)}


def adjust_logits(logits: jax.Array, best: jax.Array, a: Adjust):
    """(logits [N, V] with a's entries applied, greedy tokens [N]); rows without entries keep
    `best`. Example: logits [2, -1, 0.5], entries {0: (2, 0), 1: (2, 0), 2: (1, -inf)} ->
    [1, -2, -inf], greedy 0."""
    N, V = logits.shape
    ids = jnp.where(a.ids >= 0, a.ids, V)  # out of range: the scatter drops it
    x = jnp.take_along_axis(logits, jnp.minimum(ids, V - 1), axis=1)
    x = jnp.where(x > 0, x / a.scale, x * a.scale) + a.add
    lg = logits.at[jnp.arange(N)[:, None], ids].set(x, mode="drop")
    return lg, jnp.where(jnp.any(a.ids >= 0, axis=-1), greedy(lg), best)


def masked(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """`logits` [N, V] with every id whose bit is clear in `mask` set to -inf. `mask` [N,
    ceil(V / 32)] int32: bit i % 32 of word i // 32 allows id i (engine/grammar.py); a row of
    -1 words allows every id. Elementwise: it fuses into the pass that reads the result.
    Example: V 3, mask [[0b101]]: [2, 5, 1] -> [2, -inf, 1]."""
    N, V = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(N, -1)[:, :V] > 0, logits, -jnp.inf)


TOP_BLOCK = 256
"""Vocabulary block of the two-stage top-k (see top_candidates)."""


def top_candidates(x: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest entries of each row of x [..., V] (in no promised order).

    Two stages: the max of each TOP_BLOCK-wide block, the k best blocks, then
    the k best entries among those k * TOP_BLOCK. Exact: an entry among the k
    largest sits in a block whose max is among the k largest block maxima.
    `lax.top_k` over a 262k row is a serial scan on XLA:CPU (0.36 ms a row,
    23 ms at batch 64); the block maxima fuse into the pass that wrote x.
    """
    V = x.shape[-1]
    if V % TOP_BLOCK or V // TOP_BLOCK < 4 * k:
        return jax.lax.top_k(x, k)[1]
    blocks = x.reshape(*x.shape[:-1], V // TOP_BLOCK, TOP_BLOCK)
    _, bi = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [..., k]
    picked = jnp.take_along_axis(blocks, bi[..., None], axis=-2)  # [..., k, TOP_BLOCK]
    _, j = jax.lax.top_k(picked.reshape(*x.shape[:-1], k * TOP_BLOCK), k)
    return jnp.take_along_axis(bi, j // TOP_BLOCK, axis=-1) * TOP_BLOCK + j % TOP_BLOCK


def greedy(logits: jax.Array) -> jax.Array:
    """Index of the largest logit per row, lowest index on ties. [N, V] -> [N].

    `lax.top_k(., 1)` (stable: lower index first on ties) is ~3.5x faster than
    `argmax` over a 262k vocabulary on XLA:CPU, and its blocked form (see
    top_candidates: the first block holding the max, then the first max in it)
    faster still.
    """
    return top_candidates(logits, 1)[:, 0].astype(jnp.int32)


def _threshold_from_candidates(vals, tau_k, top_k, top_p, lse):
    """Smallest kept logit per row from the sorted candidate logits.

    vals: [N, C] descending; tau_k [N]: the top-k / min-p threshold (-inf: none).
    Returns (tau [N], exact [N] bool): exact is False where top-p needs more
    mass than the candidates hold.
    """
    C = vals.shape[-1]
    probs = jnp.where(vals >= tau_k[:, None], jnp.exp(vals - lse[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    # first index whose cumulative mass reaches top_p: that token is still kept
    m = jnp.sum(cum < top_p[:, None], axis=-1)
    reached = m < C
    tau_p = jnp.take_along_axis(vals, jnp.clip(m, 0, C - 1)[:, None], axis=1)[:, 0]
    tau_p = jnp.where(top_p < 1.0, tau_p, -jnp.inf)
    exact = reached | (top_p >= 1.0) | (top_k > 0) & (top_k <= C)
    return jnp.maximum(tau_k, tau_p), exact


def _threshold_bisect(k: Kept, tau_k, top_p, lse, iters: int = 40):
    """Top-p threshold by bisection over the full vocabulary (rare fallback).

    Reads k.scaled in fused passes (no [N, V] temporaries), 2 per iteration.
    """
    scaled = k.scaled
    mask_k = scaled >= tau_k[:, None]
    lo = jnp.min(jnp.where(mask_k & (scaled > -jnp.inf), scaled, jnp.inf), axis=-1)  # banned: -inf
    hi = k.top

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        keep = (scaled >= mid[:, None]) & mask_k
        mass = jnp.sum(jnp.where(keep, jnp.exp(scaled - lse[:, None]), 0.0), axis=-1)
        ok = mass >= top_p  # keeping everything >= mid is enough mass
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, iters, body, (lo, hi))
    return lo


@dataclass(frozen=True)
class Kept:
    """The distribution a sampled row draws from, described without a [N, V] array.

    p(v) is proportional to exp(scaled[v] - top) where scaled[v] >= tau, else 0.
    Every use below reduces over the vocabulary in fused passes: writing a
    fresh [64, 262k] float32 array costs XLA:CPU ~28 ms (first-touch pages),
    which made sampled rows cost ~600 ms a step at batch 64.
    """

    scaled: jax.Array  # [N, V] logits / temperature (fused into each consumer)
    top: jax.Array  # [N] row max of scaled
    tau: jax.Array  # [N] smallest kept value

    def weights(self, x, axes: int = 1):
        """Unnormalized kept probability of values x shaped [N, ...] (`axes` trailing dims)."""
        ex = (slice(None),) + (None,) * axes
        return jnp.where(x >= self.tau[ex], jnp.exp(x - self.top[ex]), 0.0)

    def block_mass(self) -> jax.Array:
        """[N, V / TOP_BLOCK] kept mass of each vocabulary block (V a multiple of TOP_BLOCK)."""
        N, V = self.scaled.shape
        return jnp.sum(self.weights(self.scaled.reshape(N, V // TOP_BLOCK, TOP_BLOCK), 2), axis=-1)


def kept(logits, s: SamplingArrays) -> Kept:
    """Temperature, then top-k and min-p, then top-p, as a Kept distribution per row."""
    temp = jnp.maximum(s.temperature, 1e-6)
    C = min(CANDIDATES, logits.shape[-1])
    # candidates from the logits themselves (same order): `scaled` stays unmaterialized
    vals = -jnp.sort(-jnp.take_along_axis(logits, top_candidates(logits, C), axis=-1),
                     axis=-1) / temp[:, None]
    tau_k = jnp.where(
        s.top_k > 0,
        jnp.take_along_axis(vals, jnp.clip(s.top_k - 1, 0, C - 1)[:, None], axis=1)[:, 0],
        -jnp.inf,
    )
    # min-p: p(v) >= min_p * p(best)  <=>  scaled[v] >= top + log(min_p); applied before top-p
    floor = jnp.where(s.min_p > 0, vals[:, 0] + jnp.log(jnp.maximum(s.min_p, 1e-30)), -jnp.inf)
    tau_k = jnp.maximum(tau_k, floor)
    by_k = Kept(logits / temp[:, None], vals[:, 0], tau_k)
    lse_k = vals[:, 0] + jnp.log(jnp.sum(by_k.weights(by_k.scaled), axis=-1))
    tau, exact = _threshold_from_candidates(vals, tau_k, s.top_k, s.top_p, lse_k)
    tau = jax.lax.cond(
        jnp.all(exact), lambda: tau,
        lambda: jnp.where(exact, tau, _threshold_bisect(Kept(logits / temp[:, None], vals[:, 0], tau_k),
                                                        tau_k, s.top_p, lse_k)))
    return Kept(logits / temp[:, None], vals[:, 0], tau)


def _uniforms(s: SamplingArrays, counter, n: int):
    """n uniforms per row from the row's key folded with `counter`: [N, n]."""
    keys = jax.vmap(lambda k, c: jax.random.fold_in(jax.random.wrap_key_data(k), c))(s.key, counter)
    return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32))(keys)


def _draw(k: Kept, u):
    """Index drawn by inverse CDF from k's distribution with uniforms u [N]; never a
    zero-probability index.

    Two levels when V is a multiple of TOP_BLOCK: the block by the running sum
    of block masses, then the index by the running sum inside that block (a
    cumulative sum over a whole 262k row is a slow reduce-window on XLA:CPU).
    """
    N, V = k.scaled.shape
    rows = jnp.arange(N)
    if V % TOP_BLOCK:
        return _inverse_cdf(k.weights(k.scaled), u)
    blocks = k.scaled.reshape(N, V // TOP_BLOCK, TOP_BLOCK)
    mass = k.block_mass()
    cb = jnp.cumsum(mass, axis=-1)
    target = u * cb[:, -1]
    last = jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[-1])[None, :], 0), axis=-1)
    bi = jnp.minimum(jnp.sum(cb <= target[:, None], axis=-1), last)  # first block past the target
    before = jnp.where(bi > 0, cb[rows, jnp.maximum(bi - 1, 0)], 0.0)
    inner = k.weights(jnp.take_along_axis(blocks, bi[:, None, None], axis=1)[:, 0])
    j = _inverse_cdf(inner, jnp.clip((target - before) / jnp.sum(inner, axis=-1), 0.0, 1.0))
    return (bi * TOP_BLOCK + j).astype(jnp.int32)


def _inverse_cdf(w, u):
    """Index drawn from weights w [N, n] (unnormalized) with uniforms u [N]; never a zero weight."""
    cdf = jnp.cumsum(w, axis=-1)
    idx = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    last_kept = jnp.max(jnp.where(w > 0, jnp.arange(w.shape[-1]), 0), axis=-1)
    return jnp.minimum(idx, last_kept).astype(jnp.int32)


def _sample_rows(logits, s: SamplingArrays, counter):
    return _draw(kept(logits, s), _uniforms(s, counter, 1)[:, 0])


def _verify_rows(logits, cand, s: SamplingArrays, counter):
    """Coupled verification of deterministic drafts: the token is drawn from p with the
    uniform plain decoding uses at that position, and the draft is accepted when it is
    that token. The output is p's own draw (lossless), a draft d is accepted with
    probability p(d) (as rejection sampling of a point mass would), and a seeded
    request's tokens do not depend on whether, or how deep, it speculated."""
    tok = _sample_rows(logits, s, counter)
    return tok, (cand >= 0) & (tok == cand)


def verify(logits: jax.Array, cand: jax.Array, s: SamplingArrays, counter: jax.Array,
           best: jax.Array | None = None,
           raw: jax.Array | None = None, mask: jax.Array | None = None):
    """Target tokens and draft acceptance at each verified position.

    logits: [N, V] f32 at one position each; cand: [N] int32, the draft token
    that follows that position (-1 where there is none: the bonus position).
    Greedy rows accept exactly when the draft equals the argmax; sampled rows
    when it equals the token drawn there (see _verify_rows). `best` [N]: the greedy tokens
    when the caller already knows them (see engine.execute.runner.output_scores);
    `raw` [N, V]: the model's logits when `logits` were adjusted (logprobs
    report the model's). `mask` [N, W]: a grammar's allowed ids per row (`masked`); applied
    inside the branches that read the logits, only when some row has one, so a call without
    constraints neither materializes masked logits nor searches them again.
    Returns (tokens [N], accepted [N] bool, logprobs [N]).
    Example: greedy, argmax 7, cand 7 -> (7, True).
    """
    g = greedy(logits) if best is None else best
    lg = (lambda: logits) if mask is None else (lambda: masked(logits, mask))
    if mask is not None:
        g = jax.lax.cond(jnp.any(mask != -1), lambda: greedy(lg()), lambda: g)
    sampled = s.temperature > 0
    tok_s, acc_s = jax.lax.cond(
        jnp.any(sampled), lambda: _verify_rows(lg(), cand, s, counter), lambda: (g, cand == g)
    )
    tok = jnp.where(sampled, tok_s, g)
    acc = jnp.where(sampled, acc_s, cand == g)
    return tok, acc, _logprobs(logits if raw is None else raw, tok, s)


def _logprobs(logits, tok, s: SamplingArrays):
    def lp():
        chosen = jnp.take_along_axis(logits, tok[:, None], axis=1)[:, 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1)

    return jax.lax.cond(jnp.any(s.want_logprobs), lp, lambda: jnp.zeros(tok.shape, jnp.float32))


def given_logprobs(logits: jax.Array, ids: jax.Array, s: SamplingArrays):
    """Each row's log-probability of the given token `ids` [N] (-1: none, 0 there) under
    `logits` [N, V]: a scored prompt's next token at each of its positions. Zeros unless a row
    wants logprobs. Example: log-probabilities [-1.6, -0.4, -2.3] and id 2 -> -2.3."""

    def lp():
        chosen = jnp.take_along_axis(logits, jnp.maximum(ids, 0)[:, None], axis=1)[:, 0]
        return jnp.where(ids >= 0, chosen - jax.nn.logsumexp(logits, axis=-1), 0.0)

    return jax.lax.cond(jnp.any(s.want_logprobs), lp, lambda: jnp.zeros(ids.shape, jnp.float32))


def sample(logits: jax.Array, s: SamplingArrays, counter: jax.Array, best: jax.Array | None = None,
           raw: jax.Array | None = None):
    """Pick one token per row and its log-probability under the model.

    logits: [N, V] f32; counter: [N] int32 (position being sampled, folded into
    the row's key). Returns (tokens [N] int32, logprobs [N] f32; zeros unless
    requested). Greedy rows ignore the key and take `best` [N] when given
    (the caller's greedy tokens); logprobs read `raw` when given (see verify). Example: with temperature 0
    everywhere this is `argmax` and no random numbers are drawn.
    """
    tok = greedy(logits) if best is None else best
    any_sampled = jnp.any(s.temperature > 0)
    sampled = jax.lax.cond(any_sampled, lambda: _sample_rows(logits, s, counter), lambda: tok)
    tok = jnp.where(s.temperature > 0, sampled, tok)
    return tok, _logprobs(logits if raw is None else raw, tok, s)


TOP_LOGPROBS = 20
"""Most likely tokens listed per position when a row asks for logprobs (OpenAI's limit)."""


def top_logprobs(logits: jax.Array, s: SamplingArrays, k: int = TOP_LOGPROBS):
    """The k most likely tokens of each row, best first (lower id on ties), and their
    log-probabilities under `logits`: ([N, k] int32, [N, k] f32); zeros unless a row wants
    logprobs. Example: log-probabilities [-1.6, -0.4, -2.3] -> ids [1, 0, 2], those values.
    """
    N, V = logits.shape
    k = min(k, V)

    def top():
        ids = jnp.sort(top_candidates(logits, k), axis=-1)
        vals = jnp.take_along_axis(logits, ids, axis=1)
        order = jnp.argsort(-vals, axis=-1, stable=True)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return (jnp.take_along_axis(ids, order, axis=1).astype(jnp.int32),
                jnp.take_along_axis(vals, order, axis=1) - lse[:, None])

    return jax.lax.cond(jnp.any(s.want_logprobs), top,
                        lambda: (jnp.zeros((N, k), jnp.int32), jnp.zeros((N, k), jnp.float32)))
