"""First executions: every compiled ragged shape runs once before serving needs it.

XLA:CPU's first execution of an executable costs 100-400 ms more CPU than its later ones on
this machine, even right after warmup compiled or loaded it (measured per shape: no tracing,
no compile, a few page faults; XNNPACK off changes nothing), and grows with the batch. A
serving step that is first to use a shape stalls by that much, and a fresh daemon meets
dozens of shapes in its first minute. So the engine runs each shape once on the scratch page
(all-zero page tables: padding rows write there anyway, nothing reads it as a sequence's):
- `run_all` runs every compiled shape now (a benchmark before it measures);
- `run_one` runs the next one, for the daemon's step loop while it has nothing to do
  (`EngineCore.idle`, which waits until speculation's shapes are compiled: a first run would
  take the cores from that background thread), so a fresh daemon does this in its first idle
  seconds once every technique is ready.
The ragged calls' shapes (token slots, output slots) are compiled before warmup returns
(engine/warmup/warm.py). Proposers' own executables (MTP heads, the early-exit and draft-model
layer stacks and the draft model's catch-up prefill: each proposer's `first_run_jobs`) run
last, once their technique is ready (running one sooner would compile it on the engine
thread), so the first step that drafts with one at a batch bucket does not pay for it
either. A shape serving already ran may run once more here: harmless, and cheaper than
tracking every call.
"""

from __future__ import annotations

import logging

from engine.execute import ragged_calls
from engine.runtime.progress import Reporter, Steps
from engine.warmup.warm import max_outputs, max_tokens

log = logging.getLogger("crossover.engine")

Shape = tuple[int, ...]  # ragged: (token slots, output slots); a proposer's: (index of its job,)


class FirstRuns:
    """The ragged shapes and proposers' first runs of one engine not yet run, cheapest first."""

    def __init__(self, core) -> None:
        self.core = core
        self.jobs = {name: getattr(p, "first_run_jobs", list)() for name, p in core.proposers.items()}
        own = [(name, (i,)) for name, jobs in self.jobs.items() for i in range(len(jobs))]
        ragged = ragged_calls.first_run_shapes(max_tokens(core), max_outputs(core))
        self.left: list[tuple[str, Shape]] = [("ragged", s) for s in ragged] + own

    def run_one(self) -> bool:
        """Run the cheapest shape not yet run that is compiled; whether one ran."""
        for i, (kind, shape) in enumerate(self.left):
            if self._compiled(kind):
                del self.left[i]
                try:
                    self._run(kind, shape)
                except Exception:  # never worth failing serving for: the shape just runs cold later
                    log.exception("running shape %s once failed; no more first runs", shape)
                    self.left.clear()
                return True
        return False

    def run_all(self, progress: Reporter = False) -> int:
        """Run every compiled shape not yet run; how many."""
        n = sum(self._compiled(k) for k, _ in self.left)
        with Steps(progress, "warmup: running each shape once", n) as bar:
            for _ in range(n):
                if not self.run_one():
                    break
                bar.advance()
        return n

    def _compiled(self, kind: str) -> bool:
        if kind == "ragged":  # compiled before warmup returns (engine/warmup/warm.py)
            return True
        warm = self.core.spec_warmup  # a proposer's shape: compiled once its technique is ready
        return warm is not None and warm.status().get(kind) == "ready"

    def _run(self, kind: str, shape: Shape) -> None:
        """Run `shape` once on the scratch page."""
        if kind == "ragged":
            ragged_calls.run_padding(self.core.runner, *shape)
        else:
            self.jobs[kind][shape[0]]()
