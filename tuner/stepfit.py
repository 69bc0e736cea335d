"""The step-time fits of tuner.model: least squares of recorded steps' times.

The target forward and sampling terms are one non-negative least squares of
relative error over every step (`fit_target`); the proposers' terms one over
their rows (`fit_propose`); and `shape_factors` corrects the fitted forward,
shape by shape, toward what the steps of a compiled shape measured (see
tuner.model's docstring for the terms and why each is there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engine.types import StepStats
from tuner.acceptance import technique_key
from tuner.rows import propose_columns
from tuner.shapes import Padding


def _weighted_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of relative error: rows scaled by 1 / y."""
    w = 1.0 / np.maximum(y, 1e-6)
    return _nnls(x * w[:, None], y * w)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x c - y| over c >= 0 (columns scaled to unit norm first, for conditioning)."""
    from scipy.optimize import nnls

    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(x / norms, y, maxiter=50 * x.shape[1])
    return coef / norms


def fit_target(steps: Sequence[StepStats],
               buckets: Padding) -> tuple[tuple[float, ...], float, tuple[float, float]]:
    """((t0, t1, t2 = 0, t3, t4), t5, (s0, s1)): the target forward, its convex rows term and
    the sampling terms, each step at the rows it ran (Padding.ran: B*q, or Bp + Bv*q for a
    segmented verify)."""
    shapes = [buckets.ran(s) for s in steps]
    b = np.array([shape[0] for shape in shapes], float)
    rows = np.array([shape[1] for shape in shapes], float)
    q = np.array([buckets.pad(0, 1 + s.depth)[1] for s in steps], float)
    p = np.array([s.prefill_tokens for s in steps], float)
    sampled = np.array([s.sampled_rows for s in steps], float)
    x = np.column_stack([np.ones_like(b), b, rows, p, sampled * q, (sampled > 0) * rows, rows * rows])
    y = np.array([max(s.step_ms - s.propose_ms, 1e-3) for s in steps], float)
    t0, t1, t3, t4, s0, s1, t5 = (float(c) for c in _weighted_lstsq(x, y))
    return (t0, t1, 0.0, t3, t4), t5, (s0, s1)


def fit_propose(steps: Sequence[StepStats], vocab_of: Mapping[int, int]) -> dict[str, tuple]:
    """Proposer key -> (p0, p1, p2), every proposer's terms fitted jointly on propose_ms: a
    step whose rows drafted with several techniques ran several proposers, and its
    propose_ms is their sum (tuner.rows.propose_columns). Fitted twice: over the plain
    techniques (pooling every MTP vocabulary) and over the vocabulary keys."""
    out: dict[str, tuple] = {}
    plain = _joint_propose(steps, lambda s, t: t)
    out.update(plain)
    vocab = _joint_propose(steps, lambda s, t: technique_key(t, s.policy_version, vocab_of))
    out.update({k: v for k, v in vocab.items() if k not in plain})
    return out


def _joint_propose(steps: Sequence[StepStats], key_of: Any) -> dict[str, tuple]:
    """NNLS of propose_ms over (ran, rows, rows * depth) columns per proposer key."""
    per_step = [propose_columns(s, lambda t, s=s: key_of(s, t)) for s in steps]
    keys = sorted({k for cols in per_step for k in cols})
    if not keys:
        return {}
    x = np.zeros((len(steps), 3 * len(keys)))
    for i, cols in enumerate(per_step):
        for k, col in cols.items():
            j = 3 * keys.index(k)
            x[i, j:j + 3] = col
    used = x.any(axis=1)
    if not used.any():
        return {}
    y = np.array([s.propose_ms for s in steps], float)
    coef = _nnls(x[used], y[used])
    return {k: (float(coef[3 * j]), float(coef[3 * j + 1]), float(coef[3 * j + 2]))
            for j, k in enumerate(keys)}


SHAPE_PRIOR_STEPS = 10
"""Steps of a shape at which its own measurement and the fitted terms weigh the same."""
MIN_FACTOR_STEPS = 3
"""Steps a shape needs before its measurement corrects the fitted terms."""


def shape_factors(steps: Sequence[StepStats], buckets: Padding, fitted_ms: Callable[[StepStats], float],
                  terms_ms: Callable[[float, float, int], float] | None = None
                  ) -> tuple[dict[tuple[int, int, int], float], float]:
    """((cache rows read, forward rows run, query length) of each shape the steps without
    prefill ran (Padding.ran), or the engine timed -> the factor on the fitted forward
    `fitted_ms` that moves it toward what they measured, and the price of a verify shape not
    measured enough).

    The terms are one smooth surface over every shape, so the few steps of a shape it
    does not fit are outweighed by thousands of others: on the kept databases of
    `bench tuner --quick` a segmented verify of one plain and one drafting row at depth 4
    ran at 1.2-1.35x what the fit priced (slower than the padded verify of both rows),
    and that error decides whether a per-tenant rule pays at batch 2. A shape measured
    often enough is priced by its measurement; any other by the terms.

    The second value is exp of the median |log(measured / fitted)| over every step: the
    terms' typical error. A verify shape (query length > 1) with fewer than
    MIN_FACTOR_STEPS steps is priced that much above the terms, and one with more has its
    steps' median log ratio (n of them) shrunk toward that price with SHAPE_PRIOR_STEPS of
    weight: speculation is decided on an upper estimate of what a shape not yet run costs.
    Plain shapes shrink toward the terms themselves: plain decoding is what every policy
    falls back to. On a quick run's kept databases the terms priced a batch-32 verify at
    depth 1 (the [32, 2] shape, a handful of exploration steps) at 242 ms where it took 335,
    and the tuner drafted there at 0.84x plain decoding's tokens per second.

    Timed shapes. Where the engine timed a verify shape and plain decoding at its batch
    (`Padding.timed`, engine/first_runs.py), that verify is priced (and its few steps shrink
    toward) plain decoding's price at the batch (`terms_ms` times its factor) times the
    timed ratio, over the terms: the cost of drafted rows relative to plain decoding is the
    machine's and the compiled code's, and on XLA:CPU it is not smooth in the rows (batch 2
    in `bench tuner --quick`: 50 ms plain, 60 at depth 2, 84 at depth 4), so an unmeasured
    depth-2 verify priced from the terms and the pessimistic price cost 75 ms, and the tuner
    kept prose at depth 4 or plain where depth 2 served 1.16x plain. The factor scales the
    sampling terms too (the engine times greedy calls): an approximation. Where serving has
    not run plain decoding at the batch but has run a timed verify there (a starter policy
    that drafts at every batch it sees), the shapes it has not run (plain decoding included)
    are priced from that verify's measured price by the timed ratio instead: steps of one
    depth alone cannot tell a per-row cost from a per-position one (the rows run are the
    batch times a constant), so the terms' price of plain decoding there is a guess, and the
    fake engine's tuning test once kept a depth-4 starter that served 0.6x plain on it.

    >>> def s(b, ms, depth=0): return StepStats(batch_size=b, decode_tokens=b, step_ms=ms, depth=depth)
    >>> f, verify = shape_factors([s(1, 20.0)] * 10 + [s(2, 10.0)] * 2 + [s(1, 10.0, 1)] * 10,
    ...                           Padding(), lambda s: 10.0)
    >>> round(f[(1, 1, 1)], 3), (2, 2, 1) in f, round(verify, 3)   # 2 ** (10 / 20); too few at batch 2
    (1.414, False, 1.0)
    >>> f, verify = shape_factors([s(1, 11.0)] * 10 + [s(1, 9.0, 1)] * 10, Padding(), lambda s: 10.0)
    >>> round(verify, 3), round(f[(1, 2, 2)], 3), round(f[(1, 1, 1)], 3)   # the verify toward 1.106
    (1.106, 0.997, 1.049)

    Timed at batch 2: plain 50 ms, depth 2 (query 3) 60 ms; the terms price them 50 and 75:

    >>> pad = Padding((1, 2), (1, 3), timed=(((2, 1), 50.0), ((2, 3), 60.0)))
    >>> terms = lambda read, rows, q: 37.5 + 6.25 * rows
    >>> f, _ = shape_factors([s(2, 50.0)] * 10, pad, lambda s: 50.0, terms)
    >>> round(f[(2, 6, 3)] * terms(2, 6, 3), 1)   # 50 * 60 / 50
    60.0

    Only depth 2 ran at batch 2 (at 60 ms, priced so): plain decoding is priced 60 * 50 / 60:

    >>> f, _ = shape_factors([s(2, 60.0, 2)] * 10, pad, lambda s: 60.0, lambda r, rows, q: 60.0)
    >>> round(f[(2, 2, 1)] * 60.0, 1), round(f[(2, 6, 3)], 3)
    (50.0, 1.0)
    """
    logs: dict[tuple[int, int, int], list[float]] = {}
    for s in steps:
        if s.prefill_tokens or s.step_ms <= 0:
            continue
        read, rows = buckets.ran(s)
        key = (int(read), int(rows), int(buckets.pad(0, 1 + s.depth)[1]))
        fitted = fitted_ms(s)
        if fitted > 0 and s.step_ms > s.propose_ms:
            logs.setdefault(key, []).append(math.log((s.step_ms - s.propose_ms) / fitted))
    spread = float(np.median(np.abs(np.concatenate([np.asarray(v) for v in logs.values()])))) if logs else 0.0
    factors: dict[tuple[int, int, int], float] = {}
    timed = dict(buckets.timed)
    steps_of = {key: len(v) for key, v in logs.items()}
    for key, v in sorted(logs.items(), key=lambda kv: kv[0][2]):  # plain shapes first: timed prices use them
        if len(v) >= MIN_FACTOR_STEPS:
            prior = 0.0 if key[2] == 1 else _timed_log(key, timed, factors, terms_ms, steps_of, True)
            prior = spread if prior is None else prior
            factors[key] = math.exp((float(np.median(v)) * len(v) + prior * SHAPE_PRIOR_STEPS)
                                    / (len(v) + SHAPE_PRIOR_STEPS))
    for batch, q in timed:
        key = (batch, batch * q, q)
        if key not in factors and (log := _timed_log(key, timed, factors, terms_ms, steps_of)) is not None:
            factors[key] = math.exp(log)
    return factors, math.exp(spread)


def _timed_log(key: tuple[int, int, int], timed: Mapping[tuple[int, int], float],
               factors: Mapping[tuple[int, int, int], float],
               terms_ms: Callable[[float, float, int], float] | None,
               steps_of: Mapping[tuple[int, int, int], int], measured: bool = False) -> float | None:
    """The log factor the engine's timing (`timed`: (batch, query length) -> ms) sets for an
    unsegmented shape (see shape_factors), anchored on plain decoding at its batch where
    serving ran it (or nothing else timed there has a factor), else on the timed shape there
    with a factor and the most steps; None where the engine did not time both, where the key
    is plain decoding and no verify anchors it, or where the key is `measured` and its anchor
    is not (the terms' guess at plain decoding is no prior for a shape steps measured)."""
    read, rows, q = key
    own = timed.get((read, q))
    if terms_ms is None or rows != read * q or not own:
        return None
    plain = (read, read, 1)
    anchor = plain
    if plain not in factors:
        runs = [(steps_of.get(k, 0), k[2]) for b, a in timed
                if b == read and a != q and (k := (read, read * a, a)) in factors]
        if runs:
            a = max(runs)[1]
            anchor = (read, read * a, a)
    if (q == 1 and anchor == plain) or (measured and anchor not in factors):
        return None
    at = timed.get((read, anchor[2]))
    base, priced = terms_ms(*anchor) * factors.get(anchor, 1.0), terms_ms(read, rows, q)
    return math.log(base * own / at / priced) if at and base > 0 and priced > 0 else None
