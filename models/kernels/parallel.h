// Work sharing for ferrox's CPU kernels (models/kernels/*.cc) on XLA's intra-op pool.
//
// Tasks [0, n) are claimed from one atomic counter by the calling thread and by helpers
// scheduled on the pool. A helper that starts late finds nothing left and returns; the
// caller does whatever is unclaimed itself and then waits only for tasks already being
// run, so it never waits on a helper that has not started (no deadlock when the pool is
// busy), and no task runs after the handler returns (the raw pointers a task reads stay
// valid). Which thread runs a task never changes its result.

#ifndef FERROX_MODELS_KERNELS_PARALLEL_H_
#define FERROX_MODELS_KERNELS_PARALLEL_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ferrox {

class TaskCounter {
 public:
  TaskCounter(int64_t tasks, std::function<void(int64_t)> run) : tasks_(tasks), run_(std::move(run)) {}

  void Work() {
    for (int64_t t = next_.fetch_add(1, std::memory_order_relaxed); t < tasks_;
         t = next_.fetch_add(1, std::memory_order_relaxed)) {
      run_(t);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void WaitAll() const {
    for (int spins = 0; done_.load(std::memory_order_acquire) < tasks_; ++spins) {
      if (spins < 4096) _mm_pause(); else std::this_thread::yield();
    }
  }

 private:
  const int64_t tasks_;
  const std::function<void(int64_t)> run_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
};

// Runs run(t) for t in [0, tasks), on up to `threads` threads of `pool` (the caller one
// of them); threads <= 1 runs everything on the caller.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t threads, int64_t tasks,
                        std::function<void(int64_t)> run) {
  auto counter = std::make_shared<TaskCounter>(tasks, std::move(run));
  const int64_t helpers = std::min(threads, tasks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([counter] { counter->Work(); });
  counter->Work();
  counter->WaitAll();
}

}  // namespace ferrox

#endif  // FERROX_MODELS_KERNELS_PARALLEL_H_
