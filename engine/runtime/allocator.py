"""The process's allocator settings for the engine (glibc), read before anything heavy loads.

`crossover serve`, `generate` and `bench` restart themselves once with HUGE_PAGE_TUNABLE
(cli/main.py: `restart_with_allocator_settings`), as do the kernel benchmarks run as modules
(`python -m bench.quant_matmul`, `bench.quant_engine`); `bench engine` reports the settings beside
its page faults per step.
"""

from __future__ import annotations

import os

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc tunable that backs malloc's mmap'd chunks with transparent huge pages (madvise). XLA:CPU
allocates each call's scratch buffers with malloc; above glibc's mmap threshold (at most 32 MiB)
every buffer is mmap'd and unmapped again after the call, so the next call page-faults it in
4 KiB at a time (a 258 MiB buffer: ~67,000 minor faults and 110-143 ms of system time a call);
in 2 MiB pages a fully touched buffer takes up to 512 times fewer faults. glibc reads tunables
only at process start."""


def allocator_env(env: dict[str, str]) -> dict[str, str] | None:
    """`env` with HUGE_PAGE_TUNABLE added to GLIBC_TUNABLES, or None when it holds it already, when
    CROSSOVER_MALLOC=default asks to leave the allocator alone, or off Linux/glibc.
    Example: allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"]
    == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"."""
    import platform

    have = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in have or env.get("CROSSOVER_MALLOC") == "default" \
            or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return {**env, "GLIBC_TUNABLES": f"{have}:{HUGE_PAGE_TUNABLE}" if have else HUGE_PAGE_TUNABLE}


def allocator_settings() -> dict:
    """What this process's allocator runs with: the glibc tunables it started with and the
    kernel's transparent huge page mode (None where unreadable)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        thp = None
    return {"glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "transparent_hugepage": thp}


def restart_with_allocator_settings() -> None:
    """Re-execute this process once with `allocator_env`'s settings (glibc reads them only at
    start); returns where nothing changes."""
    import sys

    env = allocator_env(dict(os.environ))
    if env is not None and getattr(sys, "orig_argv", None):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
