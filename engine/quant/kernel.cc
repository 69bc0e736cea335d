// y [M, N] = x [M, K] @ W [K, N] for a group-quantized W (engine/quant/formats.py has the layout),
// converting each weight to float32 in registers: no float copy of W is ever written.
//
//   int8:  W[k, n] = s[g, n] * q[k, n]            values int8  [P, K, 16]
//   5-bit: W[k, n] = s[g, n] * (q[k, n] - 16)     values uint8 [P, K/2, 16] (q's low four bits,
//                                                 row 2i low nibble), high uint8 [P, K/8, 16]
//                                                 (bit j of byte i: bit 4 of q at row 8i + j)
//   int4:  W[k, n] = s[g, n] * q[k, n] - m[g, n]   values uint8 [P, K/2, 16] (row 2i low nibble)
//   scales float32, or float16 (int8 and 5-bit); mins float32; both [P, K/G, 16]; P = N / 16
//   panels; g = k / G.
//
// Each weight is formed exactly as gguf's dequantize forms it (q - 16 an exact small integer, a
// float16 scale widened exactly to float32, then one rounding per multiply and per subtraction;
// built with -ffp-contract=off), then multiplied into float32 accumulators.
//
// One source, compiled four times (engine/quant/build.py): QK_PART=1 the AVX2+FMA+F16C kernels,
// QK_PART=2 the AVX-512 kernels, QK_PART=3 a portable scalar copy of the AVX-512 kernels (the
// same tiling, one 16-lane vector a panel: tests check that tiling on CPUs without AVX-512; never
// chosen by default), QK_PART=0 the XLA FFI handlers, which pick a kernel by CPUID once and
// split the panels over XLA's intra-op thread pool.
#include <cstddef>
#include <cstdint>

namespace qk {
struct Args {
  const float* x;       // [M, K]
  const void* w;        // values
  const void* s;        // scales: float32, or float16 bits (the kernel's instantiation says which)
  const float* mn;      // mins (int4) or null
  const uint8_t* high;  // bit 4 of each value (5-bit) or null
  float* y;             // [M, N]
  int64_t M, K, N, G;
  int64_t ahead = 0;    // software prefetch distance in the weight streams, bytes (0: none)
};
using PanelFn = void (*)(const Args&, int64_t p0, int64_t p1);  // panels [p0, p1)

// How the values of a weight are stored.
enum Form { kI8 = 0, kI5 = 1, kI4 = 2 };

// The greedy screen (int8 weights, float16 scales): each row's x held as int16 steps of one
// size per group, xq[k] * dq[g] = x[k] + err[k], then per column n the approximate logit
// app[n] = sum_g s[g, n] dq[g] sum_k xq[k] q[k, n] (integer sums, exact) and a bound
// bnd[n] = sum_g |s[g, n]| eb[g] with eb[g] >= 128 G max |err| plus slack for the float roundings
// (|q| <= 128; see Steps), so that the exact logit lies within app[n] +- bnd[n].
// pmax_lo / pmax_up [M, P]: per panel, the largest app - bnd and app + bnd of its 16 columns.
struct ScreenArgs {
  const int16_t* xq;      // [M, K]
  const float* dq;        // [M, K/G]
  const float* eb;        // [M, K/G]
  const int8_t* w;        // [P, K, 16]
  const uint16_t* s;      // [P, K/G, 16] float16 bits
  float* app;             // [M, N]
  float* bnd;             // [M, N]
  float* pmax_lo;         // [M, P]
  float* pmax_up;         // [M, P]
  int64_t M, K, N, G;
  int64_t ahead = 0;      // as Args::ahead
};
using ScreenFn = void (*)(const ScreenArgs&, int64_t p0, int64_t p1);  // panels [p0, p1)

// IEEE float16 bits -> float32, exactly (every float16 is a float32).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {  // infinity, NaN
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {  // normal: rebias 15 -> 127
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero, subnormal: mant * 2^-24 (exact in float32)
    const float f = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -f : f;
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
}  // namespace qk

#if QK_PART == 1 || QK_PART == 2 || QK_PART == 3
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include <vector>

namespace qk {
namespace {

// Fully unrolled register loops: without it GCC keeps the accumulator arrays in memory too
// and stores them on every k (half the FMA rate).
#define QK_UNROLL _Pragma("GCC unroll 32")

// A software prefetch `bytes` ahead of p in a weight stream (none for 0). Each panel's values
// are one contiguous stream read once per call; the hardware prefetchers alone leave a one- or
// two-thread sweep well below the memory's streaming rate, and one prefetch per 64-byte line
// read, a few lines ahead (Args::ahead), brings it close.
inline void ahead(const void* p, int64_t bytes) {
  if (bytes > 0) __builtin_prefetch(static_cast<const char*>(p) + bytes, 0, 3);
}

#if QK_PART == 1 || QK_PART == 2
// A vpshufb table per lane: entry i is 0xF0 where bit b0 (lane 0) or b1 (lane 1) of i is clear, else 0.
inline __m256i top_if_clear(int b0, int b1) {
  alignas(32) int8_t t[32];
  for (int i = 0; i < 16; ++i) {
    t[i] = (i >> b0) & 1 ? 0 : static_cast<int8_t>(0xF0);
    t[16 + i] = (i >> b1) & 1 ? 0 : static_cast<int8_t>(0xF0);
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}

// An 8-row block of 5-bit values (p: 4 row pairs of low nibbles, 64 bytes; h: the block's
// high-bit bytes) as q - 16 in int8, out [2][4][16]: row 2t + i at out[i][t]. A clear high bit
// sets the top four bits (low nibble | 0xF0 is q - 16 in int8 when q < 16, the low nibble is
// when q >= 16). Two row pairs a 256-bit vector; the 0xF0-or-0 byte of row r comes from a
// table lookup (vpshufb) indexed by the nibble of the high-bit byte that holds bit r. The
// AVX-512 part decodes with it too: the decode is a small share of the work, and both parts
// then form the same int8 rows with the same code.
inline void q5_block_256(const uint8_t* p, const uint8_t* h, int8_t* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  // rows 0..3 read bits 0..3 (the low nibble), rows 4..7 bits 4..7 (the high one)
  const __m256i idx[2] = {_mm256_broadcastsi128_si256(_mm_and_si128(hb, _mm_set1_epi8(0x0F))),
                          _mm256_broadcastsi128_si256(_mm_and_si128(_mm_srli_epi16(hb, 4), _mm_set1_epi8(0x0F)))};
  QK_UNROLL for (int half = 0; half < 2; ++half) {  // row pairs 2 half and 2 half + 1 (lanes 0, 1)
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
    // lane 0 holds rows 4 half (+1), lane 1 rows 4 half + 2 (+1): bits 0 (1) and 2 (3) of idx[half]
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(b, nib), _mm256_shuffle_epi8(top_if_clear(0, 2), idx[half]));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nib),
                                       _mm256_shuffle_epi8(top_if_clear(1, 3), idx[half]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * half), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 + 32 * half), hi);
  }
}
#endif

#if QK_PART == 1
struct V {  // AVX2: a panel of 16 columns is two 8-float vectors
  using F = __m256;
  static constexpr int kPer = 2;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F scale(const float* p) { return _mm256_loadu_ps(p); }
  static F scale(const uint16_t* p) {  // 8 float16 -> 8 floats (F16C, exact)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void i8(const int8_t* p, F* out) {  // 16 int8 -> 2 x 8 floats (8-byte loads widened)
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
  static void u4(const uint8_t* p, F* lo, F* hi) {  // 16 bytes -> rows 2i and 2i+1, 16 floats each
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i l = _mm_and_si128(b, mask), h = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    lo[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l));
    lo[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(l, 8)));
    hi[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h));
    hi[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(h, 8)));
  }
  static void q5_block(const uint8_t* p, const uint8_t* h, int8_t* out) { q5_block_256(p, h, out); }
};
#define QK_NAME(x) x##_avx2
constexpr int kRows = 6;        // rows a float tile keeps in registers (6 x 2 accumulators)
constexpr int kDirectRows = 4;  // up to these rows convert weights in registers per row tile
constexpr int kWide = 2;        // panels a one-row tile reads at once (4 independent chains)
#elif QK_PART == 2
struct V {  // AVX-512: a panel is one 16-float vector
  using F = __m512;
  static constexpr int kPer = 1;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F scale(const float* p) { return _mm512_loadu_ps(p); }
  static F scale(const uint16_t* p) {  // 16 float16 -> 16 floats (exact)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void i8(const int8_t* p, F* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, F* lo, F* hi) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i mask = _mm_set1_epi8(0x0F);
    lo[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    hi[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
  }
  static void q5_block(const uint8_t* p, const uint8_t* h, int8_t* out) { q5_block_256(p, h, out); }
};
#define QK_NAME(x) x##_avx512
constexpr int kRows = 12;
constexpr int kDirectRows = 8;
constexpr int kWide = 4;
#else
struct V {  // portable: the AVX-512 layout in plain C++, with the same single-rounding fma
  struct F {
    float v[16];
  };
  static constexpr int kPer = 1;
  static F zero() { return F{}; }
  static F load(const float* p) { F r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
  static F scale(const float* p) { return load(p); }
  static F scale(const uint16_t* p) { F r; for (int i = 0; i < 16; ++i) r.v[i] = half_to_float(p[i]); return r; }
  static F bcast(const float* p) { F r; for (int i = 0; i < 16; ++i) r.v[i] = *p; return r; }
  static F fma(F a, F b, F c) { for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
  static F mul(F a, F b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
  static F sub(F a, F b) { for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i]; return a; }
  static void store(float* p, F v) { for (int i = 0; i < 16; ++i) p[i] = v.v[i]; }
  static void i8(const int8_t* p, F* out) { for (int i = 0; i < 16; ++i) out[0].v[i] = p[i]; }
  static void u4(const uint8_t* p, F* lo, F* hi) {
    for (int i = 0; i < 16; ++i) lo[0].v[i] = p[i] & 15, hi[0].v[i] = p[i] >> 4;
  }
  static void q5_block(const uint8_t* p, const uint8_t* h, int8_t* out) {  // as the AVX2 one
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 16; ++i) {
        const int b = p[16 * t + i];
        out[16 * t + i] = static_cast<int8_t>(((b & 15) | (((h[i] >> (2 * t)) & 1) << 4)) - 16);
        out[64 + 16 * t + i] = static_cast<int8_t>(((b >> 4) | (((h[i] >> (2 * t + 1)) & 1) << 4)) - 16);
      }
  }
};
#define QK_NAME(x) x##_portable
constexpr int kRows = 12;
constexpr int kDirectRows = 8;
constexpr int kWide = 4;
#endif

using F = V::F;
constexpr int kPer = V::kPer;

// The int8 rows V::q5_block stored are read back from memory by V::i8 (a widening load per 8
// values): without this barrier GCC forwards the stores in registers and widens them with
// extra shuffles, which cost more than the L1 round trip.
#define QK_KEEP_IN_MEMORY(buf) asm volatile("" : : "r"(buf) : "memory")

// Offset of row i (0..7) of a block V::q5_block decoded: row 2t + h at [h][t][16].
constexpr int q5_row(int i) { return ((i & 1) * 4 + i / 2) * 16; }

// One tile: rows [m0, m0 + R) of y, panels [p, p + W). Weights of one k are converted once and
// used by all R rows. S: the scales' element type (float, or uint16_t for float16 bits).
template <int R, int W, Form kForm, typename S>
inline void tile(const Args& a, int64_t m0, int64_t p) {
  constexpr int NV = W * kPer;
  F acc[R][NV];
  QK_UNROLL for (int r = 0; r < R; ++r)
    QK_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = V::zero();
  const int64_t K = a.K, G = a.G, ng = K / G;
  const float* x = a.x + m0 * K;
  for (int64_t g = 0; g < ng; ++g) {
    F sc[NV], mn[NV];
    QK_UNROLL for (int j = 0; j < W; ++j)
      QK_UNROLL for (int v = 0; v < kPer; ++v) {
        const int64_t off = ((p + j) * ng + g) * 16 + v * (16 / kPer);
        sc[j * kPer + v] = V::scale(static_cast<const S*>(a.s) + off);
        if constexpr (kForm == kI4) mn[j * kPer + v] = V::load(a.mn + off);
        if (v == 0) {  // a group's scales (and mins) are 64 bytes at most
          ahead(static_cast<const S*>(a.s) + off, a.ahead / 8);
          if constexpr (kForm == kI4) ahead(a.mn + off, a.ahead / 8);
        }
      }
    const int64_t k0 = g * G;
    if constexpr (kForm == kI8) {
      for (int64_t k = k0; k < k0 + G; ++k) {
        F w[NV];
        if ((k & 3) == 0)  // 16 bytes a row: a line every 4 rows
          QK_UNROLL for (int j = 0; j < W; ++j)
            ahead(static_cast<const int8_t*>(a.w) + ((p + j) * K + k) * 16, a.ahead);
        QK_UNROLL for (int j = 0; j < W; ++j) V::i8(static_cast<const int8_t*>(a.w) + ((p + j) * K + k) * 16, w + j * kPer);
        QK_UNROLL for (int v = 0; v < NV; ++v) w[v] = V::mul(w[v], sc[v]);
        QK_UNROLL for (int r = 0; r < R; ++r) {
          F xb = V::bcast(x + r * K + k);
          QK_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(xb, w[v], acc[r][v]);
        }
      }
    } else if constexpr (kForm == kI4) {
      for (int64_t k = k0; k < k0 + G; k += 2) {
        F lo[NV], hi[NV];
        if ((k & 7) == 0)  // 16 bytes a row pair: a line every 8 rows
          QK_UNROLL for (int j = 0; j < W; ++j)
            ahead(static_cast<const uint8_t*>(a.w) + ((p + j) * (K / 2) + k / 2) * 16, a.ahead);
        QK_UNROLL for (int j = 0; j < W; ++j)
          V::u4(static_cast<const uint8_t*>(a.w) + ((p + j) * (K / 2) + k / 2) * 16, lo + j * kPer, hi + j * kPer);
        QK_UNROLL for (int v = 0; v < NV; ++v) {
          lo[v] = V::sub(V::mul(lo[v], sc[v]), mn[v]);
          hi[v] = V::sub(V::mul(hi[v], sc[v]), mn[v]);
        }
        QK_UNROLL for (int r = 0; r < R; ++r) {
          F x0 = V::bcast(x + r * K + k), x1 = V::bcast(x + r * K + k + 1);
          QK_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(x1, hi[v], V::fma(x0, lo[v], acc[r][v]));
        }
      }
    } else {  // 5-bit: each 8-row block to int8 q - 16 (in L1), then as int8 values
      for (int64_t k = k0; k < k0 + G; k += 8) {
        alignas(64) int8_t q[W][128];
        QK_UNROLL for (int j = 0; j < W; ++j) {  // 64 bytes of values a block, 16 of high bits
          ahead(static_cast<const uint8_t*>(a.w) + ((p + j) * (K / 2) + k / 2) * 16, a.ahead);
          if ((k & 31) == 0) ahead(a.high + ((p + j) * (K / 8) + k / 8) * 16, a.ahead / 4);
        }
        QK_UNROLL for (int j = 0; j < W; ++j)
          V::q5_block(static_cast<const uint8_t*>(a.w) + ((p + j) * (K / 2) + k / 2) * 16,
                      a.high + ((p + j) * (K / 8) + k / 8) * 16, q[j]);
        QK_KEEP_IN_MEMORY(q);
        QK_UNROLL for (int i = 0; i < 8; ++i) {
          F w[NV];
          QK_UNROLL for (int j = 0; j < W; ++j) V::i8(q[j] + q5_row(i), w + j * kPer);
          QK_UNROLL for (int v = 0; v < NV; ++v) w[v] = V::mul(w[v], sc[v]);
          QK_UNROLL for (int r = 0; r < R; ++r) {
            F xb = V::bcast(x + r * K + k + i);
            QK_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(xb, w[v], acc[r][v]);
          }
        }
      }
    }
  }
  QK_UNROLL for (int r = 0; r < R; ++r)
    QK_UNROLL for (int v = 0; v < NV; ++v) V::store(a.y + (m0 + r) * a.N + p * 16 + v * (16 / kPer), acc[r][v]);
}

// Panel p's weights as float32, buf [K][16]: the same values `tile` forms in registers.
template <Form kForm, typename S>
inline void unpack(const Args& a, int64_t p, float* buf) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  // Rows k and k + 1 of the panel, scaled (and less the mins), into buf.
  auto put = [buf](int64_t k, F* w0, F* w1, const F* sc, const F* mn) {
    QK_UNROLL for (int v = 0; v < kPer; ++v) {
      w0[v] = V::mul(w0[v], sc[v]);
      w1[v] = V::mul(w1[v], sc[v]);
      if constexpr (kForm == kI4) {
        w0[v] = V::sub(w0[v], mn[v]);
        w1[v] = V::sub(w1[v], mn[v]);
      }
      V::store(buf + k * 16 + v * (16 / kPer), w0[v]);
      V::store(buf + (k + 1) * 16 + v * (16 / kPer), w1[v]);
    }
  };
  for (int64_t g = 0; g < ng; ++g) {
    F sc[kPer], mn[kPer];
    QK_UNROLL for (int v = 0; v < kPer; ++v) {
      sc[v] = V::scale(static_cast<const S*>(a.s) + (p * ng + g) * 16 + v * (16 / kPer));
      if constexpr (kForm == kI4) mn[v] = V::load(a.mn + (p * ng + g) * 16 + v * (16 / kPer));
    }
    ahead(static_cast<const S*>(a.s) + (p * ng + g) * 16, a.ahead / 8);
    if constexpr (kForm == kI4) ahead(a.mn + (p * ng + g) * 16, a.ahead / 8);
    if constexpr (kForm == kI5) {
      for (int64_t k = g * G; k < g * G + G; k += 8) {
        alignas(64) int8_t q[128];
        ahead(static_cast<const uint8_t*>(a.w) + (p * (K / 2) + k / 2) * 16, a.ahead);
        if ((k & 31) == 0) ahead(a.high + (p * (K / 8) + k / 8) * 16, a.ahead / 4);
        V::q5_block(static_cast<const uint8_t*>(a.w) + (p * (K / 2) + k / 2) * 16, a.high + (p * (K / 8) + k / 8) * 16, q);
        QK_KEEP_IN_MEMORY(q);
        QK_UNROLL for (int i = 0; i < 8; i += 2) {
          F w0[kPer], w1[kPer];
          V::i8(q + q5_row(i), w0);
          V::i8(q + q5_row(i + 1), w1);
          put(k + i, w0, w1, sc, mn);
        }
      }
    } else {
      for (int64_t k = g * G; k < g * G + G; k += 2) {
        F w0[kPer], w1[kPer];
        if constexpr (kForm == kI4) {
          if ((k & 7) == 0)
            ahead(static_cast<const uint8_t*>(a.w) + (p * (K / 2) + k / 2) * 16, a.ahead);
          V::u4(static_cast<const uint8_t*>(a.w) + (p * (K / 2) + k / 2) * 16, w0, w1);
        } else {
          if ((k & 3) == 0) ahead(static_cast<const int8_t*>(a.w) + (p * K + k) * 16, a.ahead);
          V::i8(static_cast<const int8_t*>(a.w) + (p * K + k) * 16, w0);
          V::i8(static_cast<const int8_t*>(a.w) + (p * K + k + 1) * 16, w1);
        }
        put(k, w0, w1, sc, mn);
      }
    }
  }
}

// Rows [m0, m0 + R) of y for one panel from its unpacked float weights.
template <int R>
inline void tile_f32(const Args& a, int64_t m0, int64_t p, const float* buf) {
  F acc[R][kPer];
  QK_UNROLL for (int r = 0; r < R; ++r)
    QK_UNROLL for (int v = 0; v < kPer; ++v) acc[r][v] = V::zero();
  const int64_t K = a.K;
  const float* x = a.x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    F w[kPer];
    QK_UNROLL for (int v = 0; v < kPer; ++v) w[v] = V::load(buf + k * 16 + v * (16 / kPer));
    QK_UNROLL for (int r = 0; r < R; ++r) {
      F xb = V::bcast(x + r * K + k);
      QK_UNROLL for (int v = 0; v < kPer; ++v) acc[r][v] = V::fma(xb, w[v], acc[r][v]);
    }
  }
  QK_UNROLL for (int r = 0; r < R; ++r)
    QK_UNROLL for (int v = 0; v < kPer; ++v) V::store(a.y + (m0 + r) * a.N + p * 16 + v * (16 / kPer), acc[r][v]);
}

template <int R>
void rest_f32(const Args& a, int64_t m, int64_t p, const float* buf) {
  if constexpr (R > 0) {
    if (a.M - m == R) return tile_f32<R>(a, m, p, buf);
    rest_f32<R - 1>(a, m, p, buf);
  }
}

template <int R, Form kForm, typename S>
inline void rest_direct(const Args& a, int64_t p) {
  if constexpr (R > 0) {
    if (a.M == R) return tile<R, 1, kForm, S>(a, 0, p);
    rest_direct<R - 1, kForm, S>(a, p);
  }
}

template <Form kForm, typename S>
void panels(const Args& a, int64_t p0, int64_t p1) {
  if (a.M == 1) {  // decode: several panels at once for independent accumulator chains
    int64_t p = p0;
    for (; p + kWide <= p1; p += kWide) tile<1, kWide, kForm, S>(a, 0, p);
    for (; p < p1; ++p) tile<1, 1, kForm, S>(a, 0, p);
    return;
  }
  if (a.M <= kDirectRows) {  // few rows: convert in registers, once per row tile
    for (int64_t p = p0; p < p1; ++p) rest_direct<kDirectRows, kForm, S>(a, p);
    return;
  }
  // More rows: unpack each panel once into a float buffer that stays in cache, then a plain
  // float32 tile of kRows rows at a time sweeps it.
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(a.K) * 16) buf.resize(a.K * 16);
  for (int64_t p = p0; p < p1; ++p) {
    unpack<kForm, S>(a, p, buf.data());
    int64_t m = 0;
    for (; m + kRows <= a.M; m += kRows) tile_f32<kRows>(a, m, p, buf.data());
    if (m < a.M) rest_f32<kRows - 1>(a, m, p, buf.data());
  }
}

#if QK_PART == 1
// Screen rows [m0, m0 + R) over panel p (see ScreenArgs). Rows k and k + 1 are interleaved
// column by column and widened to int16, so that one madd multiplies a column's two weights by
// the row's two int16 steps and adds them: integer sums, exact, at about half the instructions
// a float32 product of the panel takes.
template <int R>
inline void screen_tile(const ScreenArgs& a, int64_t m0, int64_t p) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  __m256 ap[R][2], bd[R][2];
  QK_UNROLL for (int r = 0; r < R; ++r)
    QK_UNROLL for (int v = 0; v < 2; ++v) ap[r][v] = bd[r][v] = _mm256_setzero_ps();
  const int8_t* w = a.w + p * K * 16;
  for (int64_t g = 0; g < ng; ++g) {
    __m256i acc[R][2];
    QK_UNROLL for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t k = g * G; k < g * G + G; k += 2) {
      if ((k & 3) == 0) ahead(w + k * 16, a.ahead);
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + 1) * 16));
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1));  // columns 0..7
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1));  // columns 8..15
      QK_UNROLL for (int r = 0; r < R; ++r) {
        int32_t pair;  // xq[k] in the low half, xq[k + 1] in the high one
        std::memcpy(&pair, a.xq + (m0 + r) * K + k, sizeof pair);
        const __m256i xp = _mm256_set1_epi32(pair);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(lo, xp));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(hi, xp));
      }
    }
    const int64_t off = (p * ng + g) * 16;
    __m256 sc[2];
    QK_UNROLL for (int v = 0; v < 2; ++v)
      sc[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.s + off + 8 * v)));
    QK_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(a.dq[(m0 + r) * ng + g]), e = _mm256_set1_ps(a.eb[(m0 + r) * ng + g]);
      QK_UNROLL for (int v = 0; v < 2; ++v) {
        ap[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(sc[v], d), _mm256_cvtepi32_ps(acc[r][v]), ap[r][v]);
        bd[r][v] = _mm256_fmadd_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), sc[v]), e, bd[r][v]);  // |s| e
      }
    }
  }
  const int64_t P = a.N / 16;
  QK_UNROLL for (int r = 0; r < R; ++r) {
    float* app = a.app + (m0 + r) * a.N + p * 16;
    float* bnd = a.bnd + (m0 + r) * a.N + p * 16;
    QK_UNROLL for (int v = 0; v < 2; ++v) {
      _mm256_storeu_ps(app + 8 * v, ap[r][v]);
      _mm256_storeu_ps(bnd + 8 * v, bd[r][v]);
    }
    const __m256 lo = _mm256_max_ps(_mm256_sub_ps(ap[r][0], bd[r][0]), _mm256_sub_ps(ap[r][1], bd[r][1]));
    const __m256 up = _mm256_max_ps(_mm256_add_ps(ap[r][0], bd[r][0]), _mm256_add_ps(ap[r][1], bd[r][1]));
    alignas(32) float l[8], u[8];
    _mm256_store_ps(l, lo);
    _mm256_store_ps(u, up);
    float ml = l[0], mu = u[0];
    for (int i = 1; i < 8; ++i) ml = l[i] > ml ? l[i] : ml, mu = u[i] > mu ? u[i] : mu;
    a.pmax_lo[(m0 + r) * P + p] = ml;
    a.pmax_up[(m0 + r) * P + p] = mu;
  }
}

void screen(const ScreenArgs& a, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = 0;
    for (; m + 2 <= a.M; m += 2) screen_tile<2>(a, m, p);
    if (m < a.M) screen_tile<1>(a, m, p);
  }
}
#elif QK_PART == 3
// The screen in plain C++ (the same sums and bounds, one column at a time).
void screen(const ScreenArgs& a, int64_t p0, int64_t p1) {
  const int64_t K = a.K, G = a.G, ng = K / G, P = a.N / 16;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t p = p0; p < p1; ++p) {
      float ml = 0, mu = 0;
      for (int c = 0; c < 16; ++c) {
        float ap = 0, bd = 0;
        for (int64_t g = 0; g < ng; ++g) {
          int32_t acc = 0;
          for (int64_t k = g * G; k < g * G + G; ++k) acc += int32_t{a.xq[m * K + k]} * a.w[(p * K + k) * 16 + c];
          const float sc = half_to_float(a.s[(p * ng + g) * 16 + c]);
          ap = std::fma(sc * a.dq[m * ng + g], static_cast<float>(acc), ap);
          bd = std::fma(std::fabs(sc), a.eb[m * ng + g], bd);
        }
        a.app[m * a.N + p * 16 + c] = ap;
        a.bnd[m * a.N + p * 16 + c] = bd;
        ml = c == 0 || ap - bd > ml ? ap - bd : ml;
        mu = c == 0 || ap + bd > mu ? ap + bd : mu;
      }
      a.pmax_lo[m * P + p] = ml;
      a.pmax_up[m * P + p] = mu;
    }
}
#endif

#if QK_PART == 1
// The largest of each row of y [M, nb] (row stride nb) into best[m] and its column col0 + j
// into at[m] where it beats best[m]: strictly larger only (the lowest column keeps a tie), NaN
// never.
void argmax_rows(const float* y, int64_t M, int64_t nb, int64_t col0, float* best, int32_t* at) {
  const __m256i step = _mm256_set1_epi32(8);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = y + m * nb;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    __m256i ix = _mm256_set1_epi32(-1), j = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t c = 0;
    for (; c + 8 <= nb; c += 8, j = _mm256_add_epi32(j, step)) {
      const __m256 v = _mm256_loadu_ps(row + c);
      const __m256 gt = _mm256_cmp_ps(v, mx, _CMP_GT_OQ);
      mx = _mm256_blendv_ps(mx, v, gt);
      ix = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ix), _mm256_castsi256_ps(j), gt));
    }
    alignas(32) float v[8];
    alignas(32) int32_t i[8];
    _mm256_store_ps(v, mx);
    _mm256_store_si256(reinterpret_cast<__m256i*>(i), ix);
    float b = -INFINITY;
    int32_t k = -1;
    for (int l = 0; l < 8; ++l)  // each lane holds its first maximum: the lowest column of equals
      if (i[l] >= 0 && (v[l] > b || (v[l] == b && i[l] < k))) b = v[l], k = i[l];
    for (; c < nb; ++c)
      if (row[c] > b) b = row[c], k = static_cast<int32_t>(c);
    if (k >= 0 && (at[m] < 0 || b > best[m])) best[m] = b, at[m] = static_cast<int32_t>(col0 + k);
  }
}
#elif QK_PART == 3
void argmax_rows(const float* y, int64_t M, int64_t nb, int64_t col0, float* best, int32_t* at) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < nb; ++c) {
      const float v = y[m * nb + c];
      if (!std::isnan(v) && (at[m] < 0 || v > best[m])) best[m] = v, at[m] = static_cast<int32_t>(col0 + c);
    }
}
#endif

}  // namespace

// Suffix h: float16 scales.
void QK_NAME(panels_i8)(const Args& a, int64_t p0, int64_t p1) { panels<kI8, float>(a, p0, p1); }
void QK_NAME(panels_i8h)(const Args& a, int64_t p0, int64_t p1) { panels<kI8, uint16_t>(a, p0, p1); }
void QK_NAME(panels_i5)(const Args& a, int64_t p0, int64_t p1) { panels<kI5, float>(a, p0, p1); }
void QK_NAME(panels_i5h)(const Args& a, int64_t p0, int64_t p1) { panels<kI5, uint16_t>(a, p0, p1); }
void QK_NAME(panels_i4)(const Args& a, int64_t p0, int64_t p1) { panels<kI4, float>(a, p0, p1); }
#if QK_PART != 2  // AVX-512 CPUs run the AVX2 screen and argmax
void QK_NAME(screen_i8h)(const ScreenArgs& a, int64_t p0, int64_t p1) { screen(a, p0, p1); }
void QK_NAME(argmax_rows)(const float* y, int64_t M, int64_t nb, int64_t col0, float* best, int32_t* at) {
  argmax_rows(y, M, nb, col0, best, at);
}
#endif
}  // namespace qk

#else  // QK_PART == 0: the FFI handlers

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "parallel.h"  // XLA's FFI as `ffi`, crossover::ParallelFor

namespace qk {
#define QK_DECLARE(isa)                                   \
  void panels_i8_##isa(const Args&, int64_t, int64_t);  \
  void panels_i8h_##isa(const Args&, int64_t, int64_t); \
  void panels_i5_##isa(const Args&, int64_t, int64_t);  \
  void panels_i5h_##isa(const Args&, int64_t, int64_t); \
  void panels_i4_##isa(const Args&, int64_t, int64_t);
QK_DECLARE(portable)
QK_DECLARE(avx2)
void screen_i8h_portable(const ScreenArgs&, int64_t, int64_t);
void screen_i8h_avx2(const ScreenArgs&, int64_t, int64_t);
using ArgmaxFn = void (*)(const float*, int64_t, int64_t, int64_t, float*, int32_t*);
void argmax_rows_portable(const float*, int64_t, int64_t, int64_t, float*, int32_t*);
void argmax_rows_avx2(const float*, int64_t, int64_t, int64_t, float*, int32_t*);
#ifndef QK_NO_AVX512
QK_DECLARE(avx512)
#endif

namespace {
// An ISA's kernels by [form][scales float16]; int4 takes float32 scales only.
using Table = PanelFn[3][2];
#define QK_TABLE(isa) \
  {{panels_i8_##isa, panels_i8h_##isa}, {panels_i5_##isa, panels_i5h_##isa}, {panels_i4_##isa, nullptr}}
const Table kPortable = QK_TABLE(portable), kAvx2 = QK_TABLE(avx2);
#ifndef QK_NO_AVX512
const Table kAvx512 = QK_TABLE(avx512);
#endif

// 0: none usable, 2: AVX2+FMA+F16C, 3: AVX-512 (F, BW, VL); 1: portable (only when asked for).
int Detect() {
#ifndef QK_NO_AVX512
  if (crossover::HasAvx512()) return 3;
#endif
  return crossover::HasAvx2Fma() && crossover::HasF16c() ? 2 : 0;
}
const int kBest = Detect();
std::atomic<int> g_isa{kBest};
std::atomic<int> g_threads{0};  // 0: the pool's size
std::atomic<int64_t> g_ahead{2048};  // Args::ahead of every call
std::atomic<int64_t> g_screened{0};  // rows the greedy screen has served

PanelFn Pick(Form form, bool half) {
  switch (g_isa.load(std::memory_order_relaxed)) {
#ifndef QK_NO_AVX512
    case 3: return kAvx512[form][half];
#endif
    case 2: return kAvx2[form][half];
    case 1: return kPortable[form][half];
    default: return nullptr;
  }
}

// The panels, split over XLA's intra-op pool (4 chunks a thread).
ffi::Error Matmul(ffi::ThreadPool& pool, const Args& a, Form form, bool half) {
  const PanelFn fn = Pick(form, half);
  if (fn == nullptr) return ffi::Error::Internal("crossover qmatmul: the CPU lacks AVX2+FMA+F16C");
  const int64_t panels = a.N / 16;
  if (a.M == 0 || panels == 0) return ffi::Error::Success();
  crossover::ParallelFor(pool, g_threads.load(std::memory_order_relaxed), a.M * a.K * a.N, panels, 4,
                         [a, fn](int64_t p0, int64_t p1) { fn(a, p0, p1); });
  return ffi::Error::Success();
}

using Dims = ffi::Span<const int64_t>;

bool Is(Dims d, int64_t d0, int64_t d1, int64_t d2) { return d.size() == 3 && d[0] == d0 && d[1] == d1 && d[2] == d2; }

ffi::Error Bad(const char* what) {
  return ffi::Error::InvalidArgument(std::string("crossover qmatmul: ") + what);
}

// x [M, K], y [M, N], values [P, K (int8) or K/2, 16], scales [P, K/G, 16] float32 (or float16
// for int8 and 5-bit), mins as scales (int4), high [P, K/8, 16] (5-bit); G even (5-bit: a
// multiple of 8).
ffi::Error Run(ffi::ThreadPool& pool, Form form, ffi::Buffer<ffi::F32> x, Dims wd, const void* w,
               ffi::AnyBuffer s, const ffi::Buffer<ffi::F32>* mn, const ffi::Buffer<ffi::U8>* high,
               ffi::ResultBuffer<ffi::F32> y) {
  const Dims xd = x.dimensions(), sd = s.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != 3 || sd.size() != 3)
    return Bad("x [M, K], values and scales [P, *, 16]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = N / 16, ng = sd[1];
  if (yd[0] != M || N % 16 || ng <= 0 || K % ng || (K / ng) % 2 || !Is(sd, P, ng, 16) ||
      !Is(wd, P, form == kI8 ? K : K / 2, 16))
    return Bad("operand shapes do not match");
  const bool half = s.element_type() == ffi::DataType::F16;
  if (!half && s.element_type() != ffi::DataType::F32) return Bad("scales must be float32 or float16");
  if (half && form == kI4) return Bad("4-bit weights take float32 scales");
  if (form == kI4 && !Is(mn->dimensions(), P, ng, 16)) return Bad("mins must match scales");
  if (form == kI5 && ((K / ng) % 8 || !Is(high->dimensions(), P, K / 8, 16)))
    return Bad("the high bits must be [P, K/8, 16], groups a multiple of 8");
  Args a{x.typed_data(), w, s.untyped_data(), form == kI4 ? mn->typed_data() : nullptr,
         form == kI5 ? high->typed_data() : nullptr, y->typed_data(), M, K, N, K / ng,
         g_ahead.load(std::memory_order_relaxed)};
  return Matmul(pool, a, form, half);
}

ffi::Error I8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::AnyBuffer s,
              ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, kI8, x, w.dimensions(), w.untyped_data(), s, nullptr, nullptr, y);
}

ffi::Error I5(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::AnyBuffer s,
              ffi::Buffer<ffi::U8> high, ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, kI5, x, w.dimensions(), w.untyped_data(), s, nullptr, &high, y);
}

ffi::Error I4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::AnyBuffer s,
              ffi::Buffer<ffi::F32> mn, ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, kI4, x, w.dimensions(), w.untyped_data(), s, &mn, nullptr, y);
}

// Column n's logit exactly as every kernel path computes it: each weight formed as s * q, then
// one fma a k into an accumulator that starts at zero, k in order.
float Exact(const float* x, const int8_t* w, const uint16_t* s, int64_t K, int64_t G, int64_t n) {
  const int64_t p = n / 16, c = n % 16, ng = K / G;
  float acc = 0.0f;
  for (int64_t g = 0; g < ng; ++g) {
    const float sc = half_to_float(s[(p * ng + g) * 16 + c]);
    for (int64_t k = g * G; k < g * G + G; ++k)
      acc = std::fma(x[k], sc * static_cast<float>(w[(p * K + k) * 16 + c]), acc);
  }
  return acc;
}

constexpr float kSlack = 2e-4f;  // of max |x| of a group: covers the float roundings (see below)

// Row x's int16 steps per group: dq = max |x| / 32767, xq = round(x / dq), and the bound
// coefficient eb = 128 G (max |x - xq dq| + kSlack max |x|) * 1.001, so that s eb bounds the
// group's share of a column's error (|q| <= 128). The exact logit sums K fma roundings, within
// K * 2^-24 * sum |x W| <= 3.9e-5 sum_g max|x_g| sum_k |W| for K = 640, and the screen's float
// sums are closer still; kSlack covers both, and the factor the bound's own roundings. False
// when x holds a value that is not finite.
bool Steps(const float* x, int64_t K, int64_t G, int16_t* xq, float* dq, float* eb) {
  for (int64_t g = 0; g < K / G; ++g) {
    float mx = 0.0f;
    for (int64_t k = g * G; k < g * G + G; ++k) {
      if (!std::isfinite(x[k])) return false;
      mx = std::fabs(x[k]) > mx ? std::fabs(x[k]) : mx;
    }
    const float d = mx / 32767.0f;
    double err = 0.0;
    for (int64_t k = g * G; k < g * G + G; ++k) {
      double q = d > 0.0f ? std::nearbyint(x[k] / d) : 0.0;
      q = q > 32767.0 ? 32767.0 : (q < -32767.0 ? -32767.0 : q);
      xq[k] = static_cast<int16_t>(q);
      err = std::fmax(err, std::fabs(static_cast<double>(x[k]) - q * static_cast<double>(d)));
    }
    dq[g] = d;
    eb[g] = static_cast<float>((err + kSlack * static_cast<double>(mx)) * 1.001 * 128.0 * static_cast<double>(G));
  }
  return true;
}

constexpr int64_t kScreenRows = 2;  // rows up to which Greedy screens (past them a panel's float
                                     // product, converted once, serves the rows for less)
constexpr int64_t kBlockPanels = 64;  // panels a block product computes at once: [M, 1024] floats

// Greedy for more than kScreenRows rows: the kernel's own product of kBlockPanels panels at a time
// into a scratch block that stays in cache, each block's row maxima kept, never the [M, N] logits.
void BlockArgmax(ffi::ThreadPool& pool, const Args& a, PanelFn fn, ArgmaxFn am, int32_t* out) {
  const int64_t M = a.M, K = a.K, ng = K / a.G, P = a.N / 16, blocks = (P + kBlockPanels - 1) / kBlockPanels;
  thread_local std::vector<float> best;
  thread_local std::vector<int32_t> at;
  best.assign(blocks * M, 0.0f), at.assign(blocks * M, -1);
  float* bv = best.data();
  int32_t* bi = at.data();
  crossover::ParallelFor(pool, g_threads.load(std::memory_order_relaxed), M * K * a.N, blocks, 4,
                         [a, fn, am, bv, bi, M, K, ng, P](int64_t b0, int64_t b1) {
    thread_local std::vector<float> y;
    y.resize(M * kBlockPanels * 16);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p0 = b * kBlockPanels, np = p0 + kBlockPanels <= P ? kBlockPanels : P - p0;
      Args sub = a;  // panels [p0, p0 + np) as a matrix of their own
      sub.w = static_cast<const int8_t*>(a.w) + p0 * K * 16;
      sub.s = static_cast<const uint16_t*>(a.s) + p0 * ng * 16;
      sub.y = y.data(), sub.N = np * 16;
      fn(sub, 0, np);
      am(y.data(), M, np * 16, p0 * 16, bv + b * M, bi + b * M);
    }
  });
  for (int64_t m = 0; m < M; ++m) {  // blocks in column order: the lowest id keeps a tie
    float v = 0.0f;
    int32_t t = -1;
    for (int64_t b = 0; b < blocks; ++b)
      if (bi[b * M + m] >= 0 && (t < 0 || bv[b * M + m] > v)) v = bv[b * M + m], t = bi[b * M + m];
    out[m] = t < 0 ? 0 : t;
  }
}

// tok [M]: each row's greedy token of x @ W, W int8 with float16 scales (the tied output table),
// lowest id on ties: the token a full product and an argmax give, bit for bit. Up to kScreenRows
// rows, the screen bounds every logit (ScreenArgs); only the columns whose upper bound reaches
// the largest lower bound can be the argmax, and those alone are computed exactly (a few of
// 262k). More rows, and a row the screen cannot bound (a value of x, or its best logit, not
// finite): BlockArgmax.
ffi::Error Greedy(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::AnyBuffer s,
                  ffi::ResultBuffer<ffi::S32> tok) {
  const Dims xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3) return Bad("x [M, K], values and scales [P, *, 16]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = P * 16, ng = sd[1];
  if (ng <= 0 || K % ng || (K / ng) % 2 || !Is(wd, P, K, 16) || !Is(sd, P, ng, 16) ||
      tok->dimensions().size() != 1 || tok->dimensions()[0] != M)
    return Bad("operand shapes do not match");
  if (s.element_type() != ffi::DataType::F16) return Bad("the greedy screen takes float16 scales");
  const int isa = g_isa.load(std::memory_order_relaxed);
  const ScreenFn fn = isa >= 2 ? screen_i8h_avx2 : (isa == 1 ? screen_i8h_portable : nullptr);
  if (fn == nullptr) return ffi::Error::Internal("crossover qgreedy: the CPU lacks AVX2+FMA+F16C");
  const int64_t G = K / ng;
  const ArgmaxFn am = isa >= 2 ? argmax_rows_avx2 : argmax_rows_portable;
  auto in_blocks = [&](const float* rows, int64_t n, int32_t* out) {
    const Args a{rows, w.untyped_data(), s.untyped_data(), nullptr, nullptr, nullptr, n, K, N, G,
                 g_ahead.load(std::memory_order_relaxed)};
    BlockArgmax(pool, a, Pick(kI8, true), am, out);
  };
  if (M > kScreenRows) {
    in_blocks(x.typed_data(), M, tok->typed_data());
    return ffi::Error::Success();
  }
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> dq, eb, app, bnd, lo, up;
  xq.resize(M * K), dq.resize(M * ng), eb.resize(M * ng), app.resize(M * N), bnd.resize(M * N);
  lo.resize(M * P), up.resize(M * P);
  const float* xs = x.typed_data();
  const auto* wv = static_cast<const int8_t*>(w.untyped_data());
  const auto* sv = static_cast<const uint16_t*>(s.untyped_data());
  std::vector<bool> finite(M);
  for (int64_t m = 0; m < M; ++m)
    finite[m] = Steps(xs + m * K, K, G, xq.data() + m * K, dq.data() + m * ng, eb.data() + m * ng);
  const ScreenArgs a{xq.data(), dq.data(), eb.data(), wv, sv, app.data(), bnd.data(),
                     lo.data(), up.data(), M, K, N, G, g_ahead.load(std::memory_order_relaxed)};
  if (M > 0)
    crossover::ParallelFor(pool, g_threads.load(std::memory_order_relaxed), M * K * N, P, 4,
                           [a, fn](int64_t p0, int64_t p1) { fn(a, p0, p1); });
  int32_t* out = tok->typed_data();
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xs + m * K;
    float best = 0.0f;
    int64_t at = -1;
    auto consider = [&](int64_t n) {
      const float v = Exact(xm, wv, sv, K, G, n);
      if (at < 0 || v > best) best = v, at = n;  // a NaN first leaves best NaN: BlockArgmax below
    };
    if (finite[m]) {
      float thr = lo[m * P];
      for (int64_t p = 1; p < P; ++p) thr = lo[m * P + p] > thr ? lo[m * P + p] : thr;
      for (int64_t p = 0; p < P && std::isfinite(thr); ++p) {
        if (up[m * P + p] < thr) continue;
        for (int64_t n = p * 16; n < p * 16 + 16; ++n)
          if (app[m * N + n] + bnd[m * N + n] >= thr) consider(n);
      }
    }
    if (at < 0 || !std::isfinite(best)) {
      in_blocks(xm, 1, out + m);
      continue;
    }
    g_screened.fetch_add(1, std::memory_order_relaxed);
    out[m] = static_cast<int32_t>(at);
  }
  return ffi::Error::Success();
}
}  // namespace
}  // namespace qk

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverQGreedyI8, qk::Greedy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverQMatmulI8, qk::I8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverQMatmulI5, qk::I5,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverQMatmulI4, qk::I4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ctypes controls: the ISA in use (0 none, 1 portable, 2 AVX2, 3 AVX-512), the best the CPU
// has, forcing another it runs (tests compare paths), a thread count (0: the pool's size) and
// the weight streams' prefetch distance in bytes (0: none; for benchmarks).
CROSSOVER_EXPORT int crossover_qk_isa() { return qk::g_isa.load(); }
CROSSOVER_EXPORT int crossover_qk_best_isa() { return qk::kBest; }
CROSSOVER_EXPORT int crossover_qk_set_isa(int isa) {
  if (isa != 1 && (isa > qk::kBest || (isa != 2 && isa != 3))) return -1;
  qk::g_isa.store(isa);
  return isa;
}
CROSSOVER_EXPORT void crossover_qk_set_threads(int n) { qk::g_threads.store(n); }
CROSSOVER_EXPORT int64_t crossover_qk_set_ahead(int64_t bytes) {
  return qk::g_ahead.exchange(bytes > 0 ? bytes : 0);
}
CROSSOVER_EXPORT int64_t crossover_qk_screened_rows() { return qk::g_screened.load(); }

#endif
