"""Build engine/quant/kernel.cc into a shared library once per source and compiler.

The library lands in ``<cache>/quant/qkernel-<key>.so`` (`<cache>`: `$CROSSOVER_CACHE`, else
`$XDG_CACHE_HOME/crossover`, else `~/.cache/crossover`), `<key>` hashing the source, the
compiler's version, the flags and jaxlib's FFI headers. An flock on a sibling lock file keeps
two processes from building the same key at once; the second finds the first's library.
The source is compiled four times, side by side: the AVX2+FMA kernels, the AVX-512 kernels, a
portable copy of the AVX-512 tiling (for tests) and the FFI handlers (which choose by CPUID at
load); a compiler without AVX-512 support builds the others alone.
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
         "avx512": ["-DQK_PART=2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
         "portable": ["-DQK_PART=3", "-O1"]}  # tests only: a quicker build


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


def _start(cmd: list[str]) -> subprocess.Popen:
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise BuildError(f"{cmd[0]} failed to run: {exc}") from exc


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        raise BuildError(f"compiling took over 300 s: {exc}") from exc
    return proc.returncode, err.strip()[-2000:]


def _compile(cxx: str, include: Path, out: Path) -> list[str]:
    """Compile the parts side by side and link them into `out`; returns the ISA parts built."""
    with tempfile.TemporaryDirectory(prefix="qkernel-") as tmp:
        objs = {name: Path(tmp) / f"{name}.o" for name in (*PARTS, "main")}
        main = [cxx, *COMMON, "-DQK_PART=0", f"-I{include}", "-c", str(SOURCE), "-o"]
        procs = {name: _start([cxx, *COMMON, *flags, "-c", str(SOURCE), "-o", str(objs[name])])
                 for name, flags in PARTS.items()}
        procs["main"] = _start([*main, str(objs["main"])])
        results = {name: _finish(proc) for name, proc in procs.items()}
        failed = {name: err for name, (rc, err) in results.items() if rc != 0}
        if "avx512" in failed and len(failed) == 1:  # an old compiler: AVX2 alone
            rc, err = _finish(_start([*main[:-1], "-DQK_NO_AVX512", "-c", str(SOURCE), "-o",
                                      str(objs["main"])]))
            failed = {"main": err} if rc else {}
            del objs["avx512"]
        if failed:
            name, err = next(iter(failed.items()))
            raise BuildError(f"compiling the kernel ({name}) failed: {err}")
        tmp_out = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        rc, err = _finish(_start([cxx, "-shared", "-o", str(tmp_out), *map(str, objs.values())]))
        if rc != 0:
            raise BuildError(f"linking the kernel failed: {err}")
        os.replace(tmp_out, out)
    return [name for name in PARTS if name in objs]


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
