"""The converted-weights cache: one .npy per pytree leaf, keyed by the model file's sha256.

Converting a GGUF (dequantize, transpose, fuse, stack) takes tens of seconds;
the cache makes every later load a memory map. A folder per dtype lives under
`cache_dir()/params-<sha>-<format>/`; it appears atomically (written to a
temporary sibling, then renamed), so a process that dies mid-write leaves no
half folder, and two processes racing to write it both end with a whole one.
bfloat16 leaves are stored as their uint16 bits (numpy has no bfloat16 .npy). The
quantized format (engine/model/quant_weights.py's GGUF_CACHE folder, its layout's version in
its name) keeps each array's own dtype (dtype None) and a meta.json beside the arrays.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from engine.model.gguf_file import cache_dir

CACHE_FORMAT = "v1"
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def cache_folder(sha: str, dtype: np.dtype | str) -> Path:
    """Where the leaves of the file with this sha256 live in `dtype`, or in a named format such
    as "gguf-v2" (its parent holds every one)."""
    name = dtype if isinstance(dtype, str) else dtype.name
    return cache_dir() / f"params-{sha[:24]}-{CACHE_FORMAT}" / name


def write_cache(target: Path, leaves: Iterable[tuple[str, np.ndarray]], dtype: np.dtype | None,
                meta: dict | None = None) -> None:
    """One .npy per leaf (bfloat16 stored as its uint16 bits; dtype None: each leaf's own) and
    `meta` as meta.json, written after the leaves (the generator may fill it as it goes); the
    dir appears atomically."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, arr in leaves:
            arr = arr if dtype is None else arr.astype(dtype, copy=False)
            np.save(tmp / f"{name}.npy", arr.view(np.uint16) if dtype == BFLOAT16 else arr)
            del arr
        if meta is not None:
            (tmp / "meta.json").write_text(json.dumps(meta))
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_cache(folder: Path, names: Iterable[str],
               dtype: np.dtype | None) -> Iterator[tuple[str, np.ndarray]]:
    """Read-only memory maps: `jax.device_put` aliases them on CPU instead of copying."""
    for name in names:
        arr = np.load(folder / f"{name}.npy", mmap_mode="r")
        yield name, arr.view(dtype) if dtype == BFLOAT16 else arr
