"""Build a C++ kernel source into a shared library once per source and compiler.

A `Library` names its source, the parts it is compiled into side by side (one per instruction
set, each with its flags, plus the XLA FFI handlers, which choose a part by CPUID at load) and
where it lands: ``<cache>/<folder>/<stem>-<key>.so`` (`<cache>`: `$CROSSOVER_CACHE`, else
`$XDG_CACHE_HOME/crossover`, else `~/.cache/crossover`), `<key>` hashing the source, the
headers of this folder it may include (`HEADERS`, on every part's include path: parallel.h), the
compiler's version, the flags and jaxlib's FFI headers. An flock on a sibling lock file keeps
two processes from building the same key at once; the second finds the first's library. A part
the compiler cannot build (an old compiler without AVX-512) may be optional: the handlers are
then compiled again with a macro that leaves it out.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

COMMON = ("-O3", "-fPIC", "-std=c++17", "-fno-math-errno")
HEADERS = Path(__file__).parent  # the kernels' shared headers (`#include "parallel.h"`)


@dataclass(frozen=True)
class Library:
    """One kernel source and how it is compiled (see the module docstring)."""

    source: Path
    folder: str  # the cache's subfolder
    stem: str  # the library's file name before its key
    handlers: tuple[str, ...]  # flags of the FFI handlers' part (it gets jaxlib's headers too)
    parts: dict[str, tuple[str, ...]]  # instruction-set parts: name -> flags
    flags: tuple[str, ...] = COMMON  # every part's flags
    optional: dict[str, str] = field(default_factory=dict)  # part -> handlers' flag when it fails


class BuildError(RuntimeError):
    """The kernel could not be built; the message says why (the caller falls back to jnp)."""


def cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = os.environ.get("CROSSOVER_CACHE") or (Path(xdg) if xdg else Path.home() / ".cache") / "crossover"
    return Path(root).expanduser()


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


def _key(lib: Library, cxx: str, include: Path) -> str:
    version = _run([cxx, "--version"]).stdout
    header = (include / "xla" / "ffi" / "api" / "ffi.h").read_bytes()
    flags = (lib.flags, lib.handlers, sorted(lib.parts.items()), sorted(lib.optional.items()))
    shared = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(HEADERS.glob("*.h")))
    h = hashlib.sha256()
    for part in (lib.source.read_bytes(), shared, version.encode(), repr(flags).encode(), header):
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


def _compile(lib: Library, cxx: str, include: Path, out: Path) -> list[str]:
    """Compile the parts side by side and link them into `out`; returns the parts built."""
    with tempfile.TemporaryDirectory(prefix=f"{lib.stem}-") as tmp:
        objs = {name: Path(tmp) / f"{name}.o" for name in (*lib.parts, "main")}
        compile_ = lambda flags, obj: _start([cxx, *lib.flags, *flags, f"-I{HEADERS}", "-c", str(lib.source),
                                              "-o", str(obj)])
        procs = {name: compile_(flags, objs[name]) for name, flags in lib.parts.items()}
        main = [*lib.handlers, f"-I{include}"]
        procs["main"] = compile_(main, objs["main"])
        results = {name: _finish(proc) for name, proc in procs.items()}
        failed = {name: err for name, (rc, err) in results.items() if rc != 0}
        if failed and failed.keys() <= lib.optional.keys():  # the handlers again, without them
            rc, err = _finish(compile_([*main, *(lib.optional[name] for name in failed)], objs["main"]))
            for name in list(failed):
                del objs[name]
            failed = {"main": err} if rc else {}
        if failed:
            name, err = next(iter(failed.items()))
            raise BuildError(f"compiling the kernel ({name}) failed: {err}")
        tmp_out = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        rc, err = _finish(_start([cxx, "-shared", "-o", str(tmp_out), *map(str, objs.values())]))
        if rc != 0:
            raise BuildError(f"linking the kernel failed: {err}")
        os.replace(tmp_out, out)
    return [name for name in lib.parts if name in objs]


def build(lib: Library) -> Path:
    """The library's path, compiling it first if this source and compiler have none yet.

    Raises BuildError (no compiler, a compile error, an unwritable cache) with the reason.
    """
    cxx = _compiler()
    include = ffi_include()
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise BuildError(f"jaxlib's FFI headers are missing under {include}")
    root = cache_root() / lib.folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        out = root / f"{lib.stem}-{_key(lib, cxx, include)}.so"
        if out.is_file():
            return out
        with open(root / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this key
            if not out.is_file():
                _compile(lib, cxx, include, out)
    except OSError as exc:
        raise BuildError(f"cannot build into {root}: {exc}") from exc
    return out
