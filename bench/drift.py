"""How fast the machine was during each run of `crossover bench tuner`, from the steps.

`bench tuner` runs its policies one after the other on one shared machine, and that
machine's speed drifts between runs: in one round of `--quick` runs, plain batch-25-32
steps took a median 194 ms in one policy's run and 324 ms in the next, at the same
context. A policy's goodput carries its run's machine speed, and the per-phase "best
static policy" is the luckiest of several runs, so one round cannot resolve 10 %.

Steps of one shape cost the same on the same machine whatever policy ran them, so
every step's time is modelled as

    log(step_ms) = shape effect + (run, phase) effect

and fitted by alternating medians over the shapes that at least two runs share (a
shape: technique and depth, batch bucket, prefill bucket, whether a row samples,
whether a verify ran plain rows apart, the KV pages in use to within a factor of
about 1.4). exp((run, phase) effect) is that stretch's **speed index**: 1 is the
round's median stretch, 1.3 means its steps took 30 % longer than the same shapes
elsewhere. A stretch with fewer than `MIN_STEPS` steps of shared shapes keeps 1.

`adjusted_ms(stats)` divides a step's time by its stretch's index: goodputs from
those times compare policies as if each had run on the same machine. They are a
diagnostic, not the benchmark's figures: the targets are judged on measured time.
The autotuned run's search process could make its own steps slower, and the index
would then hide that cost; so `search_slowdown` compares its steps that ran while a
retune searched with those that did not (residuals after the fit, ratio of medians).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from engine.types import pow2_bucket

MIN_STEPS = 10
"""Steps of shared shapes a (run, phase) stretch needs for an index of its own."""
ROUNDS = 20
"""Alternations of the median fit (it settles within a few on bench data)."""


def shape(stats: Any) -> tuple:
    """A step's shape: what its cost depends on besides the machine (module doc).

    >>> from engine.types import StepStats
    >>> shape(StepStats(technique="ngram", depth=2, batch_size=27, prefill_tokens=40,
    ...                 kv_pages_used=800, sampled_rows=3))
    ('ngram', 2, 32, 128, 19, True, False)
    """
    batch = pow2_bucket(stats.batch_size)
    prefill = next((b for b in (0, 32, 128, 512) if stats.prefill_tokens <= b), 4096)
    pages = round(2 * math.log2(max(1, stats.kv_pages_used)))
    return (stats.technique, int(stats.depth), batch, prefill, pages,
            stats.sampled_rows > 0, getattr(stats, "plain_rows", 0) > 0)


def _stretch(bounds: list[tuple[float, float]], t: float) -> int | None:
    """The phase whose time `t` falls in (before the first, the first); None after the last
    (the autotuned run's retune-latency probe, which is no phase's)."""
    for i, (_, hi) in enumerate(bounds):
        if t < hi:
            return i
    return None


def fit(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Speed index per run and phase (module doc) from each run's `steps` ((stats, per
    request) pairs) and `bounds` (each phase's start and end, the clock of stats.time).

    Returns {"index": {run: [index per phase]}, "steps": {run: [shared steps per phase]},
    "residual": {run: [(time, log residual)]}}."""
    samples = []  # (run, phase, shape, log ms, time)
    for name, run in runs.items():
        for stats, _ in run["steps"]:
            phase = _stretch(run["bounds"], stats.time)
            if stats.step_ms > 0 and phase is not None:
                samples.append((name, phase, shape(stats), math.log(stats.step_ms), stats.time))
    owners: dict[tuple, set] = defaultdict(set)
    for name, _, key, _, _ in samples:
        owners[key].add(name)
    shared = [s for s in samples if len(owners[s[2]]) >= 2]
    run_eff: dict[tuple, float] = defaultdict(float)
    shape_eff: dict[tuple, float] = defaultdict(float)
    for _ in range(ROUNDS):
        by_shape: dict[tuple, list] = defaultdict(list)
        for name, phase, key, y, _ in shared:
            by_shape[key].append(y - run_eff[(name, phase)])
        shape_eff = defaultdict(float, {k: float(np.median(v)) for k, v in by_shape.items()})
        by_run: dict[tuple, list] = defaultdict(list)
        for name, phase, key, y, _ in shared:
            by_run[(name, phase)].append(y - shape_eff[key])
        run_eff = defaultdict(float, {k: float(np.median(v)) for k, v in by_run.items()
                                      if len(v) >= MIN_STEPS})
        if run_eff:  # the round's median stretch is the reference speed
            mid = float(np.median(list(run_eff.values())))
            run_eff = defaultdict(float, {k: v - mid for k, v in run_eff.items()})
    counts: dict[tuple, int] = defaultdict(int)
    residual: dict[str, list] = defaultdict(list)
    for name, phase, key, y, t in shared:
        counts[(name, phase)] += 1
        residual[name].append((t, y - shape_eff[key] - run_eff[(name, phase)]))
    return {"index": {n: [round(math.exp(run_eff[(n, i)]), 4) for i in range(len(r["bounds"]))]
                      for n, r in runs.items()},
            "steps": {n: [counts[(n, i)] for i in range(len(r["bounds"]))] for n, r in runs.items()},
            "residual": dict(residual)}


def adjusted_ms(run: dict[str, Any], index: list[float]):
    """A function of a step's stats: its time on the round's reference machine."""
    def ms(stats: Any) -> float:
        phase = _stretch(run["bounds"], stats.time)
        return stats.step_ms / index[len(index) - 1 if phase is None else phase]
    return ms


def search_slowdown(residual: list[tuple[float, float]], windows: list[tuple[float, float]]
                    ) -> dict[str, Any]:
    """How much slower the autotuned run's steps were while a retune searched: exp of the
    median residual of steps inside a search window minus that of steps outside one.

    >>> search_slowdown([(1, 0.0), (2, 0.1), (3, 0.0), (4, 0.1)], [(1.5, 2.5), (3.5, 4.5)])
    {'ratio': 1.1052, 'steps_in': 2, 'steps_out': 2}
    """
    inside, outside = [], []
    for t, r in residual:
        (inside if any(a <= t <= b for a, b in windows) else outside).append(r)
    ratio = (round(math.exp(float(np.median(inside)) - float(np.median(outside))), 4)
             if inside and outside else None)
    return {"ratio": ratio, "steps_in": len(inside), "steps_out": len(outside)}
