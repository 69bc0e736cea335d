// What the kernels' XLA FFI handler parts share (engine/quant/kernel.cc, engine/kernels/attention.cc,
// each with PART=0): CPUID checks for the instruction-set parts they choose between, splitting
// one call's work items over XLA's intra-op thread pool, and the export of ctypes controls.
// engine/kernels/build.py puts this folder on the include path and hashes its headers into each
// library's cache key, so a change here rebuilds both libraries.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;  // as the handlers name it

// The ctypes controls each library exports (the rest of it stays hidden).
#define CROSSOVER_EXPORT extern "C" __attribute__((visibility("default")))

namespace crossover {

// __builtin_cpu_init first: these run from static initializers, which may precede libgcc's own.
inline bool HasAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline bool HasF16c() {  // float16 <-> float32 conversions of 128/256-bit vectors
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
}

inline bool HasAvx512() {  // F, BW and VL
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

constexpr int64_t kMinWorkPerThread = 1 << 18;  // multiply-adds below which one thread does it

// Items go out in chunks from one counter. The caller works too and only waits for chunks a
// pool thread has claimed, so a pool that never runs the tasks costs speed, never a deadlock.
// Held by a shared_ptr: a task the pool starts after the wait ends still reads the counter.
template <typename Body>
struct Work {
  Body body;  // body(i0, i1): items [i0, i1)
  int64_t chunk, n_chunks, items;
  std::atomic<int64_t> next{0}, done{0};
  Work(Body b, int64_t chunk_, int64_t n_chunks_, int64_t items_)
      : body(std::move(b)), chunk(chunk_), n_chunks(n_chunks_), items(items_) {}
  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < n_chunks;) {
      const int64_t i0 = c * chunk, i1 = i0 + chunk < items ? i0 + chunk : items;
      body(i0, i1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// body(i0, i1) over items [0, items), returning when all have run. threads: the count asked for
// (<= 0: the pool's size), cut to one per kMinWorkPerThread of `work` (multiply-adds) and to one
// per item; a single thread runs body(0, items) itself. Otherwise about chunks_per_thread
// chunks a thread, so that threads finishing early take more.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t threads, int64_t work, int64_t items,
                 int64_t chunks_per_thread, Body body) {
  if (threads <= 0) threads = pool.num_threads() > 0 ? pool.num_threads() : 1;
  const int64_t most = work / kMinWorkPerThread > 1 ? work / kMinWorkPerThread : 1;
  if (threads > most) threads = most;
  if (threads > items) threads = items;
  if (threads <= 1) {
    body(0, items);
    return;
  }
  int64_t n_chunks = threads * chunks_per_thread < items ? threads * chunks_per_thread : items;
  const int64_t chunk = (items + n_chunks - 1) / n_chunks;
  n_chunks = (items + chunk - 1) / chunk;
  auto w = std::make_shared<Work<Body>>(std::move(body), chunk, n_chunks, items);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([w] { w->Run(); });
  w->Run();
  while (w->done.load(std::memory_order_acquire) < w->n_chunks) std::this_thread::yield();
}

}  // namespace crossover
