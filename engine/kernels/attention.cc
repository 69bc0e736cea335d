// One layer's attention over a ragged call's flat token axis (engine/model/ragged.py `attend`),
// reading the paged pool in place. For token t of row r = row[t] at position p = pos[t] (-1:
// padding, output zeros), each query head attends, with one softmax, over
//
//   - the row's cached keys: slots 0 .. min(cached[r], W * ps) - 1 of its page table (slot s at
//     page table[r, s / ps], offset s % ps); slot s holds position s in a global table (ring 0),
//     in a ring of `ring` slots the newest position <= cached[r] - 1 congruent to s mod ring;
//   - the step's own keys k, v of tokens u of the same row, at pos[u] >= 0;
//
// each visible when its position kp <= p and, with a window, p - kp < window. Scores are
// q . k * scale in float32; a running max over blocks of kBlock keys keeps exp in range.
//
// One source, compiled twice plus once (engine/kernels/attention.py's Library): AT_PART=1 the
// AVX2+FMA code, AT_PART=2 a portable copy in plain C++ (the same loops, one 8-float struct a
// vector: CPUs without AVX2, and tests), AT_PART=0 the XLA FFI handler, which picks one by
// CPUID once and spreads (token, kv head) work items over XLA's intra-op thread pool.
#include <cstddef>
#include <cstdint>

namespace at {
struct Args {
  const float* q;          // [N, H, hd]
  const float* k;          // [N, KV, hd] the step's own keys
  const float* v;          // [N, KV, hd]
  const int32_t* row;      // [N]
  const int32_t* pos;      // [N] (-1: padding)
  const int32_t* cached;   // [S] tokens of each row in the cache
  const int32_t* table;    // [S, W] page ids in slot order
  const float* pool_k;     // [P, ps, KV, hd] this layer's pages
  const float* pool_v;     // [P, ps, KV, hd]
  const int32_t* members;  // [N] tokens with pos >= 0, grouped by row
  const int32_t* first;    // [S + 1] row r's tokens: members[first[r] .. first[r + 1])
  float* out;              // [N, H, hd]
  int64_t N, H, KV, hd, W, ps;
  int64_t ring;    // ring slots of a sliding-window table; 0: global
  int64_t window;  // 0: none
  float scale;
};
using ItemFn = void (*)(const Args&, int64_t i0, int64_t i1);  // items [i0, i1): t * KV + kv head
}  // namespace at

#if AT_PART == 1 || AT_PART == 2
#include <algorithm>
#include <cmath>
#include <vector>
#if AT_PART == 1
#include <immintrin.h>
#endif

namespace at {
namespace {

#if AT_PART == 1
struct V {
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // e^x to about 1 ulp (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-7 polynomial
  // in r, times 2^n); 0 below about -87.3, where n = -127 makes 2^n's exponent bits 0.
  static F exp(F x) {
    x = _mm256_max_ps(_mm256_min_ps(x, set1(88.3762626647949f)), set1(-88.3762626647949f));
    F n = _mm256_floor_ps(fma(x, set1(1.44269504088896341f), set1(0.5f)));
    x = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), x);
    F y = set1(1.9875691500e-4f);
    y = fma(y, x, set1(1.3981999507e-3f));
    y = fma(y, x, set1(8.3334519073e-3f));
    y = fma(y, x, set1(4.1665795894e-2f));
    y = fma(y, x, set1(1.6666665459e-1f));
    y = fma(y, x, set1(5.0000001201e-1f));
    y = fma(y, mul(x, x), _mm256_add_ps(x, set1(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return mul(y, _mm256_castsi256_ps(e));
  }
};
#define AT_NAME(x) x##_avx2
#else
struct V {  // the AVX2 code's vectors as 8 floats, with libm's exp
  struct F {
    float v[8];
  };
  static F zero() { return F{}; }
  static F load(const float* p) { F r; for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
  static F set1(float x) { F r; for (int i = 0; i < 8; ++i) r.v[i] = x; return r; }
  static F fma(F a, F b, F c) { for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
  static F mul(F a, F b) { for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i]; return a; }
  static F sub(F a, F b) { for (int i = 0; i < 8; ++i) a.v[i] -= b.v[i]; return a; }
  static F div(F a, F b) { for (int i = 0; i < 8; ++i) a.v[i] /= b.v[i]; return a; }
  static void store(float* p, F v) { for (int i = 0; i < 8; ++i) p[i] = v.v[i]; }
  static float sum(F v) {
    float s = 0;
    for (int i = 0; i < 8; ++i) s += v.v[i];
    return s;
  }
  static F exp(F x) { for (int i = 0; i < 8; ++i) x.v[i] = std::exp(x.v[i]); return x; }
};
#define AT_NAME(x) x##_portable
#endif

using F = V::F;
constexpr int kLanes = 8;
constexpr int kBlock = 64;  // keys per running-softmax step
constexpr int kMaxQ = 4;    // query heads attended together (sharing each key's loads)

#define AT_UNROLL _Pragma("GCC unroll 8")

// Scores s[g][j] = q[g] . key[j] * scale of NQ queries against keys j in [0, nb), two keys at
// a time (2 * NQ independent accumulator chains).
template <int NQ>
inline void scores(const float* const* q, const float* const* key, int nb, int64_t hd, float scale,
                   float (*s)[kBlock]) {
  int j = 0;
  for (; j + 2 <= nb; j += 2) {
    F a0[NQ], a1[NQ];
    AT_UNROLL for (int g = 0; g < NQ; ++g) a0[g] = a1[g] = V::zero();
    const float *k0 = key[j], *k1 = key[j + 1];
    for (int64_t d = 0; d < hd; d += kLanes) {
      const F x0 = V::load(k0 + d), x1 = V::load(k1 + d);
      AT_UNROLL for (int g = 0; g < NQ; ++g) {
        const F qg = V::load(q[g] + d);
        a0[g] = V::fma(qg, x0, a0[g]);
        a1[g] = V::fma(qg, x1, a1[g]);
      }
    }
    AT_UNROLL for (int g = 0; g < NQ; ++g) {
      s[g][j] = V::sum(a0[g]) * scale;
      s[g][j + 1] = V::sum(a1[g]) * scale;
    }
  }
  if (j < nb) {
    F a[NQ];
    AT_UNROLL for (int g = 0; g < NQ; ++g) a[g] = V::zero();
    for (int64_t d = 0; d < hd; d += kLanes) {
      const F x = V::load(key[j] + d);
      AT_UNROLL for (int g = 0; g < NQ; ++g) a[g] = V::fma(V::load(q[g] + d), x, a[g]);
    }
    AT_UNROLL for (int g = 0; g < NQ; ++g) s[g][j] = V::sum(a[g]) * scale;
  }
}

// acc[g][d .. d + D * kLanes) = acc * fix[g] + sum_j p[g][j] value[j] for D vectors of lanes.
template <int NQ, int D>
inline void weigh(const float* const* value, int nb, const float (*p)[kBlock], const float* fix, float* acc,
                  int64_t hd, int64_t d) {
  F o[NQ][D];
  AT_UNROLL for (int g = 0; g < NQ; ++g)
    AT_UNROLL for (int i = 0; i < D; ++i) o[g][i] = V::mul(V::load(acc + g * hd + d + i * kLanes), V::set1(fix[g]));
  for (int j = 0; j < nb; ++j) {
    F x[D];
    AT_UNROLL for (int i = 0; i < D; ++i) x[i] = V::load(value[j] + d + i * kLanes);
    AT_UNROLL for (int g = 0; g < NQ; ++g) {
      const F pg = V::set1(p[g][j]);
      AT_UNROLL for (int i = 0; i < D; ++i) o[g][i] = V::fma(pg, x[i], o[g][i]);
    }
  }
  AT_UNROLL for (int g = 0; g < NQ; ++g)
    AT_UNROLL for (int i = 0; i < D; ++i) V::store(acc + g * hd + d + i * kLanes, o[g][i]);
}

// out[g] = softmax over the n keys of q[g] . key * scale, weighting the values (n = 0: zeros).
// acc: [NQ, hd] scratch.
template <int NQ>
void attend(const float* const* q, float* const* out, const float* const* key, const float* const* value,
            int64_t n, int64_t hd, float scale, float* acc) {
  float m[NQ], l[NQ], fix[NQ];
  alignas(32) float s[NQ][kBlock];
  for (int g = 0; g < NQ; ++g) m[g] = -INFINITY, l[g] = 0.0f;
  std::fill(acc, acc + NQ * hd, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, n - j0));
    scores<NQ>(q, key + j0, nb, hd, scale, s);
    for (int g = 0; g < NQ; ++g) {
      float mx = m[g];
      for (int j = 0; j < nb; ++j) mx = std::max(mx, s[g][j]);
      fix[g] = std::exp(m[g] - mx);  // 0 on the first block (m = -inf)
      m[g] = mx;
      for (int j = nb; j < (nb + kLanes - 1) / kLanes * kLanes; ++j) s[g][j] = mx;  // unused lanes
      for (int j = 0; j < nb; j += kLanes) V::store(s[g] + j, V::exp(V::sub(V::load(s[g] + j), V::set1(mx))));
      float sum = 0.0f;
      for (int j = 0; j < nb; ++j) sum += s[g][j];
      l[g] = l[g] * fix[g] + sum;
    }
    int64_t d = 0;
    for (; d + 2 * kLanes <= hd; d += 2 * kLanes) weigh<NQ, 2>(value + j0, nb, s, fix, acc, hd, d);
    for (; d < hd; d += kLanes) weigh<NQ, 1>(value + j0, nb, s, fix, acc, hd, d);
  }
  for (int g = 0; g < NQ; ++g) {
    const F div = V::set1(l[g] > 0.0f ? l[g] : 1.0f);
    for (int64_t d = 0; d < hd; d += kLanes) V::store(out[g] + d, V::div(V::load(acc + g * hd + d), div));
  }
}

// Work item i: token t = i / KV, kv head h = i % KV, all its H / KV query heads.
void item(const Args& a, int64_t i, std::vector<const float*>& key, std::vector<const float*>& value,
          std::vector<float>& acc) {
  const int64_t t = i / a.KV, h = i % a.KV, G = a.H / a.KV, hd = a.hd;
  const float* q = a.q + (t * a.H + h * G) * hd;
  float* out = a.out + (t * a.H + h * G) * hd;
  const int64_t p = a.pos[t];
  if (p < 0) {
    std::fill(out, out + G * hd, 0.0f);
    return;
  }
  const auto visible = [&](int64_t kp) { return kp >= 0 && kp <= p && (a.window <= 0 || p - kp < a.window); };
  const int64_t r = a.row[t], c = a.cached[r], last = c - 1;
  const int64_t reach = a.ring ? std::min(a.ring, a.W * a.ps) : a.W * a.ps;
  const int64_t n_read = std::min(c, reach);
  key.clear();
  value.clear();
  const int32_t* pages = a.table + r * a.W;
  for (int64_t s = 0; s < n_read; ++s) {  // s <= last, so (last - s) mod ring is last - s mod ring
    const int64_t kp = a.ring ? last - (last - s) % a.ring : s;
    if (!visible(kp)) continue;
    const int64_t at = ((static_cast<int64_t>(pages[s / a.ps]) * a.ps + s % a.ps) * a.KV + h) * hd;
    key.push_back(a.pool_k + at);
    value.push_back(a.pool_v + at);
  }
  for (int32_t m = a.first[r]; m < a.first[r + 1]; ++m) {
    const int64_t u = a.members[m];
    if (!visible(a.pos[u])) continue;
    key.push_back(a.k + (u * a.KV + h) * hd);
    value.push_back(a.v + (u * a.KV + h) * hd);
  }
  if (acc.size() < static_cast<size_t>(kMaxQ * hd)) acc.resize(kMaxQ * hd);
  const int64_t n = static_cast<int64_t>(key.size());
  for (int64_t g = 0; g < G;) {  // the group's heads, up to kMaxQ at a time
    const float* qs[kMaxQ];
    float* os[kMaxQ];
    const int64_t nq = G - g >= 4 ? 4 : G - g >= 2 ? 2 : 1;
    for (int64_t j = 0; j < nq; ++j) qs[j] = q + (g + j) * hd, os[j] = out + (g + j) * hd;
    if (nq == 4) attend<4>(qs, os, key.data(), value.data(), n, hd, a.scale, acc.data());
    else if (nq == 2) attend<2>(qs, os, key.data(), value.data(), n, hd, a.scale, acc.data());
    else attend<1>(qs, os, key.data(), value.data(), n, hd, a.scale, acc.data());
    g += nq;
  }
}

}  // namespace

void AT_NAME(items)(const Args& a, int64_t i0, int64_t i1) {
  thread_local std::vector<const float*> key, value;
  thread_local std::vector<float> acc;
  for (int64_t i = i0; i < i1; ++i) item(a, i, key, value, acc);
}
}  // namespace at

#else  // AT_PART == 0: the FFI handler

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#define AT_EXPORT __attribute__((visibility("default")))

namespace at {
void items_avx2(const Args&, int64_t, int64_t);
void items_portable(const Args&, int64_t, int64_t);

namespace {
// 1: portable, 2: AVX2+FMA.
int Detect() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 1;
}
const int kBest = Detect();
std::atomic<int> g_isa{kBest};
std::atomic<int> g_threads{0};  // 0: the pool's size

// Items go out in chunks from one counter. The caller works too and only waits for chunks a
// pool thread has claimed, so a pool that never runs the tasks costs speed, never a deadlock.
struct Work {
  Args a;
  ItemFn fn;
  int64_t chunk, n_chunks, items;
  std::atomic<int64_t> next{0}, done{0};
  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < n_chunks;) {
      const int64_t i0 = c * chunk, i1 = i0 + chunk < items ? i0 + chunk : items;
      fn(a, i0, i1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t kMinWorkPerThread = 1 << 18;  // multiply-adds below which one thread does it

template <typename A, typename B>
bool Same(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> pos,
                  ffi::Buffer<ffi::S32> cached, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::F32> pool_k,
                  ffi::Buffer<ffi::F32> pool_v, ffi::Buffer<ffi::S32> layer, float scale, int64_t window,
                  int64_t ring, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = pool_k.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 5 || td.size() != 2 || cached.dimensions().size() != 1 ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument("crossover attention: operand ranks do not match");
  const int64_t N = qd[0], H = qd[1], hd = qd[2], KV = kd[1], S = td[0], W = td[1];
  const int64_t L = pd[0], P = pd[1], ps = pd[2];
  const auto count = [](const ffi::Buffer<ffi::S32>& b) { return static_cast<int64_t>(b.element_count()); };
  if (kd[0] != N || kd[2] != hd || !Same(v.dimensions(), kd) || count(row) != N || count(pos) != N ||
      count(cached) != S || !Same(pool_v.dimensions(), pd) || pd[3] != KV ||
      pd[4] != hd || !Same(out->dimensions(), qd) || KV <= 0 || H % KV || hd % 8 || ps <= 0 || S <= 0 || ring < 0)
    return ffi::Error::InvalidArgument("crossover attention: operand shapes do not match");
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("crossover attention: layer out of range");
  const int32_t* rows = row.typed_data();
  const int32_t* ps_ = pos.typed_data();
  const int32_t* cs = cached.typed_data();
  const int32_t* tab = table.typed_data();
  const int64_t reach = ring ? (ring < W * ps ? ring : W * ps) : W * ps;
  for (int64_t r = 0; r < S; ++r) {  // the pages each row reads exist
    if (cs[r] < 0) return ffi::Error::InvalidArgument("crossover attention: negative cached count");
    const int64_t n_read = cs[r] < reach ? cs[r] : reach;
    for (int64_t j = 0; j < (n_read + ps - 1) / ps; ++j)
      if (tab[r * W + j] < 0 || tab[r * W + j] >= P)
        return ffi::Error::InvalidArgument("crossover attention: page id out of range");
  }
  // Each row's tokens, for its queries' own keys; and the multiply-adds, to size the threads.
  std::vector<int32_t> first(S + 1, 0), members(N > 0 ? N : 1);
  for (int64_t t = 0; t < N; ++t) {
    if (ps_[t] < 0) continue;
    if (rows[t] < 0 || rows[t] >= S) return ffi::Error::InvalidArgument("crossover attention: row out of range");
    ++first[rows[t] + 1];
  }
  for (int64_t r = 0; r < S; ++r) first[r + 1] += first[r];
  std::vector<int32_t> at(first.begin(), first.end() - 1);
  int64_t work = 0;
  for (int64_t t = 0; t < N; ++t) {
    if (ps_[t] < 0) continue;
    members[at[rows[t]]++] = static_cast<int32_t>(t);
    const int64_t r = rows[t];
    work += ((cs[r] < reach ? cs[r] : reach) + first[r + 1] - first[r]) * H * hd * 2;
  }
  Args a{q.typed_data(), k.typed_data(), v.typed_data(), rows, ps_, cs, tab,
         pool_k.typed_data() + li * P * ps * KV * hd, pool_v.typed_data() + li * P * ps * KV * hd,
         members.data(), first.data(), out->typed_data(), N, H, KV, hd, W, ps, ring, window, scale};
  const ItemFn fn = g_isa.load(std::memory_order_relaxed) == 2 ? items_avx2 : items_portable;
  const int64_t items = N * KV;
  if (items == 0) return ffi::Error::Success();
  int64_t threads = g_threads.load(std::memory_order_relaxed);
  if (threads <= 0) threads = pool.num_threads() > 0 ? pool.num_threads() : 1;
  if (threads > work / kMinWorkPerThread) threads = work / kMinWorkPerThread > 1 ? work / kMinWorkPerThread : 1;
  if (threads > items) threads = items;
  if (threads <= 1) {
    fn(a, 0, items);
    return ffi::Error::Success();
  }
  auto w = std::make_shared<Work>();  // the arrays `a` points to outlive the wait below
  w->a = a;
  w->fn = fn;
  w->items = items;
  w->n_chunks = threads * 8 < items ? threads * 8 : items;
  w->chunk = (items + w->n_chunks - 1) / w->n_chunks;
  w->n_chunks = (items + w->chunk - 1) / w->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([w] { w->Run(); });
  w->Run();
  while (w->done.load(std::memory_order_acquire) < w->n_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}
}  // namespace
}  // namespace at

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossoverRaggedAttention, at::Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cached
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("ring")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ctypes controls: the ISA in use (1 portable, 2 AVX2), the best the CPU has, forcing another it
// runs (tests compare them), and a thread count (0: the pool's size).
extern "C" AT_EXPORT int crossover_at_isa() { return at::g_isa.load(); }
extern "C" AT_EXPORT int crossover_at_best_isa() { return at::kBest; }
extern "C" AT_EXPORT int crossover_at_set_isa(int isa) {
  if (isa < 1 || isa > at::kBest) return -1;
  at::g_isa.store(isa);
  return isa;
}
extern "C" AT_EXPORT void crossover_at_set_threads(int n) { at::g_threads.store(n); }

#endif
