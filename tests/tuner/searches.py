"""Search functions the tests hand to tuner.process.ProcessSearch, in a module of their own.

The spawned worker imports the module of the function it is sent after `lower_priority` has
put it on SCHED_IDLE, where it runs only on a core nothing else wants: this module imports
no more than the worker's warm-up has (tuner.search), where importing a test module (pytest,
the tuner service, the daemon) waited for idle CPU time while other tests kept the cores busy.
"""

from __future__ import annotations

import os
import time

from tuner.search import SearchJob, SearchOutcome, run_search


def crash(job: SearchJob) -> SearchOutcome:
    """A search whose process dies at once, as an OOM-killed one would."""
    os._exit(3)


def exit_on_first_retune(job: SearchJob) -> SearchOutcome:
    """Dies like an OOM-killed worker on the test database's first retune (id 1)."""
    if job.retune_id == 1:
        os._exit(3)
    return run_search(job)


def hang_when_bounded_short(job: SearchJob) -> SearchOutcome:
    """Hangs whenever its timeout is short (under 5 s), else searches."""
    if job.config.search_timeout_s < 5:
        time.sleep(600)
    return run_search(job)


def lazy_modules_loaded(job: SearchJob) -> list[bool]:
    """Whether what a search imports lazily is already imported in this worker."""
    import sys

    return [name in sys.modules for name in ("scipy.optimize", "optuna.storages._rdb.storage")]
