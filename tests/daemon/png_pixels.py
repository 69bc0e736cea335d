"""A tiny PNG reader for screenshot tests: 8-bit RGB/RGBA, non-interlaced (what Chromium writes).

    width, height, pixels = read_png(path)   # pixels: numpy uint8 [height, width, channels]
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {2: 3, 6: 4}  # PNG colour type -> channels (RGB, RGBA)


def read_png(path: Path) -> tuple[int, int, np.ndarray]:
    data = path.read_bytes()
    assert data[:8] == SIGNATURE, "not a PNG file"
    chunks = _chunks(data)
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and colour in CHANNELS and interlace == 0, (depth, colour, interlace)
    bpp = CHANNELS[colour]
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), np.uint8)
    previous = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        out[y] = _unfilter(int(rows[y, 0]), rows[y, 1:], previous, bpp)
        previous = out[y]
    return width, height, out.reshape(height, width, bpp)


def _chunks(data: bytes) -> dict[bytes, bytes]:
    """Chunk type -> body; IDAT bodies are concatenated."""
    found: dict[bytes, bytes] = {}
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        found[kind] = found.get(kind, b"") + body if kind == b"IDAT" else body
        pos += 12 + length
    return found


def _unfilter(kind: int, line: np.ndarray, up: np.ndarray, bpp: int) -> np.ndarray:
    if kind == 0:
        return line.copy()
    if kind == 2:
        return line + up  # uint8 arithmetic wraps, as the filter wants
    if kind == 1:  # Sub: a running sum per channel, mod 256
        sums = np.cumsum(line.reshape(-1, bpp).astype(np.int64), axis=0) % 256
        return sums.astype(np.uint8).reshape(-1)
    return _sequential(kind, line.tolist(), up.tolist(), bpp)


def _sequential(kind: int, line: list[int], up: list[int], bpp: int) -> np.ndarray:
    """Average (3) and Paeth (4): each byte depends on the one `bpp` to its left."""
    out = [0] * len(line)
    for i, x in enumerate(line):
        a = out[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:
            out[i] = (x + ((a + b) >> 1)) & 0xFF
            continue
        c = up[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        out[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return np.array(out, np.uint8)
