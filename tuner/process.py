"""Where a search runs, and the time bound on it: a dead or stuck search never stops the tuner.

`ProcessSearch` (the daemon's default, `search_process`) runs each search in
one spawned worker process at the lowest CPU priority (`lower_priority`):

1. The pool is made by `start()` (the daemon calls it at startup), or else on
   first use. `start()` also has the worker import and run once what a search
   uses (`tuner.search.warm_up`), so the first retune does not pay for it at
   the lowest priority while the engine is busy; `ready` says when that is
   done. Before each search its worker reports its
   pid (so it can be killed later without reaching into the executor); a
   worker that died while idle fails to answer, and is replaced.
2. A search waits at most `job.config.search_timeout_s` (the pool's start
   included). Past it the worker is killed (SIGKILL), the pool dropped and
   `SearchTimeout` raised: the retune ends "failed" and says so.
3. A worker that dies mid-search (`os._exit`, the OOM killer, a signal)
   breaks the pool: `SearchCrashed` is raised and the pool dropped, so the
   next search gets a fresh process: one crash never disables later retunes.
4. `close()` kills a worker still searching, so a stopping daemon does not
   wait out a search (the executor's exit hook would join it).
5. A worker whose daemon died without `close()` (SIGKILL, the OOM killer)
   exits within a second (`_worker_init` watches its parent).

`bounded(search, job)` gives a search run in the daemon's own process (the
`search_process = false` setting, tests) the same time bound. A thread cannot
be killed: a search past its bound runs on detached, and its result is
dropped.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tuner.search import SearchJob, SearchOutcome, run_search, warm_up

SearchRunner = Callable[[SearchJob], SearchOutcome]


class SearchTimeout(RuntimeError):
    """A search ran past `search_timeout_s`."""


class SearchCrashed(RuntimeError):
    """The search's process died before it answered."""


def lower_priority(niceness: int = 19) -> None:
    """Make this process yield the CPU to serving: a search on a machine with few cores
    otherwise takes cycles from the engine thread and shows up in inter-token latency.

    On Linux the process also becomes SCHED_IDLE: it runs only on a core nothing else
    wants. At nice 19 alone, a search still runs between the engine's XLA threads when
    the machine has few cores. Linux keeps both per thread, and a thread inherits them
    from the one that starts it, so every thread already running is lowered too: a
    numerical library's pool started at import (OpenBLAS's) would otherwise keep
    normal priority.

    Where the process may run on several CPUs, every thread is also confined to the last
    of them (threads started later inherit it). SCHED_IDLE alone still slows serving on a
    machine with few cores: a worker free to move between them takes the engine's caches
    and migrates its XLA threads, where one confined to a single CPU leaves the others to
    the engine at nearly the same search rate.
    """
    threads = _threads()
    cpus = _cpus()
    for tid in threads:
        if len(cpus) > 1:
            try:
                os.sched_setaffinity(tid, {max(cpus)})
            except OSError:  # not allowed: the worker runs on every CPU
                pass
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), niceness))
        except (AttributeError, OSError):  # not on this OS, or not allowed: run at normal priority
            pass
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):  # not Linux, or not allowed: nice alone
            pass


def _cpus() -> set[int]:
    """The CPUs this process may run on (empty where the OS does not say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()


def _threads() -> list[int]:
    """This process's thread ids where the OS lists them (Linux: /proc/self/task), else [0]
    (the calling thread, for os.setpriority and os.sched_setscheduler)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _worker_init(poll_s: float = 1.0) -> None:
    """The search worker's initializer: the lowest priority, and exit once the daemon that
    started it is gone. A pool worker waits on a queue whose write end it holds itself, so
    a daemon that was killed (SIGKILL, the OOM killer) would leave it waiting forever."""
    lower_priority()
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ProcessSearch:
    """See the module docstring. `search` is what the worker runs (a module-level function,
    so that it pickles); one search at a time, from the tuner's worker thread."""

    def __init__(self, search: SearchRunner = run_search) -> None:
        self._search = search
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self.pid: int | None = None
        """The worker process's id (None before the first search and after a kill)."""
        self._warming: Future | None = None

    def start(self, db_url: str | None = None) -> None:
        """Make the pool and warm its worker up (`tuner.search.warm_up`, on the database
        searches will use) without waiting."""
        with self._lock:
            if self._pool is None:
                self._pool = self._new_pool()
                self._warming = self._pool.submit(warm_up, db_url)

    @property
    def ready(self) -> bool:
        """Whether a started worker finished warming up (or failed to: a search then makes
        a new one); True when `start()` was never called."""
        with self._lock:
            return self._warming is None or self._warming.done()

    def __call__(self, job: SearchJob) -> SearchOutcome:
        timeout = job.config.search_timeout_s
        deadline = time.monotonic() + timeout
        pool = self._live_pool(deadline)
        try:
            future = pool.submit(self._search, job)
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._drop(pool, kill=True)
            raise SearchTimeout(f"the search ran past search_timeout_s={timeout:g} s; its "
                                "process was killed (the next retune starts a new one)") from None
        except BrokenExecutor:
            self._drop(pool)
            raise SearchCrashed("the search process died (killed, out of memory, or it "
                                "exited); the next retune starts a new one") from None

    def close(self) -> None:
        """Shut the pool down, killing its worker: a search still running, or a worker still
        warming up (`_drop`)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            self._drop(pool, kill=True)

    def _live_pool(self, deadline: float) -> ProcessPoolExecutor:
        """The pool, its worker asked for its pid first: a worker that died while idle fails
        that question (the executor has noticed by then), so it is replaced, once."""
        for attempt in (1, 2):
            with self._lock:
                if self._pool is None:
                    self._pool = self._new_pool()
                pool = self._pool
            try:
                pid = pool.submit(os.getpid).result(
                    timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                self._drop(pool, kill=True)
                raise SearchTimeout("the search process did not answer within "
                                    "search_timeout_s") from None
            except BrokenExecutor:
                self._drop(pool)
                if attempt == 2:
                    raise SearchCrashed("the search process died while starting") from None
                continue
            with self._lock:
                self.pid = pid
            return pool
        raise AssertionError("unreachable")

    @staticmethod
    def _new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init)

    def _drop(self, pool: ProcessPoolExecutor, kill: bool = False) -> None:
        """Forget `pool` (the next search makes a new one); with `kill`, SIGKILL its worker.

        The worker is killed even before a search learned its pid (`_processes`, the
        executor's own table): a worker still importing its warm-up would otherwise hold the
        daemon's exit until it finished, since the interpreter joins the executor at exit."""
        with self._lock:
            pid = self.pid
            if self._pool is pool:
                self._pool, self.pid, self._warming = None, None, None
        if kill:
            pids = {pid} | set(getattr(pool, "_processes", None) or {})
            for p in pids - {None}:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:  # it already exited
                    pass
        pool.shutdown(wait=False, cancel_futures=True)


def bounded(search: SearchRunner, job: SearchJob) -> SearchOutcome:
    """`search(job)` in a helper thread, waiting at most `job.config.search_timeout_s`
    (SearchTimeout past it; the thread runs on, its result dropped)."""
    timeout = job.config.search_timeout_s
    done = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["outcome"] = search(job)
        except BaseException as exc:  # handed to the waiting thread, raised there
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"search-{job.retune_id}", daemon=True).start()
    if not done.wait(timeout):
        raise SearchTimeout(f"the search ran past search_timeout_s={timeout:g} s (it runs in "
                            "this process and cannot be killed; its result will be dropped)")
    if "error" in result:
        raise result["error"]
    return result["outcome"]
