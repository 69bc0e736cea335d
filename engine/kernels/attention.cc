// One layer's attention over a ragged call's flat token axis (engine/model/ragged.py `attend`),
// reading the paged pool in place. For token t of row r = row[t] at position p = pos[t] (-1:
// padding, output zeros), each query head attends, with one softmax, over
//
//   - the row's cached keys: slots 0 .. min(cached[r], W * ps) - 1 of its table, below `ring` too (s at
//     page table[r, s / ps], offset s % ps); slot s holds position s in a global table (ring 0),
//     in a ring of `ring` slots the newest position <= cached[r] - 1 congruent to s mod ring;
//   - the step's own keys k, v of tokens u of the same row, at pos[u] >= 0;
//
// each visible when its position kp <= p and, with a window, p - kp < window. Scores are
// q . k * scale in float32; a running max over blocks of kBlock keys keeps exp in range.
//
// One source, compiled three times (engine/kernels/attention.py's Library): AT_PART=1 the
// AVX2+FMA code, AT_PART=2 a portable copy in plain C++ (the same loops, one 8-float struct a
// vector: CPUs without AVX2, and tests), AT_PART=0 the XLA FFI handler, which picks one by
// CPUID once and spreads (segment of a row's tokens, kv head) work items over XLA's intra-op
// thread pool.
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
  const int32_t* members;  // [N] tokens with pos >= 0 by row, ascending position within a row
  const int32_t* first;    // [S + 1] row r's tokens: members[first[r] .. first[r + 1])
  const int32_t* segs;     // [n_segs, 2] work segments: first member, tokens (<= kSegment, one row)
  float* out;              // [N, H, hd]
  int64_t N, H, KV, hd, W, ps;
  int64_t ring;    // ring slots of a sliding-window table; 0: global
  int64_t window;  // 0: none
  float scale;
};
using ItemFn = void (*)(const Args&, int64_t i0, int64_t i1);  // items [i0, i1): segment * KV + kv head
constexpr int kSegment = 8;  // tokens of one row that read each block of their keys together
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

struct Key {
  int64_t pos;
  const float* k;  // hd floats
  const float* v;
};

// Scores s[g][j] = q[g] . key[j] * scale of NQ queries against keys j in [0, nb), two keys at
// a time (2 * NQ independent accumulator chains).
template <int NQ>
inline void scores(const float* q, const Key* key, int nb, int64_t hd, float scale, float (*s)[kBlock]) {
  int j = 0;
  for (; j + 2 <= nb; j += 2) {
    F a0[NQ], a1[NQ];
    AT_UNROLL for (int g = 0; g < NQ; ++g) a0[g] = a1[g] = V::zero();
    const float *k0 = key[j].k, *k1 = key[j + 1].k;
    for (int64_t d = 0; d < hd; d += kLanes) {
      const F x0 = V::load(k0 + d), x1 = V::load(k1 + d);
      AT_UNROLL for (int g = 0; g < NQ; ++g) {
        const F qg = V::load(q + g * hd + d);
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
      const F x = V::load(key[j].k + d);
      AT_UNROLL for (int g = 0; g < NQ; ++g) a[g] = V::fma(V::load(q + g * hd + d), x, a[g]);
    }
    AT_UNROLL for (int g = 0; g < NQ; ++g) s[g][j] = V::sum(a[g]) * scale;
  }
}

// acc[g][d .. d + D * kLanes) = acc * fix[g] + sum_j p[g][j] value[j] for D vectors of lanes.
template <int NQ, int D>
inline void weigh(const Key* key, int nb, const float (*p)[kBlock], const float* fix, float* acc, int64_t hd,
                  int64_t d) {
  F o[NQ][D];
  AT_UNROLL for (int g = 0; g < NQ; ++g)
    AT_UNROLL for (int i = 0; i < D; ++i) o[g][i] = V::mul(V::load(acc + g * hd + d + i * kLanes), V::set1(fix[g]));
  for (int j = 0; j < nb; ++j) {
    F x[D];
    AT_UNROLL for (int i = 0; i < D; ++i) x[i] = V::load(key[j].v + d + i * kLanes);
    AT_UNROLL for (int g = 0; g < NQ; ++g) {
      const F pg = V::set1(p[g][j]);
      AT_UNROLL for (int i = 0; i < D; ++i) o[g][i] = V::fma(pg, x[i], o[g][i]);
    }
  }
  AT_UNROLL for (int g = 0; g < NQ; ++g)
    AT_UNROLL for (int i = 0; i < D; ++i) V::store(acc + g * hd + d + i * kLanes, o[g][i]);
}

// One running-softmax step of NQ queries q [NQ, hd] over keys [0, nb): their max m, sum l [NQ]
// and weighted values acc [NQ, hd] rescaled to the new max and added to.
template <int NQ>
void add(const float* q, float* m, float* l, float* acc, const Key* key, int nb, int64_t hd, float scale) {
  alignas(32) float s[NQ][kBlock];
  float fix[NQ];
  scores<NQ>(q, key, nb, hd, scale, s);
  for (int g = 0; g < NQ; ++g) {
    float mx = m[g];
    for (int j = 0; j < nb; ++j) mx = std::max(mx, s[g][j]);
    fix[g] = std::exp(m[g] - mx);  // 0 on the first step (m = -inf)
    m[g] = mx;
    for (int j = nb; j < (nb + kLanes - 1) / kLanes * kLanes; ++j) s[g][j] = mx;  // lanes past nb: unused
    for (int j = 0; j < nb; j += kLanes) V::store(s[g] + j, V::exp(V::sub(V::load(s[g] + j), V::set1(mx))));
    float sum = 0.0f;
    for (int j = 0; j < nb; ++j) sum += s[g][j];
    l[g] = l[g] * fix[g] + sum;
  }
  int64_t d = 0;
  for (; d + 2 * kLanes <= hd; d += 2 * kLanes) weigh<NQ, 2>(key, nb, s, fix, acc, hd, d);
  for (; d < hd; d += kLanes) weigh<NQ, 1>(key, nb, s, fix, acc, hd, d);
}

// All G query heads of one token over keys [0, nb): `add` up to kMaxQ heads at a time.
void add_heads(const float* q, float* m, float* l, float* acc, const Key* key, int nb, int64_t G, int64_t hd,
               float scale) {
  for (int64_t g = 0; g < G;) {
    const int64_t nq = G - g >= 4 ? 4 : G - g >= 2 ? 2 : 1;
    const int64_t o = g * hd;
    if (nq == 4) add<4>(q + o, m + g, l + g, acc + o, key, nb, hd, scale);
    else if (nq == 2) add<2>(q + o, m + g, l + g, acc + o, key, nb, hd, scale);
    else add<1>(q + o, m + g, l + g, acc + o, key, nb, hd, scale);
    g += nq;
  }
}

struct Scratch {
  std::vector<Key> keys;
  std::vector<float> m, l, acc;
};

// The keys a segment of row r's tokens may see, ascending by position: the cached slots holding
// positions in [lo, hi], then the row's own keys there (members in ascending position), merged
// where they interleave (never for the engine's rows, whose new tokens follow their cache).
void gather(const Args& a, int64_t r, int64_t h, int64_t lo, int64_t hi, std::vector<Key>& keys) {
  keys.clear();
  const int64_t c = a.cached[r], last = c - 1, hd = a.hd;
  const int64_t reach = a.ring ? std::min(a.ring, a.W * a.ps) : a.W * a.ps;
  const int32_t* pages = a.table + r * a.W;
  const auto slot = [&](int64_t s, int64_t kp) {
    if (kp < lo || kp > hi) return;
    const int64_t at = ((static_cast<int64_t>(pages[s / a.ps]) * a.ps + s % a.ps) * a.KV + h) * hd;
    keys.push_back({kp, a.pool_k + at, a.pool_v + at});
  };
  if (a.ring && c > a.ring) {  // wrapped: the oldest position's slot first
    for (int64_t i = 0, s0 = c % a.ring; i < a.ring; ++i) {
      const int64_t s = (s0 + i) % a.ring;
      if (s < reach) slot(s, last - (last - s) % a.ring);
    }
  } else {  // slot s holds position s
    for (int64_t s = 0; s < std::min(c, reach); ++s) slot(s, s);
  }
  const size_t n_cached = keys.size();
  for (int32_t i = a.first[r]; i < a.first[r + 1]; ++i) {
    const int64_t u = a.members[i], kp = a.pos[u];
    if (kp >= lo && kp <= hi) keys.push_back({kp, a.k + (u * a.KV + h) * hd, a.v + (u * a.KV + h) * hd});
  }
  if (n_cached > 0 && keys.size() > n_cached && keys[n_cached].pos < keys[n_cached - 1].pos)
    std::inplace_merge(keys.begin(), keys.begin() + n_cached, keys.end(),
                       [](const Key& x, const Key& y) { return x.pos < y.pos; });
}

// Work item i: segment i / KV (consecutive tokens of one row, ascending position), kv head
// i % KV, all its H / KV query heads. Each token sees the keys at positions [p - window + 1, p]
// (from 0 without a window), a range of the segment's sorted keys; the segment reads those keys
// kBlock at a time, each block once for all its tokens.
void item(const Args& a, int64_t i, Scratch& sc) {
  const int64_t seg = i / a.KV, h = i % a.KV, G = a.H / a.KV, hd = a.hd;
  const int32_t* toks = a.members + a.segs[2 * seg];
  const int64_t T = a.segs[2 * seg + 1], r = a.row[toks[0]];
  const auto low = [&](int64_t p) { return a.window > 0 ? std::max<int64_t>(p - a.window + 1, 0) : 0; };
  gather(a, r, h, low(a.pos[toks[0]]), a.pos[toks[T - 1]], sc.keys);
  const Key* keys = sc.keys.data();
  const int64_t n = static_cast<int64_t>(sc.keys.size());
  sc.m.assign(T * G, -INFINITY);
  sc.l.assign(T * G, 0.0f);
  sc.acc.assign(T * G * hd, 0.0f);
  int64_t from[kSegment], to[kSegment];
  const auto before = [](const Key& k, int64_t p) { return k.pos < p; };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = a.pos[toks[t]];
    from[t] = std::lower_bound(keys, keys + n, low(p), before) - keys;
    to[t] = std::lower_bound(keys, keys + n, p + 1, before) - keys;
  }
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = std::min<int64_t>(n, j0 + kBlock);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s0 = std::max(from[t], j0), s1 = std::min(to[t], j1);
      if (s0 >= s1) continue;
      add_heads(a.q + (toks[t] * a.H + h * G) * hd, &sc.m[t * G], &sc.l[t * G], &sc.acc[t * G * hd],
                keys + s0, static_cast<int>(s1 - s0), G, hd, a.scale);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    float* out = a.out + (toks[t] * a.H + h * G) * hd;
    for (int64_t g = 0; g < G; ++g) {
      const float* acc = &sc.acc[(t * G + g) * hd];
      const F div = V::set1(sc.l[t * G + g] > 0.0f ? sc.l[t * G + g] : 1.0f);
      for (int64_t d = 0; d < hd; d += kLanes) V::store(out + g * hd + d, V::div(V::load(acc + d), div));
    }
  }
}

}  // namespace

void AT_NAME(items)(const Args& a, int64_t i0, int64_t i1) {
  thread_local Scratch sc;
  for (int64_t i = i0; i < i1; ++i) item(a, i, sc);
}
}  // namespace at

#else  // AT_PART == 0: the FFI handler

#include <algorithm>
#include <atomic>
#include <vector>

#include "parallel.h"  // XLA's FFI as `ffi`, crossover::ParallelFor

namespace at {
void items_avx2(const Args&, int64_t, int64_t);
void items_portable(const Args&, int64_t, int64_t);

namespace {
// 1: portable, 2: AVX2+FMA.
const int kBest = crossover::HasAvx2Fma() ? 2 : 1;
std::atomic<int> g_isa{kBest};
std::atomic<int> g_threads{0};  // 0: the pool's size

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
  float* y = out->typed_data();
  for (int64_t t = 0; t < N; ++t) {
    if (ps_[t] < 0) {  // padding: zeros
      std::fill(y + t * H * hd, y + (t + 1) * H * hd, 0.0f);
      continue;
    }
    members[at[rows[t]]++] = static_cast<int32_t>(t);
    const int64_t r = rows[t];
    work += ((cs[r] < reach ? cs[r] : reach) + first[r + 1] - first[r]) * H * hd * 2;
  }
  std::vector<int32_t> segs;  // (first member, tokens) pairs, kSegment tokens of a row at most
  for (int64_t r = 0; r < S; ++r) {
    std::stable_sort(members.begin() + first[r], members.begin() + first[r + 1],
                     [&](int32_t x, int32_t u) { return ps_[x] < ps_[u]; });
    for (int32_t m = first[r]; m < first[r + 1]; m += kSegment) {
      segs.push_back(m);
      segs.push_back(first[r + 1] - m < kSegment ? first[r + 1] - m : kSegment);
    }
  }
  Args a{q.typed_data(), k.typed_data(), v.typed_data(), rows, ps_, cs, tab,
         pool_k.typed_data() + li * P * ps * KV * hd, pool_v.typed_data() + li * P * ps * KV * hd,
         members.data(), first.data(), segs.data(), y, N, H, KV, hd, W, ps, ring, window, scale};
  const ItemFn fn = g_isa.load(std::memory_order_relaxed) == 2 ? items_avx2 : items_portable;
  const int64_t items = static_cast<int64_t>(segs.size() / 2) * KV;
  if (items == 0) return ffi::Error::Success();
  // `a` points into this call's vectors: ParallelFor returns only once every item has run.
  crossover::ParallelFor(pool, g_threads.load(std::memory_order_relaxed), work, items, 8,
                         [a, fn](int64_t i0, int64_t i1) { fn(a, i0, i1); });
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
CROSSOVER_EXPORT int crossover_at_isa() { return at::g_isa.load(); }
CROSSOVER_EXPORT int crossover_at_best_isa() { return at::kBest; }
CROSSOVER_EXPORT int crossover_at_set_isa(int isa) {
  if (isa < 1 || isa > at::kBest) return -1;
  at::g_isa.store(isa);
  return isa;
}
CROSSOVER_EXPORT void crossover_at_set_threads(int n) { at::g_threads.store(n); }

#endif
