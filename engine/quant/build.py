"""engine/quant/kernel.cc as an engine.kernels.build `Library`: ``<cache>/quant/qkernel-<key>.so``.

The source is compiled four times, side by side: the AVX2+FMA+F16C kernels, the AVX-512 kernels,
a portable copy of the AVX-512 tiling (for tests) and the FFI handlers (which choose by CPUID at
load); a compiler without AVX-512 support builds the others alone.
"""

from __future__ import annotations

from pathlib import Path

from engine.kernels import build as _build
from engine.kernels.build import COMMON, BuildError, Library

__all__ = ["LIBRARY", "BuildError", "build"]

LIBRARY = Library(
    source=Path(__file__).with_name("kernel.cc"),
    folder="quant",
    stem="qkernel",
    # -ffp-contract=off: each weight is formed with the roundings gguf's dequantize uses.
    flags=(*COMMON, "-ffp-contract=off"),
    handlers=("-DQK_PART=0",),
    parts={"avx2": ("-DQK_PART=1", "-mavx2", "-mfma", "-mf16c"),
           "avx512": ("-DQK_PART=2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"),
           "portable": ("-DQK_PART=3", "-O1")},  # tests only: a quicker build
    optional={"avx512": "-DQK_NO_AVX512"},
)


def build() -> Path:
    """The quantized-matmul library's path, built first if need be (engine.kernels.build.build)."""
    return _build.build(LIBRARY)
