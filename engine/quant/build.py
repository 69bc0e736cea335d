"""Build engine/quant/kernel.cc into a shared library once per source and compiler.

The library lands in ``<cache>/quant/qkernel-<key>.so`` (`<cache>`: `$CROSSOVER_CACHE`, else
`$XDG_CACHE_HOME/crossover`, else `~/.cache/crossover`), `<key>` hashing the source, the
compiler's version, the flags and jaxlib's FFI headers. An flock on a sibling lock file keeps
two processes from building the same key at once; the second finds the first's library.
The source is compiled three times: the AVX2+FMA kernels, the AVX-512 kernels and the FFI
handlers (which choose between the two by CPUID at load); a compiler without AVX-512 support
builds the AVX2 kernels alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernel.cc")
COMMON = ["-O3", "-fPIC", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]
"""-ffp-contract=off: each weight is formed with the roundings gguf's dequantize uses."""
PARTS = {"avx2": ["-DQK_PART=1", "-mavx2", "-mfma"],
         "avx512": ["-DQK_PART=2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]}


class BuildError(RuntimeError):
    """The kernel could not be built; the message says why (the caller falls back to jnp)."""


def _cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = os.environ.get("CROSSOVER_CACHE") or (Path(xdg) if xdg else Path.home() / ".cache") / "crossover"
    return Path(root).expanduser() / "quant"


def ffi_include() -> Path:
    """jaxlib's FFI headers (xla/ffi/api/ffi.h)."""
    import jax.ffi

    return Path(jax.ffi.include_dir())


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise BuildError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    return path


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{cmd[0]} failed to run: {exc}") from exc


def _key(cxx: str, include: Path) -> str:
    version = _run([cxx, "--version"]).stdout
    header = (include / "xla" / "ffi" / "api" / "ffi.h").read_bytes()
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), repr((COMMON, PARTS)).encode(), header):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _compile(cxx: str, include: Path, out: Path) -> list[str]:
    """Compile and link into `out`; returns the ISA parts built."""
    built, objects = [], []
    with tempfile.TemporaryDirectory(prefix="qkernel-") as tmp:
        for name, flags in PARTS.items():
            obj = Path(tmp) / f"{name}.o"
            done = _run([cxx, *COMMON, *flags, "-c", str(SOURCE), "-o", str(obj)])
            if done.returncode != 0:
                if name == "avx2":
                    raise BuildError(f"compiling the AVX2 kernel failed: {done.stderr.strip()[-2000:]}")
                continue  # an old compiler: AVX2 only
            built.append(name)
            objects.append(str(obj))
        main = Path(tmp) / "main.o"
        extra = [] if "avx512" in built else ["-DQK_NO_AVX512"]
        done = _run([cxx, *COMMON, "-DQK_PART=0", *extra, f"-I{include}", "-c", str(SOURCE), "-o", str(main)])
        if done.returncode != 0:
            raise BuildError(f"compiling the FFI handlers failed: {done.stderr.strip()[-2000:]}")
        tmp_out = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        done = _run([cxx, "-shared", "-o", str(tmp_out), str(main), *objects])
        if done.returncode != 0:
            raise BuildError(f"linking the kernel failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)
    return built


def build() -> Path:
    """The kernel library's path, compiling it first if this source and compiler have none yet.

    Raises BuildError (no compiler, a compile error, an unwritable cache) with the reason.
    """
    cxx = _compiler()
    include = ffi_include()
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise BuildError(f"jaxlib's FFI headers are missing under {include}")
    root = _cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        out = root / f"qkernel-{_key(cxx, include)}.so"
        if out.is_file():
            return out
        with open(root / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this key
            if not out.is_file():
                _compile(cxx, include, out)
    except OSError as exc:
        raise BuildError(f"cannot build into {root}: {exc}") from exc
    return out
