// What the kernel harnesses of bench/kernels share (kquant_stream.cc, kquant_prefill.cc,
// block_row_stream.cc): a team of spinning threads that times one product split over them, and
// the DRAM read probe (its sizes, its sum and one timed pass); and the instruction-rate probes'
// (dot_peak.cc, dot_peak256.cc) best summed rate over rounds. The K-quant harnesses' random
// super-blocks are in kquant_blocks.h.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

namespace bench {

constexpr int64_t kStreamBytes = int64_t{256} << 20;
// The probe is timed per 16 MB (each past the L2s and, in turn, the L3's reach: the buffer
// is read front to back), and each product per copy, and the best of them kept: on a
// shared machine a time slice lost to another process then spoils one sample, not all.
constexpr int64_t kProbeChunk = int64_t{16} << 20;

// Runs part(t) on THREADS threads (t 0 on the caller), returns the seconds.
class Team {
 public:
  explicit Team(int threads) : threads_(threads) {
    for (int t = 1; t < threads; ++t)
      helpers_.emplace_back([this, t] {
        for (int seen = 0; !quit_;) {
          const int g = go_.load();
          if (g == seen) { _mm_pause(); continue; }
          seen = g;
          (*part_)(t);
          ++done_;
        }
      });
  }
  ~Team() {
    quit_ = true;
    for (auto& t : helpers_) t.join();
  }
  double Time(const std::function<void(int)>& part) { return Time([] {}, part); }
  // before() runs on the caller inside the timed span, ahead of the parts
  double Time(const std::function<void()>& before, const std::function<void(int)>& part) {
    const auto t0 = std::chrono::steady_clock::now();
    before();
    part_ = &part;
    done_ = 0;
    ++go_;
    part(0);
    while (done_.load() < threads_ - 1) _mm_pause();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  const int threads_;
  std::vector<std::thread> helpers_;
  const std::function<void(int)>* part_ = nullptr;
  std::atomic<int> go_{0}, done_{0};
  std::atomic<bool> quit_{false};
};

__attribute__((target("avx512f"))) inline float SumFloats(const float* p, int64_t n) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  for (int64_t i = 0; i < n; i += 64) {
    a = _mm512_add_ps(a, _mm512_load_ps(p + i));
    b = _mm512_add_ps(b, _mm512_load_ps(p + i + 16));
    c = _mm512_add_ps(c, _mm512_load_ps(p + i + 32));
    d = _mm512_add_ps(d, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
}

// The probe's buffer: kStreamBytes of 1.0f, 64-byte aligned (`at`).
struct ProbeBuffer {
  std::vector<float> data = std::vector<float>(kStreamBytes / 4 + 16);
  float* at = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(data.data()) + 63) & ~uintptr_t{63});
  ProbeBuffer() {
    for (int64_t i = 0; i < kStreamBytes / 4; ++i) at[i] = 1.0f;
  }
};

// How many copies of a product's BYTES of weights the harness streams: as many as fill
// kStreamBytes (each read from DRAM), or one with CACHED set (read from cache).
inline int64_t StreamCopies(int64_t bytes) { return std::getenv("CACHED") ? 1 : kStreamBytes / bytes + 1; }

// One pass of the DRAM read probe over PROBE (kStreamBytes of floats, split over the team),
// timed per kProbeChunk: the best GB/s of the pass.
inline double ProbeBest(Team& team, const float* probe, int threads) {
  double best = 0;
  volatile float sink = 0;
  for (int64_t chunk = 0; chunk < kStreamBytes / kProbeChunk; ++chunk) {
    const double s = team.Time([&](int t) {
      const int64_t per = kProbeChunk / 4 / threads;
      sink = sink + SumFloats(probe + chunk * kProbeChunk / 4 + t * per, per);
    });
    best = best > kProbeChunk / s / 1e9 ? best : kProbeChunk / s / 1e9;
  }
  return best;
}

// The best over `rounds` of rate() run on `threads` threads at once (each returning its own
// rate, e.g. instructions or multiply-adds a second): their sum.
template <typename Rate>
double BestSummedRate(Rate rate, int threads, int rounds) {
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    std::vector<double> rates(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&rates, &rate, t] { rates[t] = rate(); });
    for (auto& th : pool) th.join();
    double sum = 0;
    for (double v : rates) sum += v;
    best = sum > best ? sum : best;
  }
  return best;
}

}  // namespace bench
