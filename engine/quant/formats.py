"""Group-quantized weight matrices kept as stored: int8, packed 5-bit or 4-bit values, float scales.

A `QuantWeight` stands for a float32 matrix W [K (in), N (out)] that the model uses as
``x @ W``; groups of `group` consecutive inputs (rows of W, the reduction axis) share one
scale per output column:

    int8 (bits 8):  W[k, n] = scales[g, n] * q[k, n]                  q int8
    5-bit (bits 5): W[k, n] = scales[g, n] * (q[k, n] - 16)           q in 0..31
    int4 (bits 4):  W[k, n] = scales[g, n] * q[k, n] - mins[g, n]    q in 0..15
    with g = k // group.

Each product (and the subtraction of a min) is one float32 rounding, the same operations in the
same order as `gguf.quants.dequantize` (q - 16 is an exact small integer), so `dequantize()`
equals that package's float32 weights bit for bit: the kernels compute with exactly the numbers
the float32 path uses. Scales are float32, or float16 (bits 8 and 5) where every scale is a
float16 number: GGUF's Q8_0 and Q5_0 store their block scale as one, so holding it as float16
is exact and halves the scale bytes; a float16 scale is widened to float32 before the multiply.

Storage is in panels of PANEL output columns, so a matmul kernel streams each panel's bytes
in order (engine/quant/kernel.cc reads exactly this layout):

    values  int8  [N / PANEL, K, PANEL]        (bits 8)
            uint8 [N / PANEL, K / 2, PANEL]    (bits 4, and bits 5's low four bits: row 2i in
                                                the low nibble, 2i+1 in the high one)
    scales  float32 or float16 [N / PANEL, K / group, PANEL]
    mins    float32 [N / PANEL, K / group, PANEL] (bits 4), else None
    high    uint8 [N / PANEL, K / 8, PANEL]    (bits 5: bit j of byte i is bit 4 of q at row
                                                8i + j), else None

Bits per weight: 8 + 16 / 32 for Q8_0 (groups of 32, float16 scales), 5 + 16 / 32 for Q5_0,
8 + 32 / 16 for Q6_K (groups of 16, float32 scales), 4 + 64 / 32 for Q4_K.

Constructors: `from_gguf` (Q8_0, Q5_0, Q6_K, Q4_K blocks, lossless), `quantize_int8`
(float weights, one scale per output column by default), `concat_columns` (fused leaves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 16
"""Output columns per panel; N must be a multiple of it."""

# GGUF block types this module unpacks: name -> (ggml type id, values per block, bytes per block).
GGUF_TYPES = {"Q8_0": (8, 32, 34), "Q5_0": (6, 32, 22), "Q6_K": (14, 256, 210), "Q4_K": (12, 256, 144)}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantWeight:
    """A group-quantized W [K, N] (see the module docstring for the layout)."""

    values: jax.Array  # int8 [N/PANEL, K, PANEL] or uint8 [N/PANEL, K/2, PANEL] (two 4-bit rows a byte)
    scales: jax.Array  # float32 or float16 [N/PANEL, K/group, PANEL]
    mins: jax.Array | None  # float32 [N/PANEL, K/group, PANEL] (bits 4), else None
    shape: tuple[int, int] = field(metadata={"static": True})  # (K, N) of the float matrix
    group: int = field(metadata={"static": True})  # inputs sharing one scale
    bits: int = field(metadata={"static": True})  # 8, 5 or 4
    high: jax.Array | None = None  # uint8 [N/PANEL, K/8, PANEL] (bits 5: bit 4 of each q), else None

    @property
    def nbytes(self) -> int:
        """Bytes held (values, scales, mins, high)."""
        leaves = [a for a in (self.values, self.scales, self.mins, self.high) if a is not None]
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)


def _check(k: int, n: int, group: int, bits: int) -> None:
    if bits not in (4, 5, 8):
        raise ValueError(f"bits must be 8, 5 or 4, got {bits}")
    if n % PANEL:
        raise ValueError(f"N = {n} output columns is not a multiple of the panel width {PANEL}")
    if group <= 0 or k % group:
        raise ValueError(f"K = {k} inputs is not a multiple of the group size {group}")
    if group % 2:
        raise ValueError(f"the kernel reads rows in pairs: group size {group} must be even")
    if bits == 5 and group % 8:
        raise ValueError(f"5-bit weights keep 8 rows' high bits in a byte: group size {group} must be a "
                         "multiple of 8")


def _panels(a: np.ndarray) -> np.ndarray:
    """[N, R] (output-major, as GGUF stores rows) -> [N / PANEL, R, PANEL]."""
    n, r = a.shape
    return np.ascontiguousarray(a.reshape(n // PANEL, PANEL, r).transpose(0, 2, 1))


def _scales(a: np.ndarray, bits: int) -> np.ndarray:
    """float16 scales stay float16 (bits 8 and 5, where the kernel widens them); others float32."""
    if a.dtype == np.float16 and bits != 4:
        return a
    return a.astype(np.float32, copy=False)


def pack(q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None,
         bits: int | None = None) -> QuantWeight:
    """Values q [N, K] and scales/mins [N, K/group], in GGUF's output-major order, as a QuantWeight of
    W [K, N] (host numpy leaves). `bits`: 8 (q int8), 5 (q in 0..31, W = s * (q - 16)) or 4 (q in
    0..15, with `mins`); None: 4 with mins, else 8. Scales float16 stay float16 (bits 8 and 5),
    any other dtype becomes float32; mins are float32."""
    n, k = q.shape
    group = k // scales.shape[1]
    bits = bits if bits is not None else 4 if mins is not None else 8
    _check(k, n, group, bits)
    if (mins is not None) != (bits == 4):
        raise ValueError(f"{bits}-bit weights {'need' if bits == 4 else 'take no'} mins")
    if scales.shape != (n, k // group) or (mins is not None and mins.shape != scales.shape):
        raise ValueError(f"scales {scales.shape} do not match values {q.shape} in groups of {group}")
    high = None
    if bits == 8:
        values = _panels(q.astype(np.int8, copy=False))
    else:
        top = 15 if bits == 4 else 31
        if q.min() < 0 or q.max() > top:
            raise ValueError(f"{bits}-bit values must lie in 0..{top}")
        p = _panels(q.astype(np.uint8, copy=False))
        values = (p[:, 0::2, :] & 0x0F) | ((p[:, 1::2, :] & 0x0F) << 4)
        if bits == 5:  # bit 4 of rows 8i..8i+7 -> bits 0..7 of byte i
            bit4 = ((p >> 4) & 1).reshape(p.shape[0], k // 8, 8, PANEL)
            high = np.ascontiguousarray(np.packbits(bit4, axis=2, bitorder="little")[:, :, 0, :])
    return QuantWeight(values, _panels(_scales(scales, bits)),
                       None if mins is None else _panels(mins.astype(np.float32, copy=False)),
                       (k, n), group, bits, high)


# ------------------------------------------------------------- GGUF blocks ---


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 from the last axis's 2 bytes (native-order float16)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def _f32(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 from the last axis's 2 bytes, widened to float32 (exact)."""
    return _f16(b).astype(np.float32)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    # block: d f16 | 32 x int8
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    # block: d f16 | high bits u32 (bit j -> value j) | 16 bytes: value j low nibble, value j+16 high.
    # Returns q in 0..31 (the weight is d * (q - 16)).
    high = np.ascontiguousarray(b[:, 2:6]).view("<u4")  # [B, 1]
    bit = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [B, 32]
    low = np.concatenate([b[:, 6:] & 0x0F, b[:, 6:] >> 4], axis=1)
    return low | (bit << 4), _f16(b[:, :2]), None


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    # block of 256: ql 128 bytes | qh 64 | 16 x int8 scales | d f16. Each half h of 128 values
    # uses ql[64h : 64h + 64] and qh[32h : 32h + 32]; value 32c + l (c = 0..3, l < 32) takes
    # the low (c < 2) or high (c >= 2) nibble of ql[64h + 32 (c % 2) + l] and bits 2c, 2c + 1
    # of qh[32h + l].
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 2, 32)  # [B, half, c % 2, l]
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    nib = np.stack([ql & 0x0F, ql >> 4], axis=2)  # [B, half, c // 2, c % 2, l]
    nib = nib.reshape(nb, 2, 4, 32)  # c = 2 (c // 2) + c % 2
    two = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    q = (nib | (two << 4)).astype(np.int8) - 32
    scale = _f32(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(nb, 256), scale, None


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # block of 256: d f16 | dmin f16 | 12 bytes of 6-bit scales and mins for 8 sub-blocks | 128
    # bytes: chunk c (32 bytes) holds sub-block 2c in low nibbles, 2c + 1 in high nibbles.
    # Sub-block j < 4: scale s[j] & 63, min s[j+4] & 63; j >= 4: scale from s[j+4] low nibble
    # and s[j-4] top two bits, min from s[j+4] high nibble and s[j] top two bits.
    nb = b.shape[0]
    s = b[:, 4:16]
    lo_sc, lo_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    sc = np.concatenate([lo_sc, hi_sc], axis=1).astype(np.float32)
    mn = np.concatenate([lo_mn, hi_mn], axis=1).astype(np.float32)
    qs = b[:, 16:].reshape(nb, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 256)
    return q, _f32(b[:, 0:2])[:, None] * sc, _f32(b[:, 2:4])[:, None] * mn


_UNPACK = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q6_K": _q6_k, "Q4_K": _q4_k}
_GROUP = {"Q8_0": 32, "Q5_0": 32, "Q6_K": 16, "Q4_K": 32}
_BITS = {"Q8_0": 8, "Q5_0": 5, "Q6_K": 8, "Q4_K": 4}


def from_gguf(raw: np.ndarray | bytes, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """The GGUF tensor of numpy `shape` (out N, in K) stored as `qtype` blocks in `raw` (its bytes),
    as W [K, N] for ``x @ W`` (the GGUF matrix transposed), losslessly.

    >>> raw = np.zeros(16 * 34, np.uint8)  # 16 rows x one Q8_0 block of 32 values
    >>> raw[2::34] = 3; raw[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    >>> w = from_gguf(raw, "Q8_0", (16, 32)); w.shape, w.group, w.bits, float(dequantize(w)[0, 0])
    ((32, 16), 32, 8, 1.5)
    """
    if qtype not in _UNPACK:
        raise ValueError(f"no quantized layout for GGUF type {qtype} (known: {', '.join(_UNPACK)})")
    n, k = shape
    _, block, size = GGUF_TYPES[qtype]
    if k % block:
        raise ValueError(f"{qtype} rows of {k} values are not whole {block}-value blocks")
    raw = np.frombuffer(raw, np.uint8) if isinstance(raw, bytes) else np.asarray(raw, np.uint8)
    blocks = raw.reshape(-1, size)
    if blocks.shape[0] != n * k // block:
        raise ValueError(f"{raw.size} bytes of {qtype} do not hold a {shape} tensor")
    q, scale, minimum = _UNPACK[qtype](blocks)
    groups = k // _GROUP[qtype]
    return pack(q.reshape(n, k), scale.reshape(n, groups),
                None if minimum is None else minimum.reshape(n, groups), _BITS[qtype])


# ------------------------------------------------------------ float weights ---


def quantize_int8(w: np.ndarray, group: int | None = None) -> QuantWeight:
    """Symmetric int8 of a float W [K, N]: per output column (`group` None = K) or per `group`
    inputs, scale = max|W| / 127 of the group, values rounded to nearest (lossy).

    >>> w = quantize_int8(np.array([[1.0] * 16, [-0.5] * 16], np.float32))
    >>> dequantize(w)[:, 0].tolist(), w.group
    ([1.0, -0.5039370059967041], 2)
    """
    w = np.asarray(w, np.float32)
    k, n = w.shape
    group = k if group is None else group
    _check(k, n, group, 8)
    g = w.T.reshape(n, k // group, group)
    scale = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(g / safe[..., None]), -127, 127).astype(np.int8)
    return pack(q.reshape(n, k), scale)


def concat_columns(ws: list[QuantWeight]) -> QuantWeight:
    """[W1 | W2 | ...] along the output axis (a fused qkv or gate_up leaf); same K, group, bits and
    scale dtype."""
    first = ws[0]
    key = lambda w: (w.shape[0], w.group, w.bits, np.dtype(w.scales.dtype))
    if any(key(w) != key(first) for w in ws):
        raise ValueError("concatenated weights need the same K, group size, bits and scale dtype: "
                         + ", ".join(f"{w.shape} g{w.group} {w.bits}-bit {np.dtype(w.scales.dtype)} scales"
                                     for w in ws))
    xp = jnp if isinstance(first.values, jax.Array) else np
    cat = lambda f: None if getattr(first, f) is None else xp.concatenate([getattr(w, f) for w in ws])
    shape = (first.shape[0], sum(w.shape[1] for w in ws))
    return QuantWeight(cat("values"), cat("scales"), cat("mins"), shape, first.group, first.bits, cat("high"))


# ------------------------------------------------------------- dequantize ---


def _unpanel(a, xp):
    """[P, R, PANEL] -> [R, P * PANEL]."""
    p, r, _ = a.shape
    return xp.transpose(a, (1, 0, 2)).reshape(r, p * PANEL)


def _levels(values, high, bits: int, xp):
    """The integer factor of each weight as float32, [A, K, B], from values [A, K or K/2, B] (and
    bits 5's high-bit plane [A, K/8, B]): q (bits 8, 4) or q - 16 (bits 5), all exact."""
    if bits == 8:
        return values.astype(xp.float32)
    a, r, b = values.shape
    q = xp.stack([values & 0x0F, values >> 4], axis=2).reshape(a, 2 * r, b)
    if bits == 4:
        return q.astype(xp.float32)
    shifts = xp.arange(8, dtype=xp.uint8).reshape(1, 1, 8, 1)
    bit4 = ((high[:, :, None, :] >> shifts) & 1).reshape(a, 2 * r, b)
    return ((q | (bit4 << 4)).astype(xp.int32) - 16).astype(xp.float32)


def dequantize(w: QuantWeight):
    """The float32 W [K, N] (numpy for numpy leaves, else a jax array; also inside jit).

    Equals `gguf.quants.dequantize(...).T` bit for bit for a `from_gguf` weight.
    """
    xp = np if isinstance(w.values, np.ndarray) else jnp
    out = _levels(w.values, w.high, w.bits, xp) * xp.repeat(w.scales.astype(xp.float32), w.group, axis=1)
    if w.mins is not None:
        out = out - xp.repeat(w.mins, w.group, axis=1)
    return _unpanel(out, xp)


def selectable(w, n: int) -> bool:
    """Whether `select_columns` takes n columns of `w`: a QuantWeight, n a multiple of PANEL."""
    return isinstance(w, QuantWeight) and n % PANEL == 0


def select_columns(w: QuantWeight, ids) -> QuantWeight:
    """W[:, ids] in W's own form (`selectable`): a draft vocabulary's rows of a tied table at the
    table's bytes per entry, where `take_columns` would make them float32."""
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 1 or not selectable(w, ids.size):
        raise ValueError(f"select_columns takes a multiple of {PANEL} ids, got shape {ids.shape}")
    p, lane = ids // PANEL, ids % PANEL

    def pick(a):  # [P, R, PANEL] -> the chosen columns as panels [len(ids) / PANEL, R, PANEL]
        if a is None:
            return None
        cols = a[p, :, lane]  # [n, R]
        return cols.reshape(-1, PANEL, cols.shape[1]).transpose(0, 2, 1)

    return QuantWeight(pick(w.values), pick(w.scales), pick(w.mins), (w.shape[0], int(ids.size)), w.group,
                       w.bits, pick(w.high))


def take_columns(w: QuantWeight, ids: jax.Array) -> jax.Array:
    """Columns `ids` of W as rows, float32 [len(ids), K]: an embedding lookup in a tied table
    (W = embedding.T), without dequantizing the rest."""
    p, lane = ids // PANEL, ids % PANEL
    high = None if w.high is None else w.high[p, :, lane][..., None]  # [T, K/8, 1]
    q = _levels(w.values[p, :, lane][..., None], high, w.bits, jnp)[..., 0]  # [T, K]
    out = q * jnp.repeat(w.scales[p, :, lane].astype(jnp.float32), w.group, axis=1)
    if w.mins is not None:
        out = out - jnp.repeat(w.mins[p, :, lane], w.group, axis=1)
    return out
