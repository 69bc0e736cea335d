"""The shapes a step runs: compiled sizes it is padded to, segmented verifies, and the older
steps of the shapes a fit window lacks.

A step's time follows the shape the engine ran, not its own sizes: a batch runs padded to
the next compiled batch size and a verify to the next compiled query length (1 + depth),
so batch 17 costs what batch 32 does. A segmented verify (of the engine's former padded steps) runs the rows
that draft nothing as a plain segment [Bp, 1] beside the drafting rows [Bv, q] in one
forward, Bp and Bv each padded to a batch size, where such a shape is compiled and it runs
fewer rows (`engine.types.segment_split`, the engine's own rule). `Padding.rows` gives the
(cache rows read, forward rows run) of a prediction, `Padding.ran` those of a recorded step;
tuner.model prices and fits step time on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.types import StepStats, segment_split


@dataclass(frozen=True)
class Padding:
    """The compiled shapes steps run padded to (empty: the step's own sizes).

    >>> Padding(batch=(1, 2, 4, 8), query=(1, 2, 3, 5)).pad(3, 4)
    (4, 5)
    """

    batch: tuple[int, ...] = ()
    """Compiled batch sizes, ascending."""
    query: tuple[int, ...] = ()
    """Compiled query lengths (1 + depth), ascending."""
    segments: frozenset = frozenset()
    """Compiled segmented verifies: (plain rows, drafting rows, query length) triples, both row
    counts batch sizes (EngineCapacity.segment_shapes); empty: every verify is one padded call."""
    timed: tuple[tuple[tuple[int, int], float], ...] = ()
    """((batch, query length), ms) of the compiled decode and verify shapes the engine timed
    (EngineCapacity.shape_ms); tuner.stepfit.shape_factors prices unmeasured verifies by them."""

    def pad(self, batch: float, q: int) -> tuple[float, int]:
        return next_size(batch, self.batch), int(next_size(q, self.query))

    def rows(self, batch: float, q: int, plain: float = 0.0) -> tuple[float, float]:
        """(cache rows read B, forward rows run R) of a decode batch of `batch` rows verified at
        query length `q` (1 + depth), `plain` of them drafting nothing (a mean is rounded):
        (Bp + Bv, Bp + Bv*q) where the engine runs a segmented verify (its rule,
        engine.types.segment_split, on these shapes), else (pad(batch), pad(batch) * pad(q)).

        >>> pad = Padding((1, 2, 4, 8), (1, 2, 3, 5), frozenset({(4, 4, 5)}))
        >>> pad.rows(6, 4), pad.rows(6, 5, plain=3)   # 8 * 5 in one verify; 4 + 4 * 5 segmented
        ((8, 40), (8, 24))
        """
        padded, q = self.pad(batch, q)
        if plain > 0 and self.segments and q > 1:
            k = int(round(plain))
            split = segment_split(k, int(round(batch)) - k, q, self.batch, self.segments)
            if split is not None:
                return split[0] + split[1], split[0] + split[1] * q
        return padded, padded * q

    def ran(self, s: StepStats) -> tuple[float, float]:
        """(cache rows read, forward rows run) of a recorded step. One that ran segmented
        (plain_rows > 0) ran its plain rows and its other decode rows (row classes' rows, else
        batch_size, minus plain_rows) each padded to a batch size, whatever `segments` lists
        (the engine decided); any other step `rows(batch_size, 1 + depth)`.

        >>> Padding((1, 2, 4, 8), (1, 2, 3, 5)).ran(StepStats(batch_size=5, depth=4, plain_rows=3))
        (6, 14)
        """
        q = self.pad(0, 1 + s.depth)[1]
        decode = sum(c.rows for c in s.row_classes) or s.batch_size
        if s.plain_rows > 0 and decode > s.plain_rows:
            bp = next_size(s.plain_rows, self.batch)
            bv = next_size(decode - s.plain_rows, self.batch)
            return bp + bv, bp + bv * q
        return self.rows(s.batch_size, 1 + s.depth)


def next_size(n: float, sizes: tuple[int, ...]) -> float:
    """The smallest of `sizes` >= n (n itself beyond the largest)."""
    return next((s for s in sizes if s >= n), n)


MIN_SHAPE_STEPS = 10
"""Steps of a (batch, query length) shape the fit window needs before older ones stay out."""


def cost_history(recent: Sequence[StepStats], older: Sequence[StepStats],
                 buckets: Padding = Padding()) -> list[StepStats]:
    """The newest `older` steps of each padded (batch, query length) shape that `recent` holds
    fewer than MIN_SHAPE_STEPS of, up to that many: what the step-time fit adds to the fit
    window. A busy minute may hold steps of one batch size at one or two depths, from which
    alone the fit cannot tell the cost per row from the cost per step.

    >>> def s(b, d): return StepStats(batch_size=b, decode_tokens=b, depth=d, step_ms=10.0)
    >>> len(cost_history([s(32, 1)] * 12, [s(32, 1)] * 5 + [s(1, 8)] * 30))
    10
    """
    counts: dict[tuple, int] = {}
    for s in recent:
        shape = buckets.pad(s.batch_size, 1 + s.depth)
        counts[shape] = counts.get(shape, 0) + 1
    out = []
    for s in reversed(older):  # newest first
        shape = buckets.pad(s.batch_size, 1 + s.depth)
        if counts.get(shape, 0) < MIN_SHAPE_STEPS:
            counts[shape] = counts.get(shape, 0) + 1
            out.append(s)
    out.reverse()
    return out
