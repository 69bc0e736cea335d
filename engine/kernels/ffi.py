"""A kernel `Library` as the model's Python code uses it: built, loaded and registered with XLA
once per process, or the reason the jnp path serves instead.

A `Kernel` builds its library on first use (engine.kernels.build), registers each FFI handler
symbol as a CPU custom-call target, and remembers the outcome as a status line ("ffi (<isa>)"
or "jnp (<why>)"), logged once. The environment variable it names switches it off (off, 0,
false, no). Each library exports ctypes controls under one symbol prefix: `<prefix>isa()`,
`<prefix>best_isa()`, `<prefix>set_isa(code)` (-1 where the CPU lacks it) and
`<prefix>set_threads(n)`; an ISA code of 0 means the CPU runs none of its parts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field

import jax

from engine.kernels.build import BuildError, Library, build

log = logging.getLogger("crossover.engine")


@dataclass
class Kernel:
    label: str  # the log line's prefix: "<label>: <status>"
    env: str  # the off switch
    library: Library
    targets: dict[str, str]  # XLA target name -> the library's handler symbol
    prefix: str  # the ctypes controls' symbol prefix
    isa_names: dict[int, str]  # ISA code -> name
    no_isa: str = "the CPU runs none of the kernel's instruction sets"  # status reason for code 0
    state: dict[str, object] = field(default_factory=dict)  # "lib": ctypes.CDLL | None, "status": str
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def load(self) -> ctypes.CDLL | None:
        """Build (or find) and register the kernel once per process; None when the jnp path serves."""
        with self._lock:
            if "status" in self.state:
                return self.state["lib"]  # type: ignore[return-value]
            lib, status = None, ""
            if os.environ.get(self.env, "").lower() in ("off", "0", "false", "no"):
                status = f"jnp ({self.env}=off)"
            else:
                try:
                    lib = ctypes.CDLL(str(build(self.library)))
                    isa = getattr(lib, self.prefix + "isa")()
                    if isa == 0:
                        lib, status = None, f"jnp ({self.no_isa})"
                    else:
                        for target, symbol in self.targets.items():
                            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
                            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
                        status = f"ffi ({self.isa_names[isa]})"
                except (BuildError, OSError, AttributeError) as exc:
                    lib, status = None, f"jnp (the kernel did not build or load: {exc})"
            (log.info if lib is not None else log.warning)("%s: %s", self.label, status)
            self.state.update(lib=lib, status=status)
            return lib

    def _control(self, name: str):
        return getattr(self.load(), self.prefix + name)

    def kernel_status(self) -> str:
        """"ffi (<isa>)" or "jnp (<why>)": the path the kernel's callers take on CPU."""
        self.load()
        return str(self.state["status"])

    def kernel_available(self) -> bool:
        return self.load() is not None

    def set_isa(self, name: str) -> str:
        """Force the kernel's ISA (a name of `isa_names` the CPU runs, or "best"); returns the
        previous one. For tests and benchmarks: it is process-wide."""
        if self.load() is None:
            raise RuntimeError(f"no kernel: {self.kernel_status()}")
        previous = self.isa_names[self._control("isa")()]
        best = self._control("best_isa")()
        code = best if name == "best" else {n: c for c, n in self.isa_names.items()}.get(name, -1)
        if self._control("set_isa")(code) < 0:
            raise ValueError(f"ISA {name!r} is not available on the CPU (best: {self.isa_names[best]})")
        return previous

    def supported_isas(self, lowest: int = 1) -> list[str]:
        """The kernel ISAs from code `lowest` up that the CPU runs ([] without the kernel)."""
        if self.load() is None:
            return []
        best = self._control("best_isa")()
        return [n for c, n in self.isa_names.items() if lowest <= c <= best]

    def set_threads(self, n: int) -> None:
        """Threads per kernel call (0: XLA's intra-op pool size). Process-wide; for benchmarks."""
        if self.load() is not None:
            self._control("set_threads")(int(n))
