"""Interval estimates and the crossover rule of `crossover report` (numpy-free, stdlib only).

- `wilson`: a binomial proportion's Wilson score interval (acceptance: drafts
  accepted out of drafts offered).
- `Moments` / `ratio_ci`: goodput is a ratio of sums (output tokens over step
  seconds), estimated over steps; its interval is the delta method's normal
  approximation, from five running sums, so it needs one pass and no resampling.
- `crossover`: the smallest batch size at which speculation's goodput interval
  lies wholly below plain decoding's, and the bracket the intervals give it.
- `bootstrap` / `geomean`: a percentile bootstrap over whole units (rounds of a
  measurement, sequences of a batch), for statistics that steps or drafts, which
  are not independent, would make look surer than they are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
Z95 = 1.959963984540054
"""Two-sided 95% normal quantile."""
MIN_STEPS = 5
"""Fewest steps a (technique, batch size) cell needs before its interval is reported or used."""


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 95% interval."""

    value: float
    low: float
    high: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def wilson(successes: float, trials: float, z: float = Z95) -> Interval | None:
    """Wilson score interval of successes / trials; None without trials.

    >>> w = wilson(8, 10)
    >>> round(w.value, 2), round(w.low, 3), round(w.high, 3)
    (0.8, 0.49, 0.943)
    """
    if trials <= 0:
        return None
    p = min(max(successes / trials, 0.0), 1.0)
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    # at p = 0 or 1 the bound equals p analytically; rounding must not put it on the wrong side
    return Interval(p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))


@dataclass
class Moments:
    """Running sums of (y, x) pairs for the ratio sum(y) / sum(x) and its interval."""

    n: int = 0
    sy: float = 0.0
    sx: float = 0.0
    syy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, y: float, x: float) -> None:
        self.n += 1
        self.sy += y
        self.sx += x
        self.syy += y * y
        self.sxx += x * x
        self.sxy += x * y

    @property
    def ratio(self) -> float | None:
        return self.sy / self.sx if self.sx > 0 else None


def ratio_ci(m: Moments, scale: float = 1.0, z: float = Z95) -> Interval | None:
    """scale * sum(y) / sum(x) with the delta method's 95% interval; None below MIN_STEPS.

    The residuals y - R x have sample variance (syy - 2 R sxy + R^2 sxx) / (n - 1);
    the standard error of R is sqrt(variance / n) / mean(x). Steps are taken as
    independent draws, which consecutive steps of one batch are not quite.

    >>> m = Moments()
    >>> for y, x in [(10, 1.0), (12, 1.0), (8, 1.0), (10, 1.0), (10, 1.0)]:
    ...     m.add(y, x)
    >>> ci = ratio_ci(m)
    >>> ci.value, round(ci.low, 2), round(ci.high, 2)
    (10.0, 8.76, 11.24)
    """
    if m.n < MIN_STEPS or m.sx <= 0:
        return None
    r = m.sy / m.sx
    var = max(m.syy - 2 * r * m.sxy + r * r * m.sxx, 0.0) / (m.n - 1)
    se = math.sqrt(var / m.n) / (m.sx / m.n)
    return Interval(scale * r, scale * (r - z * se), scale * (r + z * se))


def quotient_ci(a: Interval, b: Interval) -> Interval | None:
    """a / b with an interval from the two (log-normal approximation, independent estimates).

    >>> q = quotient_ci(Interval(2.0, 1.8, 2.2), Interval(1.0, 0.9, 1.1))
    >>> q.value, round(q.low, 2), round(q.high, 2)
    (2.0, 1.74, 2.3)
    """
    if min(a.value, a.low, b.value, b.low) <= 0:
        return None
    se_a = (math.log(a.high) - math.log(a.low)) / (2 * Z95)
    se_b = (math.log(b.high) - math.log(b.low)) / (2 * Z95)
    se = math.sqrt(se_a * se_a + se_b * se_b)
    q = a.value / b.value
    return Interval(q, q * math.exp(-Z95 * se), q * math.exp(Z95 * se))


@dataclass(frozen=True)
class Crossover:
    """Where speculation stops paying, from per-batch goodput intervals."""

    batch: int | None
    """Smallest batch size whose speculative interval is wholly below plain's (None: none)."""
    last_paying: int | None
    """Largest batch size below `batch` whose speculative interval is wholly above plain's."""
    compared: tuple[int, ...]
    """Batch sizes where both have an interval."""

    def describe(self) -> str:
        """One phrase for a table cell."""
        if not self.compared:
            return "no batch size with both measured"
        top = max(self.compared)
        if self.batch is None:
            return f"none up to B={top} (never significantly slower)"
        low = f"in ({self.last_paying}, {self.batch}]" if self.last_paying else f"at or below {self.batch}"
        return f"B={self.batch} (crossover {low})"


def crossover(spec: Mapping[int, Interval], plain: Mapping[int, Interval]) -> Crossover:
    """The crossover of one technique against plain decoding over the batch sizes both have.

    >>> s = {1: Interval(20, 18, 22), 4: Interval(30, 28, 32), 16: Interval(40, 38, 42)}
    >>> p = {1: Interval(10, 9, 11), 4: Interval(29, 27, 31), 16: Interval(60, 58, 62)}
    >>> c = crossover(s, p)
    >>> c.batch, c.last_paying, c.describe()
    (16, 1, 'B=16 (crossover in (1, 16])')
    """
    both = tuple(sorted(set(spec) & set(plain)))
    slower = [b for b in both if spec[b].high < plain[b].low]
    first = slower[0] if slower else None
    paying = [b for b in both if spec[b].low > plain[b].high and (first is None or b < first)]
    return Crossover(first, paying[-1] if paying else None, both)


BOOTSTRAP_REPS = 2000


def bootstrap(units: Sequence[T], statistic: Callable[[list[T]], float | None], reps: int = BOOTSTRAP_REPS,
              seed: int = 0) -> Interval | None:
    """`statistic` of `units` with a 95% percentile interval from resampling whole units with
    replacement (seeded, so a report renders the same twice); None with fewer than 2 units or no value.
    With few units the interval is about their range: 3 rounds give at most 10 distinct resamples.

    >>> ci = bootstrap([1.0, 2.0, 3.0, 4.0], lambda xs: sum(xs) / len(xs))
    >>> ci.value, 1.0 <= ci.low < 2.5 < ci.high <= 4.0
    (2.5, True)
    """
    value = statistic(list(units))
    if len(units) < 2 or value is None:
        return None
    rng = random.Random(seed)
    draws = sorted(x for x in (statistic([units[rng.randrange(len(units))] for _ in units])
                               for _ in range(reps)) if x is not None)
    if not draws:
        return None
    lo, hi = draws[int(0.025 * (len(draws) - 1))], draws[math.ceil(0.975 * (len(draws) - 1))]
    return Interval(value, min(lo, value), max(hi, value))


def geomean(xs: Sequence[float]) -> float | None:
    """Geometric mean of positive numbers (None if any is not): the mean of ratios.

    >>> round(geomean([0.5, 2.0]), 6)
    1.0
    """
    if not xs or min(xs) <= 0:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))
