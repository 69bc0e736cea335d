"""First executions: every compiled ragged, plain and verify shape runs once before serving needs it.

XLA:CPU's first execution of an executable costs 100-400 ms more CPU than its later ones on
this machine, even right after warmup compiled or loaded it (measured per shape: no tracing,
no compile, a few page faults; XNNPACK off changes nothing), and grows with the batch. A
serving step that is first to use a shape stalls by that much, and a fresh daemon meets
dozens of shapes in its first minute. So the engine runs each shape once on the scratch page
(all-zero page tables: padding rows write there anyway, nothing reads it as a sequence's):
- `run_all` runs every compiled shape now (a benchmark before it measures);
- `run_one` runs the next one, for the daemon's step loop while it has nothing to do
  (`EngineCore.idle`), so a fresh daemon does this in its first idle seconds.
A shape still compiling in the background is skipped until it is compiled (running it would
compile it on the engine thread); verify shapes wait until a technique is ready, segmented verifies (engine/segments.py) until
theirs are compiled. Proposers' own executables (MTP heads, the early-exit and draft-model
layer stacks and the draft model's catch-up prefill: each proposer's `first_run_jobs`) run
last, once their technique is ready, so the first step that drafts with one at a batch bucket
does not pay for it either. A shape serving already ran may run once more here: harmless, and
cheaper than tracking every call.

Each decode shape (batch, 1) and verify shape (batch, 1 + depth) at speculation's context
then runs TIMED_RUNS more times, timed, one run per idle moment once every first run is done
(a request arriving meanwhile waits for one execution at most, as before). The fastest is
kept in `timed` and reported by `EngineCore.capacity()` (`EngineCapacity.shape_ms`); the tuner
prices a verify shape that serving has not run yet from it (tuner.stepfit.shape_factors). A
shape's cost relative to plain decoding at its batch is a property of the machine and the
compiled code, and on XLA:CPU it is not smooth in the rows a step runs (batch 2: 50 ms plain,
60 ms at depth 2, 84 ms at depth 4, 97 ms at depth 8 in `bench tuner --quick`), which no
few-term fit captures.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from engine import ragged_calls
from engine.progress import Reporter, Steps
from engine.segments import new_segment_calls, run_segmented, segment_shapes
from engine.warm import max_outputs, max_tokens

log = logging.getLogger("crossover.engine")

Shape = tuple[int, ...]  # plain and verify (batch, tokens, context); segments (plain rows, verify rows,
# verify tokens, context); ragged (token slots, output slots)

TIMED_RUNS = 2
"""Timed runs of each decode and verify shape after its first (the faster is kept: one run
alone varies by a tenth on a shared machine)."""


class FirstRuns:
    """The ragged, plain and verify shapes of one engine not yet run, cheapest first."""

    def __init__(self, core) -> None:
        self.core = core
        runner = core.runner
        padded = not core.ecfg.ragged_steps  # ragged steps run none of the padded shapes
        plain = sorted(runner.shapes(), key=lambda s: (s[0] * s[1], s[2])) if padded else []
        spec = (sorted(runner.verify_shapes(), key=lambda s: (s[0] * s[1], s[2]))
                if core.proposers and padded else [])
        segments = (sorted(segment_shapes(runner.rc), key=lambda s: s[0] + s[1] * s[2])
                    if core.proposers and padded else [])
        self.jobs = {name: getattr(p, "first_run_jobs", list)() for name, p in core.proposers.items()}
        own = [(name, (i,)) for name, jobs in self.jobs.items() for i in range(len(jobs))]
        ragged = [] if padded else ragged_calls.first_run_shapes(max_tokens(core), max_outputs(core))
        self.left: list[tuple[str, Shape]] = ([("ragged", s) for s in ragged] + [("plain", s) for s in plain]
                                              + [("verify", s) for s in spec]
                                              + [("segments", s) for s in segments] + own)
        self._timed_context = max(runner.rc.spec_contexts) if spec else None
        self._to_time: list[tuple[str, Shape]] = []  # timed runs still to do, one per idle moment
        self.timed: dict[tuple[int, int], float] = {}
        """(batch, 1 + depth) -> ms of the fastest timed run at speculation's context (depth 0:
        plain decoding). Replaced, never changed in place: other threads read it."""

    def run_one(self) -> bool:
        """Run the cheapest shape not yet run that is compiled, else one timed run (after
        every first run: a timed run serves no step); whether one ran."""
        for i, (kind, shape) in enumerate(self.left):
            if self._compiled(kind, shape):
                del self.left[i]
                try:
                    if self._run(kind, shape) and self._timed_shape(kind, shape):
                        self._to_time += [(kind, shape)] * TIMED_RUNS
                except Exception:  # never worth failing serving for: the shape just runs cold later
                    log.exception("running shape %s once failed; no more first runs", shape)
                    self.left.clear()
                    self._to_time.clear()
                return True
        if self._to_time:
            kind, shape = self._to_time.pop(0)
            try:
                self._time(kind, shape)
            except Exception:  # the tuner then prices the shapes left untimed from its fit
                log.exception("timing shape %s failed; no more timed runs", shape)
                self._to_time.clear()
            return True
        return False

    def run_all(self, progress: Reporter = False) -> int:
        """Run every compiled shape not yet run, and their timed runs; how many first runs."""
        first = [(k, s) for k, s in self.left if self._compiled(k, s)]
        n = len(first) + TIMED_RUNS * sum(self._timed_shape(k, s) for k, s in first) + len(self._to_time)
        with Steps(progress, "warmup: running each shape once", n) as bar:
            for _ in range(n):
                if not self.run_one():
                    break
                bar.advance()
        return len(first)

    def _compiled(self, kind: str, shape: Shape) -> bool:
        if kind == "ragged":  # compiled before warmup returns (engine/warm.py)
            return True
        if kind in self.jobs:  # a proposer's shape: compiled once its technique is ready
            warm = self.core.spec_warmup
            return warm is not None and warm.status().get(kind) == "ready"
        if kind == "segments":
            return shape in self.core.runner.segments_ready
        if kind == "verify":
            warm = self.core.spec_warmup
            return warm is not None and any(s == "ready" for s in warm.status().values())
        usable = self.core.runner.usable
        return usable is None or shape in usable

    def _timed_shape(self, kind: str, shape: Shape) -> bool:
        """A decode or verify shape at speculation's context (what `timed` holds)."""
        return ((kind == "verify" or (kind == "plain" and shape[1] == 1))
                and shape[2] == self._timed_context)

    def _time(self, kind: str, shape: Shape) -> None:
        """One timed run; `timed` keeps the fastest."""
        start = time.perf_counter()
        self._run(kind, shape)
        ms, key = (time.perf_counter() - start) * 1e3, (shape[0], shape[1])
        self.timed = {**self.timed, key: min(ms, self.timed.get(key, ms))}

    def _run(self, kind: str, shape: Shape) -> bool:
        """Run `shape` once on the scratch page; False where it is padded to another shape
        (serving never runs it as such)."""
        if kind in self.jobs:
            self.jobs[kind][shape[0]]()
            return True
        runner = self.core.runner
        if kind == "ragged":
            ragged_calls.run_padding(runner, *shape)
            return True
        if kind == "segments":
            p, v, q, context = shape
            cp, cv = new_segment_calls(runner, p, v, q, context)
            cp.n_new[:], cv.n_new[:] = 1, q
            run_segmented(runner, cp, cv, np.full(cv.tokens.shape, -1, np.int32))
            return True
        b, t, context = shape
        if kind == "verify":
            c = runner.new_verify_call(b, t - 1, context)
            c.n_new[:] = t
            runner.run_verify(c, np.full(c.tokens.shape, -1, np.int32))
            return True
        c = runner.new_call(b, t, context)
        if (c.tokens.shape[0], c.tokens.shape[1], c.global_table.shape[1] * runner.rc.page_size) != shape:
            return False  # padded to another shape: this one is not what serving would run
        c.n_new[:] = t
        c.logit_idx[:, 0] = t - 1
        runner.run(c)
        return True
