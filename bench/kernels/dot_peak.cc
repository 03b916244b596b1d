// Probe, not a kernel path: the issue rate of the 512-bit integer and float dot-product
// instructions on this CPU, per thread and with every thread at once. A product with 16-bit
// activations (ferrox's default: error <= amax / 65534 of a block) spends at least one
// `vpdpwssd` per 32 multiply-adds; one with 8-bit activations (llama.cpp's Q8_0 / Q8_K) one
// `vpdpbusd` per 64. So `vpdpwssd`'s rate times 32 bounds how many multiply-adds a second any
// 16-bit-accurate kernel can do here: the compute bound of a prompt chunk and of a many-row
// decode step (docs/benchmarks.md, "What bounds the 1B at c1 and c8").
//   c++ -O2 -march=native -pthread bench/kernels/dot_peak.cc -o /tmp/dot_peak && /tmp/dot_peak [rounds]
// Prints, per instruction, the best of `rounds` (default 9) timed loops of 12 independent
// chains (enough to cover the latency), in G instructions and G multiply-adds a second.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "bench_team.h"

namespace {
constexpr long kIters = 20'000'000;  // x 12 instructions per timed loop
constexpr int kChains = 12;

template <int Op>
__attribute__((noinline)) double Loop() {
  __m512i a[kChains];
  __m512 f[kChains];
  __m512i x = _mm512_set1_epi16(3), y = _mm512_set1_epi16(5);
  __m512 fx = _mm512_set1_ps(1.0001f), fy = _mm512_set1_ps(0.9999f);
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_epi32(i), f[i] = _mm512_set1_ps(static_cast<float>(i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kChains; ++j) {
      if constexpr (Op == 0) a[j] = _mm512_dpwssd_epi32(a[j], x, y);
      if constexpr (Op == 1) a[j] = _mm512_dpbusd_epi32(a[j], x, y);
      if constexpr (Op == 2) f[j] = _mm512_fmadd_ps(f[j], fx, fy);
    }
    asm volatile("" : "+v"(x), "+v"(fx));  // keep the loop from being folded
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int sink = 0;
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_epi32(a[i]) + static_cast<int>(_mm512_reduce_add_ps(f[i]));
  if (sink == 42) std::puts("");
  return static_cast<double>(kIters) * kChains / s;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const char* names[3] = {"vpdpwssd zmm (16-bit pairs, 32 MAC)", "vpdpbusd zmm (8-bit quads, 64 MAC)",
                          "vfmadd ps zmm (float32, 16 MAC)"};
  const int macs[3] = {32, 64, 16};
  for (int threads : {1, cores}) {
    const double rates[3] = {bench::BestSummedRate(Loop<0>, threads, rounds),
                             bench::BestSummedRate(Loop<1>, threads, rounds),
                             bench::BestSummedRate(Loop<2>, threads, rounds)};
    for (int op = 0; op < 3; ++op)
      std::printf("%d thread%s  %-38s %6.2f G/s  %7.1f GMAC/s\n", threads, threads > 1 ? "s" : " ", names[op],
                  rates[op] / 1e9, rates[op] * macs[op] / 1e9);
  }
  return 0;
}
