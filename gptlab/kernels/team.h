// The decode step's threads: one parallel region for the whole step, its phases (a product, the attention's heads)
// split between the threads and separated by a spin barrier. A region per product (at::parallel_for) forks and joins
// the team some 60 times a token at batch 1, and the threads spent ~12% of their cycles in libgomp waiting there.
//
// The barrier: each thread counts itself in; the last one in resets the count and moves the generation on, the
// others spin until it moves (acquire/release on the counters orders every write before the barrier before every
// read after it). A thread that spins long yields its core: on a machine with more threads than cores the one it
// waits for may need it.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "linear_avx2.h"

namespace GPTLAB_NS {

class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}
  void wait() {
    if (threads_ == 1) return;
    const unsigned generation = passed_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      passed_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; passed_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  // ~20 microseconds of pauses (a Zen pause is ~65 cycles): a product's tail imbalance; a partner that takes longer
  // has likely lost its core, and yielding (which returns at once where nothing else waits) lets it have it back
  static constexpr int kSpins = 1 << 10;
  const int threads_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<unsigned> passed_{0};
};

// one thread of the team: its share of a phase's work items, and the barrier that ends a phase
struct Team {
  Part part;
  SpinBarrier* barrier;
  int64_t begin(int64_t n) const { return part.begin(n); }
  int64_t end(int64_t n) const { return part.end(n); }
  void sync() const { barrier->wait(); }
};

}  // namespace GPTLAB_NS
