"""What the spawned search worker of tests/tuner/test_service.py reports of its own scheduling.

Its own module, importing nothing heavy: the worker imports the module of each function it
is sent, and once its priority is lowered (SCHED_IDLE, one CPU) an import of the test module
(optuna, SQLAlchemy, the tuner) waited for idle CPU time, tens of seconds while other tests
kept both cores busy.
"""

from __future__ import annotations

import os


def scheduling(tid: int = 0) -> tuple[int, int]:
    return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)


EARLY: dict[str, int] = {}
"""The worker's thread started before its priority was lowered (`start_early_thread`)."""


def start_early_thread() -> None:
    """A worker initializer that starts a thread before lowering the process's priority, as
    a numerical library's thread pool does at import."""
    import threading

    from tuner.process import lower_priority

    ready = threading.Event()

    def run() -> None:
        EARLY["tid"] = threading.get_native_id()
        ready.set()
        threading.Event().wait()  # alive for the worker's life

    threading.Thread(target=run, daemon=True).start()
    ready.wait()
    lower_priority()


def early_thread_scheduling() -> tuple[int, int]:
    return scheduling(EARLY["tid"])


def cpus_of(tid: int = 0) -> set[int]:
    return set(os.sched_getaffinity(tid))


def early_thread_cpus() -> set[int]:
    return cpus_of(EARLY["tid"])
