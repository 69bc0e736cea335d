"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p, seeds.

Every row carries its own settings as arrays, so one compiled function serves
any mix of greedy and sampled requests (STYLE 2). Randomness is a per-request
key folded with the position being sampled: the same seed gives the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

CANDIDATES = 256  # top-k / top-p thresholds are looked up among this many best logits
MAX_TOP_K = CANDIDATES


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings."""

    temperature: jax.Array  # [N] f32, 0 = greedy
    top_k: jax.Array  # [N] int32, 0 = off
    top_p: jax.Array  # [N] f32, 1 = off
    key: jax.Array  # [N, 2] uint32 raw PRNG key data per request
    want_logprobs: jax.Array  # [N] bool

    @staticmethod
    def host(n: int) -> dict[str, np.ndarray]:
        """Zeroed numpy buffers for n rows (greedy, filters off)."""
        return {
            "temperature": np.zeros(n, np.float32),
            "top_k": np.zeros(n, np.int32),
            "top_p": np.ones(n, np.float32),
            "key": np.zeros((n, 2), np.uint32),
            "want_logprobs": np.zeros(n, bool),
        }


def greedy(logits: jax.Array) -> jax.Array:
    """Index of the largest logit per row, lowest index on ties. [N, V] -> [N].

    `lax.top_k(., 1)` (stable: lower index first on ties) is ~3.5x faster than
    `argmax` over a 262k vocabulary on XLA:CPU.
    """
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


def _threshold_from_candidates(vals, top_k, top_p, lse):
    """Smallest kept logit per row from the sorted candidate logits.

    vals: [N, C] descending. Returns (tau [N], exact [N] bool): exact is False
    where top-p needs more mass than the candidates hold.
    """
    C = vals.shape[-1]
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, C - 1)[:, None], axis=1)[:, 0]
    tau_k = jnp.where(top_k > 0, kth, -jnp.inf)
    probs = jnp.where(vals >= tau_k[:, None], jnp.exp(vals - lse[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    # first index whose cumulative mass reaches top_p: that token is still kept
    m = jnp.sum(cum < top_p[:, None], axis=-1)
    reached = m < C
    tau_p = jnp.take_along_axis(vals, jnp.clip(m, 0, C - 1)[:, None], axis=1)[:, 0]
    tau_p = jnp.where(top_p < 1.0, tau_p, -jnp.inf)
    exact = reached | (top_p >= 1.0) | (top_k > 0) & (top_k <= C)
    return jnp.maximum(tau_k, tau_p), exact


def _threshold_bisect(scaled, mask_k, top_p, lse, iters: int = 40):
    """Top-p threshold by bisection over the full vocabulary (rare fallback)."""
    lo = jnp.min(jnp.where(mask_k, scaled, jnp.inf), axis=-1)
    hi = jnp.max(scaled, axis=-1)
    p = jnp.where(mask_k, jnp.exp(scaled - lse[:, None]), 0.0)

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        mass = jnp.sum(jnp.where(scaled >= mid[:, None], p, 0.0), axis=-1)
        ok = mass >= top_p  # keeping everything >= mid is enough mass
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, iters, body, (lo, hi))
    return lo


def filtered_probs(logits, s: SamplingArrays):
    """The distribution each sampled row draws from: temperature, then top-k, then top-p.

    Returns p [N, V] f32, zero outside the kept set and summing to 1 per row.
    """
    temp = jnp.maximum(s.temperature, 1e-6)[:, None]
    scaled = logits / temp
    C = min(CANDIDATES, scaled.shape[-1])
    vals, _ = jax.lax.top_k(scaled, C)
    tau_k = jnp.where(
        s.top_k > 0,
        jnp.take_along_axis(vals, jnp.clip(s.top_k - 1, 0, C - 1)[:, None], axis=1)[:, 0],
        -jnp.inf,
    )
    mask_k = scaled >= tau_k[:, None]
    lse_k = jax.nn.logsumexp(jnp.where(mask_k, scaled, -jnp.inf), axis=-1)
    tau, exact = _threshold_from_candidates(vals, s.top_k, s.top_p, lse_k)
    tau = jax.lax.cond(
        jnp.all(exact), lambda: tau, lambda: jnp.where(exact, tau, _threshold_bisect(scaled, mask_k, s.top_p, lse_k))
    )
    keep = scaled >= tau[:, None]
    p = jnp.where(keep, jnp.exp(scaled - lse_k[:, None]), 0.0)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def _uniforms(s: SamplingArrays, counter, n: int):
    """n uniforms per row from the row's key folded with `counter`: [N, n]."""
    keys = jax.vmap(lambda k, c: jax.random.fold_in(jax.random.wrap_key_data(k), c))(s.key, counter)
    return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32))(keys)


def _inverse_cdf(p, u):
    """Index drawn from p [N, V] with uniforms u [N] (never a zero-probability index)."""
    cdf = jnp.cumsum(p, axis=-1)
    idx = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    last_kept = jnp.max(jnp.where(p > 0, jnp.arange(p.shape[-1]), 0), axis=-1)
    return jnp.minimum(idx, last_kept).astype(jnp.int32)


def _sample_rows(logits, s: SamplingArrays, counter):
    return _inverse_cdf(filtered_probs(logits, s), _uniforms(s, counter, 1)[:, 0])


def _verify_rows(logits, cand, s: SamplingArrays, counter):
    """Rejection sampling of deterministic drafts: accept d with probability p(d),
    else draw from p with d removed. The output is distributed exactly as p."""
    p = filtered_probs(logits, s)
    u = _uniforms(s, counter, 2)
    has = cand >= 0
    pd = jnp.where(has, jnp.take_along_axis(p, jnp.maximum(cand, 0)[:, None], axis=1)[:, 0], 0.0)
    accept = has & (u[:, 0] < pd)
    hit = has[:, None] & (jnp.arange(p.shape[-1])[None, :] == cand[:, None])
    rest = jnp.where(hit, 0.0, p)
    # a draft holding all the mass is always accepted, so `rest` is never all zero when used
    rest = jnp.where(jnp.sum(rest, axis=-1, keepdims=True) > 0, rest, p)
    return jnp.where(accept, cand, _inverse_cdf(rest, u[:, 1])), accept


def verify(logits: jax.Array, cand: jax.Array, s: SamplingArrays, counter: jax.Array):
    """Target tokens and draft acceptance at each verified position.

    logits: [N, V] f32 at one position each; cand: [N] int32, the draft token
    that follows that position (-1 where there is none: the bonus position).
    Greedy rows accept exactly when the draft equals the argmax; sampled rows
    use rejection sampling (see _verify_rows). Returns (tokens [N], accepted
    [N] bool, logprobs [N]). Example: greedy, argmax 7, cand 7 -> (7, True).
    """
    g = greedy(logits)
    sampled = s.temperature > 0
    tok_s, acc_s = jax.lax.cond(
        jnp.any(sampled), lambda: _verify_rows(logits, cand, s, counter), lambda: (g, cand == g)
    )
    tok = jnp.where(sampled, tok_s, g)
    acc = jnp.where(sampled, acc_s, cand == g)
    return tok, acc, _logprobs(logits, tok, s)


def _logprobs(logits, tok, s: SamplingArrays):
    def lp():
        chosen = jnp.take_along_axis(logits, tok[:, None], axis=1)[:, 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1)

    return jax.lax.cond(jnp.any(s.want_logprobs), lp, lambda: jnp.zeros(tok.shape, jnp.float32))


def sample(logits: jax.Array, s: SamplingArrays, counter: jax.Array):
    """Pick one token per row and its log-probability under the model.

    logits: [N, V] f32; counter: [N] int32 (position being sampled, folded into
    the row's key). Returns (tokens [N] int32, logprobs [N] f32; zeros unless
    requested). Greedy rows ignore the key. Example: with temperature 0
    everywhere this is `argmax` and no random numbers are drawn.
    """
    tok = greedy(logits)
    any_sampled = jnp.any(s.temperature > 0)
    sampled = jax.lax.cond(any_sampled, lambda: _sample_rows(logits, s, counter), lambda: tok)
    tok = jnp.where(s.temperature > 0, sampled, tok)
    return tok, _logprobs(logits, tok, s)
