"""Warmup: the ragged calls first, the proposers' shapes after (the fast start).

1. `warm_engine` compiles (or loads from the persistent cache) every ragged
   call on the calling thread, the engine thread: the forward per token
   bucket and the output call per output count (`engine.execute.ragged_calls.compile_jobs`),
   on WARMUP_THREADS threads. From here the engine can serve every step,
   plainly: `warmup()` returns and the daemon turns ready. A ragged step
   verifies drafts in the same calls, so speculation needs no shape of its own
   beyond its proposers'.
2. It gathers each model proposer's compile jobs (`compile_jobs` in
   engine/speculation/drafting.py), cheapest technique first; a proposer without them
   warms up here. A job compiles ahead of time (`jit(...).lower(...).compile()`)
   from array metadata only: it reads no device buffer and changes no state,
   so it runs safely beside steps.
3. With `background`, a daemon thread at a lower CPU priority runs the jobs
   inside `compiles.warming()` (its lowerings count as warmup, not serving);
   otherwise they run here, before `warmup()` returns. A technique turns
   "ready" once its own jobs are compiled.
4. The engine's `StepChooser` asks `is_ready(technique)` every decode step: a
   technique not ready yet decodes plainly, so serving never compiles.
5. `stop()` (shutdown) starts no further job and waits for the one under way
   (XLA cannot interrupt a compile); unfinished techniques read "stopped".
6. Each job drops JAX's lowering of the shape it compiled
   (`engine.runtime.compiles.compile_ahead`); once every job has run, the heap is trimmed
   and what is left frozen out of the garbage collector's full walks (`freeze_heap`: 2 s each
   over a warmed-up engine's objects).
7. Before each job it checks the process's memory mappings (XLA:CPU maps
   every compiled kernel; Linux kills a process past vm.max_map_count): with
   fewer than MAP_MARGIN left it compiles no more, and the techniques not yet
   ready read "failed" (logged) instead of the daemon dying.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from engine.execute import ragged_calls
from engine.runtime.compiles import (
    compile_count,
    freeze_heap,
    map_limit,
    memory_mappings,
    serving_compiles,
    trim_heap,
    warming,
)
from engine.runtime.progress import Reporter, Steps, note

log = logging.getLogger("crossover.engine")

Job = Callable[[], None]
STATES = ("waiting", "compiling", "ready", "failed", "stopped")
"""What `SpecWarmup.status()` says of a technique (/ready's engine.techniques)."""
BACKGROUND_NICE = 10
"""Niceness added to the background compile thread, so serving keeps the CPU."""
MAP_MARGIN = 1500
"""Memory mappings a job may still need (a compiled forward takes ~440 on XLA:CPU)."""
WARMUP_THREADS = 2
"""Threads compiling (or loading) the ragged calls before the engine turns ready."""
SPEC_THREADS = 2
"""Threads compiling the proposers' shapes, one technique at a time each (the engine's idle
moments wait for them: engine.step.core.EngineCore.idle)."""


class SpecWarmup:
    """Speculation's compile jobs and which techniques they made ready."""

    def __init__(self) -> None:
        self._state: dict[str, str] = {}  # technique -> one of STATES; written by the warmup thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds: float | None = None
        """How long speculation's jobs took, once all ran."""

    def is_ready(self, technique: str) -> bool:
        """Whether `technique` may run: its shapes are compiled (or warmup never began, so the
        engine compiles each shape on demand)."""
        state = self._state.get(technique)
        return state is None or state == "ready"

    def status(self) -> dict[str, str]:
        """Technique -> "waiting", "compiling", "ready", "failed" or "stopped"."""
        return dict(self._state)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, own: dict[str, list[Job]], progress: Reporter, background: bool) -> None:
        """Run each technique's `own` jobs, in that order, here or on a thread."""
        self._state = {t: "waiting" for t in own}
        if not background:
            self._run(own, progress)
            return
        self._thread = threading.Thread(target=self._background, args=(own, progress),
                                        name="crossover-spec-warmup", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Start no further job; wait up to `timeout_s` for the one under way to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("speculation warmup still compiling at shutdown")

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for a background warmup; whether it has ended."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.running

    def _background(self, own: dict[str, list[Job]], progress: Reporter) -> None:
        with _background_thread():
            self._run(own, progress, background=True)

    def _run(self, own: dict[str, list[Job]], progress: Reporter, background: bool = False) -> None:
        t0 = time.perf_counter()
        self._state = {t: "compiling" for t in own}
        lock = threading.Lock()

        def technique_jobs(technique: str, jobs: list[Job]) -> None:
            with _background_thread() if background else contextlib.nullcontext():
                ok = self._jobs(jobs, [technique])
            if ok:
                with lock:
                    self._state = {**self._state, technique: "ready"}
                note(progress, f"warmup: speculation: {technique} ready after "
                               f"{time.perf_counter() - t0:.1f}s")

        # The techniques' jobs on SPEC_THREADS threads, each technique's in order on one.
        with ThreadPoolExecutor(SPEC_THREADS, thread_name_prefix="crossover-spec-warmup") as pool:
            list(pool.map(lambda item: technique_jobs(*item), own.items()))
        self.seconds = time.perf_counter() - t0
        trim_heap()  # the compiles' scratch memory, freed but still resident
        freeze_heap()  # what warmup built lives on: out of the collector's full walks
        used, limit = memory_mappings(), map_limit()
        note(progress, f"warmup: speculation's shapes compiled in {self.seconds:.1f}s; "
                       f"{compile_count()} executables compiled or loaded"
                       + (f"; {used} of this process's {limit} memory mappings in use" if used and limit
                          else ""))

    def _jobs(self, jobs: list[Job], techniques: list[str]) -> bool:
        """Run `jobs`; False (and `techniques` marked) when stopped or one fails."""
        for job in jobs:
            if self._stop.is_set():
                self._mark(techniques, "stopped")
                return False
            used, limit = memory_mappings(), map_limit()
            if used and limit and limit - used < MAP_MARGIN:
                log.warning("speculation warmup stopped: %d of %d memory mappings in use "
                            "(vm.max_map_count); %s decode plainly", used, limit, techniques)
                self._mark(techniques, "failed")
                return False
            try:
                job()
            except Exception:
                log.exception("compiling speculation's shapes failed: %s decode plainly", techniques)
                self._mark(techniques, "failed")
                return False
        return True

    def _mark(self, techniques: list[str], state: str) -> None:
        self._state = {**self._state, **{t: state for t in techniques if self._state.get(t) != "ready"}}


@contextlib.contextmanager
def _background_thread() -> Iterator[None]:
    """This thread at BACKGROUND_NICE (Linux: niceness is per thread; a compile started here
    keeps it), its lowerings counted as warmup (`compiles.warming`)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass
    with warming():
        yield


def _run_pool(jobs: list[Job], n_forward: int, bar: Steps | None = None) -> None:
    """Run the forward jobs, then the sampling jobs (they read the forwards' output layouts),
    on WARMUP_THREADS threads: lowering holds the GIL, loading or compiling mostly not. `bar`
    advances once per job."""
    lock = threading.Lock()

    def run(job: Job) -> None:
        job()
        if bar is not None:
            with lock:
                bar.advance()

    with ThreadPoolExecutor(WARMUP_THREADS, thread_name_prefix="crossover-warmup") as pool:
        for group in (jobs[:n_forward], jobs[n_forward:]):
            list(pool.map(run, group))


def max_tokens(core) -> int:
    """Most tokens one ragged step runs: the scheduler's token budget, plus the drafts of the
    rows that may verify."""
    rc = core.runner.rc
    return core.scheduler.cfg.token_budget + _drafts(rc)


def _drafts(rc) -> int:
    return min(rc.spec_max_batch, rc.max_batch) * (max(rc.verify_tokens, default=1) - 1)


def max_outputs(core) -> int:
    """Most output tokens one ragged step asks for: a token per row, plus the drafts of the rows
    that may verify."""
    return core.runner.rc.max_batch + _drafts(core.runner.rc)


def warm_engine(core, progress: Reporter, background: bool) -> SpecWarmup:
    """Warm `core` (an EngineCore) as the module docstring says; returns its SpecWarmup, whose
    `is_ready` the core's StepChooser then consults."""
    runner = core.runner
    forwards, heads = ragged_calls.compile_jobs(runner, max_tokens(core), max_outputs(core))
    t0 = time.perf_counter()
    with Steps(progress, "warmup: compiling shapes", len(forwards) + len(heads)) as bar:
        _run_pool(forwards + heads, len(forwards), bar)
    note(progress, f"warmup: {len(forwards)} ragged forwards and {len(heads)} output calls compiled "
                   f"in {time.perf_counter() - t0:.1f}s")
    jobs: dict[str, list[Job]] = {}
    for name, p in core.proposers.items():
        compile_jobs = getattr(p, "compile_jobs", None)
        if compile_jobs is not None:
            jobs[name] = compile_jobs()
        else:  # a proposer without ahead-of-time jobs warms up here, on the engine thread
            p.warmup(progress)
            jobs[name] = []
    own = dict(sorted(jobs.items(), key=lambda kv: len(kv[1])))  # the quickest to ready first
    warm = SpecWarmup()
    if not runner.rc.verify_tokens:  # nothing verifies: no technique can run
        own = {}
    warm.start(own, progress, background)
    runner.warm_compiles = serving_compiles()
    core._chooser.ready = warm.is_ready
    if not warm.running:
        trim_heap()
    freeze_heap()  # the model and vocabulary now; a background warmup freezes its own when done
    used, limit = memory_mappings(), map_limit()
    if progress and used and limit:
        note(progress, f"warmup: plain decoding ready, {compile_count()} executables compiled or loaded; "
                       f"{used} of this process's {limit} memory mappings in use"
                       + ("; the other shapes compile in the background" if warm.running else ""))
    return warm
