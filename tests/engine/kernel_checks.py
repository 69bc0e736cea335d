"""Checks every C++ kernel (an engine.kernels.ffi `Kernel`) passes alike: its off switch and a
missing compiler each leave the jnp path serving, with the reason logged once.

Each replaces the kernel's once-per-process state with an empty one for the test (monkeypatch
puts the old one back after), so the kernel loads again under the test's environment.
"""

from __future__ import annotations

import logging

from engine.kernels.ffi import Kernel


def check_switched_off(kernel: Kernel, monkeypatch, caplog) -> None:
    """With its environment variable set to off, the kernel says so in one warning."""
    monkeypatch.setattr(kernel, "state", {})
    monkeypatch.setenv(kernel.env, "off")
    with caplog.at_level(logging.WARNING, logger="crossover.engine"):
        assert kernel.kernel_status() == f"jnp ({kernel.env}=off)"
    assert [r.getMessage() for r in caplog.records] == [f"{kernel.label}: jnp ({kernel.env}=off)"]
    assert not kernel.kernel_available()


def check_missing_compiler(kernel: Kernel, monkeypatch, caplog, tmp_path) -> None:
    """With no compiler and no library built before, the kernel names the compiler in one warning."""
    monkeypatch.setattr(kernel, "state", {})
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("CROSSOVER_CACHE", str(tmp_path))
    monkeypatch.delenv(kernel.env, raising=False)
    with caplog.at_level(logging.WARNING, logger="crossover.engine"):
        status = kernel.kernel_status()
    assert status.startswith("jnp (the kernel did not build") and "/nonexistent/g++" in status
    assert len(caplog.records) == 1
    assert not kernel.kernel_available()
