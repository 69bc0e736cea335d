"""Timed traffic for load tests: phases of Poisson arrivals with a kind mix each.

1. Each phase covers [start, start + duration_s) of the trace, phases back to back.
2. Inside a phase, gaps between arrivals are exponential with mean 1 / rate_per_s
   (a Poisson process), so the count in a phase is Poisson(rate × duration).
3. Each arrival's kind is drawn from the phase's mix; prompts are then taken
   from one seeded stream per kind across the whole trace, so a prompt does not
   repeat until its kind's pool is used up.
4. The tenant is named after the kind ("copy-tenant"); `phase` indexes the
   `Phase` so a load generator can apply its `max_concurrency`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bench.workloads.kinds import Prompt, check_mix, fill, tenant_for


@dataclass(frozen=True)
class Phase:
    """A stretch of traffic with one arrival rate and one kind mix."""

    duration_s: float
    """Length of the phase in seconds."""
    rate_per_s: float
    """Mean Poisson arrival rate; 0 makes an idle phase."""
    mix: Mapping[str,
                 float] = field(default_factory=lambda: {"copy": 1.0, "code": 1.0, "chat": 1.0, "prose": 1.0})
    """Kind -> relative weight."""
    max_concurrency: int | None = None
    """Most requests a load generator keeps in flight during the phase; None for no cap."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be finite and > 0, got {self.duration_s!r}")
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s >= 0):
            raise ValueError(f"rate_per_s must be finite and >= 0, got {self.rate_per_s!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be None or >= 1, got {self.max_concurrency!r}")
        check_mix(self.mix)


@dataclass(frozen=True)
class TimedPrompt:
    """One arrival of a trace."""

    at_s: float
    """Seconds from the start of the trace."""
    prompt: Prompt
    tenant: str
    phase: int = 0
    """Index of the `Phase` the arrival falls in."""


def trace(phases: Sequence[Phase], seed: int) -> list[TimedPrompt]:
    """Arrivals of all `phases`, sorted by time; same seed, same trace.

    >>> t = trace([Phase(10.0, 2.0, {"copy": 1.0})], seed=0)
    >>> all(0 <= a.at_s < 10 and a.tenant == "copy-tenant" for a in t)
    True
    """
    rng = random.Random(f"crossover-workloads:trace:{seed}")
    arrivals: list[tuple[float, str, int]] = []
    start = 0.0
    for index, phase in enumerate(phases):
        names, weights = check_mix(phase.mix)
        end = start + phase.duration_s
        t = start
        while phase.rate_per_s > 0:
            t += rng.expovariate(phase.rate_per_s)
            if t >= end:
                break
            arrivals.append((t, rng.choices(names, weights)[0], index))
        start = end
    chosen = fill([kind for _, kind, _ in arrivals], seed)
    return [TimedPrompt(at, p, tenant_for(p.kind), index) for (at, _, index), p in zip(arrivals, chosen)]


def shifting_trace(
    phase_s: float = 30.0, low_rate: float = 0.5, high_rate: float = 6.0,
    low_max_concurrency: int | None = None, mid_rate: float | None = None,
    mid_max_concurrency: int = 8,
) -> list[Phase]:
    """Low-load copy-heavy, then high-load mixed, then low-load prose traffic; with
    `mid_rate`, a fourth phase of every kind at moderate load (at most `mid_max_concurrency`
    in flight, so batches of about 4-8).

    The shifts are what the tuner must follow: n-gram drafting should pay in
    phase one and much less once the batch is large or the output stops quoting
    the prompt. The fourth phase mixes tenants whose drafts pass at very
    different rates in batches small enough that verify rows are still cheap:
    where one depth for the whole batch is a compromise, a rule per tenant can
    draft deep for one and not at all for another.

    >>> [len(shifting_trace()), len(shifting_trace(mid_rate=2.0))]
    [3, 4]
    """
    phases = [
        Phase(phase_s, low_rate, {"copy": 0.8, "code": 0.1, "chat": 0.1}, low_max_concurrency),
        Phase(phase_s, high_rate, {"copy": 1.0, "code": 1.0, "chat": 1.0, "prose": 1.0}),
        Phase(phase_s, low_rate, {"prose": 0.8, "chat": 0.2}, low_max_concurrency),
    ]
    if mid_rate is not None:
        phases.append(Phase(phase_s, mid_rate, {"copy": 1.0, "code": 1.0, "chat": 1.0,
                                                "prose": 1.0}, mid_max_concurrency))
    return phases


SHIFTING_TRACE: tuple[Phase, ...] = tuple(shifting_trace())
"""The default three-phase trace (30 s each, 0.5 / 6 / 0.5 requests per second)."""

PHASE_NAMES = ("low-copy", "high-mixed", "low-prose", "mid-mixed")
"""Names of the shifting trace's phases, in order, as reports print them (the fourth only
with `mid_rate`)."""
