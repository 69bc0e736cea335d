// y [M, N] = x [M, K] @ W [K, N] for a group-quantized W (engine/quant/formats.py has the layout),
// converting each weight to float32 in registers: no float copy of W is ever written.
//
//   int8: W[k, n] = s[g, n] * q[k, n]            values int8  [P, K, 16]
//   int4: W[k, n] = s[g, n] * q[k, n] - m[g, n]   values uint8 [P, K/2, 16] (row 2i low nibble)
//   scales, mins float32 [P, K/G, 16]; P = N / 16 panels; g = k / G.
//
// Each weight is formed exactly as gguf's dequantize forms it (one rounding per multiply and
// per subtraction; built with -ffp-contract=off), then multiplied into float32 accumulators.
//
// One source, compiled four times (engine/quant/build.py): QK_PART=1 the AVX2+FMA kernels,
// QK_PART=2 the AVX-512 kernels, QK_PART=3 a portable scalar copy of the AVX-512 kernels (the
// same tiling, one 16-lane vector a panel: tests check that tiling on CPUs without AVX-512; never
// chosen by default), QK_PART=0 the XLA FFI handlers, which pick a kernel by CPUID once and
// split the panels over XLA's intra-op thread pool.
#include <cstddef>
#include <cstdint>

namespace qk {
struct Args {
  const float* x;   // [M, K]
  const void* w;    // values
  const float* s;   // scales
  const float* mn;  // mins (int4) or null
  float* y;         // [M, N]
  int64_t M, K, N, G;
};
using PanelFn = void (*)(const Args&, int64_t p0, int64_t p1);  // panels [p0, p1)
}  // namespace qk

#if QK_PART == 1 || QK_PART == 2 || QK_PART == 3
#include <cmath>
#include <immintrin.h>

#include <vector>

namespace qk {
namespace {

#if QK_PART == 1
struct V {  // AVX2: a panel of 16 columns is two 8-float vectors
  using F = __m256;
  static constexpr int kPer = 2;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void i8(const int8_t* p, F* out) {  // 16 int8 -> 2 x 8 floats
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
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
  static F bcast(const float* p) { F r; for (int i = 0; i < 16; ++i) r.v[i] = *p; return r; }
  static F fma(F a, F b, F c) { for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
  static F mul(F a, F b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
  static F sub(F a, F b) { for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i]; return a; }
  static void store(float* p, F v) { for (int i = 0; i < 16; ++i) p[i] = v.v[i]; }
  static void i8(const int8_t* p, F* out) { for (int i = 0; i < 16; ++i) out[0].v[i] = p[i]; }
  static void u4(const uint8_t* p, F* lo, F* hi) {
    for (int i = 0; i < 16; ++i) lo[0].v[i] = p[i] & 15, hi[0].v[i] = p[i] >> 4;
  }
};
#define QK_NAME(x) x##_portable
constexpr int kRows = 12;
constexpr int kDirectRows = 8;
constexpr int kWide = 4;
#endif

// Fully unrolled register loops: without it GCC keeps the accumulator arrays in memory too
// and stores them on every k (half the FMA rate).
#define QK_UNROLL _Pragma("GCC unroll 32")

using F = V::F;
constexpr int kPer = V::kPer;

// One tile: rows [m0, m0 + R) of y, panels [p, p + W). Weights of one k are converted once and
// used by all R rows.
template <int R, int W, bool kInt4>
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
        sc[j * kPer + v] = V::load(a.s + off);
        if (kInt4) mn[j * kPer + v] = V::load(a.mn + off);
      }
    const int64_t k0 = g * G;
    if (!kInt4) {
      for (int64_t k = k0; k < k0 + G; ++k) {
        F w[NV];
        QK_UNROLL for (int j = 0; j < W; ++j) V::i8(static_cast<const int8_t*>(a.w) + ((p + j) * K + k) * 16, w + j * kPer);
        QK_UNROLL for (int v = 0; v < NV; ++v) w[v] = V::mul(w[v], sc[v]);
        QK_UNROLL for (int r = 0; r < R; ++r) {
          F xb = V::bcast(x + r * K + k);
          QK_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(xb, w[v], acc[r][v]);
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + G; k += 2) {
        F lo[NV], hi[NV];
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
    }
  }
  QK_UNROLL for (int r = 0; r < R; ++r)
    QK_UNROLL for (int v = 0; v < NV; ++v) V::store(a.y + (m0 + r) * a.N + p * 16 + v * (16 / kPer), acc[r][v]);
}

// Panel p's weights as float32, buf [K][16]: the same values `tile` forms in registers.
template <bool kInt4>
inline void unpack(const Args& a, int64_t p, float* buf) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  for (int64_t g = 0; g < ng; ++g) {
    F sc[kPer], mn[kPer];
    QK_UNROLL for (int v = 0; v < kPer; ++v) {
      sc[v] = V::load(a.s + (p * ng + g) * 16 + v * (16 / kPer));
      if (kInt4) mn[v] = V::load(a.mn + (p * ng + g) * 16 + v * (16 / kPer));
    }
    for (int64_t k = g * G; k < g * G + G; k += 2) {
      F w0[kPer], w1[kPer];
      if (kInt4) {
        V::u4(static_cast<const uint8_t*>(a.w) + (p * (K / 2) + k / 2) * 16, w0, w1);
      } else {
        V::i8(static_cast<const int8_t*>(a.w) + (p * K + k) * 16, w0);
        V::i8(static_cast<const int8_t*>(a.w) + (p * K + k + 1) * 16, w1);
      }
      QK_UNROLL for (int v = 0; v < kPer; ++v) {
        w0[v] = V::mul(w0[v], sc[v]);
        w1[v] = V::mul(w1[v], sc[v]);
        if (kInt4) {
          w0[v] = V::sub(w0[v], mn[v]);
          w1[v] = V::sub(w1[v], mn[v]);
        }
        V::store(buf + k * 16 + v * (16 / kPer), w0[v]);
        V::store(buf + (k + 1) * 16 + v * (16 / kPer), w1[v]);
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

template <int R, bool kInt4>
inline void rest_direct(const Args& a, int64_t p) {
  if constexpr (R > 0) {
    if (a.M == R) return tile<R, 1, kInt4>(a, 0, p);
    rest_direct<R - 1, kInt4>(a, p);
  }
}

template <bool kInt4>
void panels(const Args& a, int64_t p0, int64_t p1) {
  if (a.M == 1) {  // decode: several panels at once for independent accumulator chains
    int64_t p = p0;
    for (; p + kWide <= p1; p += kWide) tile<1, kWide, kInt4>(a, 0, p);
    for (; p < p1; ++p) tile<1, 1, kInt4>(a, 0, p);
    return;
  }
  if (a.M <= kDirectRows) {  // few rows: convert in registers, once per row tile
    for (int64_t p = p0; p < p1; ++p) rest_direct<kDirectRows, kInt4>(a, p);
    return;
  }
  // More rows: unpack each panel once into a float buffer that stays in cache, then a plain
  // float32 tile of kRows rows at a time sweeps it.
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(a.K) * 16) buf.resize(a.K * 16);
  for (int64_t p = p0; p < p1; ++p) {
    unpack<kInt4>(a, p, buf.data());
    int64_t m = 0;
    for (; m + kRows <= a.M; m += kRows) tile_f32<kRows>(a, m, p, buf.data());
    if (m < a.M) rest_f32<kRows - 1>(a, m, p, buf.data());
  }
}

}  // namespace

void QK_NAME(panels_i8)(const Args& a, int64_t p0, int64_t p1) { panels<false>(a, p0, p1); }
void QK_NAME(panels_i4)(const Args& a, int64_t p0, int64_t p1) { panels<true>(a, p0, p1); }
}  // namespace qk

#else  // QK_PART == 0: the FFI handlers

#include <atomic>

#include "parallel.h"  // XLA's FFI as `ffi`, crossover::ParallelFor

namespace qk {
void panels_i8_portable(const Args&, int64_t, int64_t);
void panels_i4_portable(const Args&, int64_t, int64_t);
void panels_i8_avx2(const Args&, int64_t, int64_t);
void panels_i4_avx2(const Args&, int64_t, int64_t);
#ifndef QK_NO_AVX512
void panels_i8_avx512(const Args&, int64_t, int64_t);
void panels_i4_avx512(const Args&, int64_t, int64_t);
#endif

namespace {
// 0: none usable, 2: AVX2+FMA, 3: AVX-512 (F, BW, VL); 1: portable (only when asked for).
int Detect() {
#ifndef QK_NO_AVX512
  if (crossover::HasAvx512()) return 3;
#endif
  return crossover::HasAvx2Fma() ? 2 : 0;
}
const int kBest = Detect();
std::atomic<int> g_isa{kBest};
std::atomic<int> g_threads{0};  // 0: the pool's size

PanelFn Pick(bool int4) {
  switch (g_isa.load(std::memory_order_relaxed)) {
#ifndef QK_NO_AVX512
    case 3: return int4 ? panels_i4_avx512 : panels_i8_avx512;
#endif
    case 2: return int4 ? panels_i4_avx2 : panels_i8_avx2;
    case 1: return int4 ? panels_i4_portable : panels_i8_portable;
    default: return nullptr;
  }
}

// The panels, split over XLA's intra-op pool (4 chunks a thread).
ffi::Error Matmul(ffi::ThreadPool& pool, const Args& a, bool int4) {
  const PanelFn fn = Pick(int4);
  if (fn == nullptr) return ffi::Error::Internal("crossover qmatmul: the CPU lacks AVX2+FMA");
  const int64_t panels = a.N / 16;
  if (a.M == 0 || panels == 0) return ffi::Error::Success();
  crossover::ParallelFor(pool, g_threads.load(std::memory_order_relaxed), a.M * a.K * a.N, panels, 4,
                         [a, fn](int64_t p0, int64_t p1) { fn(a, p0, p1); });
  return ffi::Error::Success();
}

ffi::Error Check(int64_t M, int64_t K, int64_t N, int64_t rows, int64_t P, int64_t vk, int64_t ng,
                 int64_t sp, int64_t sl, int64_t wl, bool int4) {
  if (N % 16 || P != N / 16 || sp != P || sl != 16 || wl != 16 || ng <= 0 || K % ng ||
      vk != (int4 ? K / 2 : K) || rows != M || (K / ng) % 2)
    return ffi::Error::InvalidArgument("crossover qmatmul: operand shapes do not match");
  return ffi::Error::Success();
}

template <bool kInt4, typename WBuf>
ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, WBuf w, ffi::Buffer<ffi::F32> s,
                const float* mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("crossover qmatmul: x [M, K], values and scales [P, *, 16]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (ffi::Error e = Check(M, K, N, yd[0], wd[0], wd[1], sd[1], sd[0], sd[2], wd[2], kInt4); e.failure())
    return e;
  Args a{x.typed_data(), w.untyped_data(), s.typed_data(), mins, y->typed_data(), M, K, N, K / sd[1]};
  return Matmul(pool, a, kInt4);
}

ffi::Error I8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> s,
              ffi::ResultBuffer<ffi::F32> y) {
  return Impl<false>(pool, x, w, s, nullptr, y);
}

ffi::Error I4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> s,
              ffi::Buffer<ffi::F32> mn, ffi::ResultBuffer<ffi::F32> y) {
  if (mn.dimensions().size() != 3 || mn.element_count() != s.element_count())
    return ffi::Error::InvalidArgument("crossover qmatmul: mins must match scales");
  return Impl<true>(pool, x, w, s, mn.typed_data(), y);
}
}  // namespace
}  // namespace qk

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverQMatmulI8, qk::I8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverQMatmulI4, qk::I4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ctypes controls: the ISA in use (0 none, 1 portable, 2 AVX2, 3 AVX-512), the best the CPU
// has, forcing another it runs (tests compare paths), and a thread count (0: the pool's size).
CROSSOVER_EXPORT int crossover_qk_isa() { return qk::g_isa.load(); }
CROSSOVER_EXPORT int crossover_qk_best_isa() { return qk::kBest; }
CROSSOVER_EXPORT int crossover_qk_set_isa(int isa) {
  if (isa != 1 && (isa > qk::kBest || (isa != 2 && isa != 3))) return -1;
  qk::g_isa.store(isa);
  return isa;
}
CROSSOVER_EXPORT void crossover_qk_set_threads(int n) { qk::g_threads.store(n); }

#endif
