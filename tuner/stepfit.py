"""The step-time fits of tuner.model: least squares of recorded steps' times.

The target forward and sampling terms are one non-negative least squares of
relative error over every step (`fit_target`), each step at the token rows it
ran (`ran`); the proposers' terms one over their rows (`fit_propose`); and
`cost_history` picks the older steps that fill the (batch, depth) gaps of a fit
window (see tuner.model's docstring for the terms and why each is there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.types import StepStats
from tuner.acceptance import technique_key
from tuner.rows import propose_columns


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


def ran(s: StepStats) -> tuple[int, int, int]:
    """(sequences whose cache the step read B, decode token rows it ran R, decode rows D) of a
    recorded step. Each decode row ran 1 + the drafts it verified (engine/step/ragged_step.py), so
    R = D + proposed; D is its row classes' rows, else batch_size (telemetry without them).

    >>> from engine.types import RowClass
    >>> ran(StepStats(batch_size=5, depth=4, proposed=6, row_classes=(
    ...     RowClass("copy", "ngram", 4, 2, 6), RowClass("prose", "none", 0, 2))))   # a chunk besides
    (5, 10, 4)
    """
    decode = sum(c.rows for c in s.row_classes) or s.batch_size
    return s.batch_size, decode + s.proposed, decode


def fit_target(steps: Sequence[StepStats]) -> tuple[tuple[float, ...], float, tuple[float, float]]:
    """((t0, t1, t2 = 0, t3, t4), t5, (s0, s1)): the target forward, its convex rows term and
    the sampling terms, each step at the token rows it ran (`ran`); a sampled row counts at
    the step's mean rows per decode row R / D (steps do not record which rows sampled)."""
    shapes = np.array([ran(s) for s in steps], float).reshape(-1, 3)
    b, rows, decode = shapes[:, 0], shapes[:, 1], np.maximum(shapes[:, 2], 1.0)
    p = np.array([s.prefill_tokens for s in steps], float)
    sampled = np.array([s.sampled_rows for s in steps], float)
    x = np.column_stack([np.ones_like(b), b, rows, p, sampled * rows / decode, (sampled > 0) * rows,
                         rows * rows])
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


MIN_SHAPE_STEPS = 10
"""Steps of a (batch size, depth) shape the fit window needs before older ones stay out."""


def cost_history(recent: Sequence[StepStats], older: Sequence[StepStats]) -> list[StepStats]:
    """The newest `older` steps of each (batch size, depth) that `recent` holds fewer than
    MIN_SHAPE_STEPS of, up to that many: what the step-time fit adds to the fit window. A
    busy minute may hold steps of one batch size at one or two depths, from which alone the
    fit cannot tell the cost per row from the cost per step.

    >>> def s(b, d): return StepStats(batch_size=b, decode_tokens=b, depth=d, step_ms=10.0)
    >>> len(cost_history([s(32, 1)] * 12, [s(32, 1)] * 5 + [s(1, 8)] * 30))
    10
    """
    counts: dict[tuple[int, int], int] = {}
    for s in recent:
        counts[(s.batch_size, s.depth)] = counts.get((s.batch_size, s.depth), 0) + 1
    out = []
    for s in reversed(older):  # newest first
        shape = (s.batch_size, s.depth)
        if counts.get(shape, 0) < MIN_SHAPE_STEPS:
            counts[shape] = counts.get(shape, 0) + 1
            out.append(s)
    out.reverse()
    return out
