"""Traces for the pool-split bench (`crossover bench tuner --trace memory-bound|light`).

Each is one phase of Poisson arrivals (bench.workloads.trace) with its own output length:

- memory-bound: long contexts filling the KV pool. Code and prose prompts (the longer
  kinds) each decode `max_tokens` = 192 tokens whatever EOS says, arriving faster than the
  pool admits them, so requests wait for pages at any split: every page lent to a draft
  model is a smaller batch.
- light: short chat, copy and prose answers (64 tokens) at a low rate, at most two in flight:
  the pool is mostly free, so pages lent cost tenants nothing.

The arrival rate is the caller's (`crossover bench tuner` takes --high-rate for the
memory-bound trace and --low-rate for the light one, times --rate-scale: a slower engine
wants fewer arrivals for the same load); greedy decoding throughout, so every split serves
the same tokens.

    >>> t = split_trace("memory-bound", phase_s=10.0, rate=4.0)
    >>> t.name, len(t.phases), t.max_tokens, t.ignore_eos
    ('memory-bound', 1, 192, True)
    >>> split_trace("light", 10.0, 0.5).phases[0].max_concurrency
    2
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.workloads.trace import Phase

SPLIT_TRACES = ("memory-bound", "light")
"""The traces `split_trace` builds."""


@dataclass(frozen=True)
class SplitTrace:
    """A trace for the split bench: its phases and the output length of every request."""

    name: str
    phases: tuple[Phase, ...]
    max_tokens: int
    """Output tokens each request asks for."""
    ignore_eos: bool
    """Decode exactly max_tokens (the footprint does not depend on where EOS falls)."""


def split_trace(name: str, phase_s: float, rate: float) -> SplitTrace:
    """The trace called `name` (one of SPLIT_TRACES), `phase_s` seconds of `rate` arrivals a
    second."""
    if name == "memory-bound":
        phase = Phase(phase_s, rate, {"code": 1.0, "prose": 1.0})
        return SplitTrace(name, (phase,), max_tokens=192, ignore_eos=True)
    if name == "light":
        phase = Phase(phase_s, rate, {"chat": 1.0, "copy": 1.0, "prose": 1.0}, 2)
        return SplitTrace(name, (phase,), max_tokens=64, ignore_eos=False)
    raise ValueError(f"trace {name!r} is not one of {', '.join(SPLIT_TRACES)}")
