"""The machine's CPU as benchmark JSON names it: model name and vector-extension flags."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    keep = ("avx", "fma", "f16c", "amx")
    return sorted(f for f in line.split(":", 1)[-1].split() if f.startswith(keep))


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()
