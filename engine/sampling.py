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
    """Index of the largest logit per row, lowest index on ties. [N, V] -> [N]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


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


def _sample_rows(logits, s: SamplingArrays, counter):
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
    cdf = jnp.cumsum(p, axis=-1)
    keys = jax.vmap(lambda k, c: jax.random.fold_in(jax.random.wrap_key_data(k), c))(s.key, counter)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cdf[:, -1]
    idx = jnp.sum(cdf <= u[:, None], axis=-1)
    # never pick a token outside the kept set because of rounding at the top end
    idx = jnp.minimum(idx, jnp.max(jnp.where(keep, jnp.arange(p.shape[-1]), 0), axis=-1))
    return idx.astype(jnp.int32)


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

    def lp():
        chosen = jnp.take_along_axis(logits, tok[:, None], axis=1)[:, 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1)

    logprobs = jax.lax.cond(jnp.any(s.want_logprobs), lp, lambda: jnp.zeros(tok.shape, jnp.float32))
    return tok, logprobs
