// The K-quant kernel's many-row products (prompt chunks): the float tile path (the AVX-512
// panel of block_matmul_k_body.inc, as the kernel runs it from 16 rows) against the 16-bit
// integer path (block_matmul_k_i16.inc), on THREADS spinning threads sharing the columns in
// 4-column chunks, weights of one projection (cache-resident as a prompt chunk's reuse makes
// them). Per round the two paths alternate for each format; the best of ROUNDS is printed, in
// milliseconds and GMAC/s, with the integer path's speed-up and its max difference from the
// float path relative to max |float| (its 16-bit activation rounding, ~1e-5; a bug shows as
// O(1); the exact checks are tests/models/test_block_matmul_k_i16.py's). The integer time
// includes the activations' quantization on the calling thread, as the kernel does it.
//   c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/kquant_prefill.cc -o /tmp/kquant_prefill
//   /tmp/kquant_prefill THREADS ROUNDS K N ROWS
// Built with -DKQ_OLD='"path/to/an/older/block_matmul_k_i16.inc"' (e.g. `git show
// main:models/kernels/block_matmul_k_i16.inc > /tmp/old_i16.inc`) it times that version of the
// 16-bit path against this one instead of the float panel (old / new alternated each round),
// and prints each as a share of vpdpwssd's issue rate (the best of ROUNDS short loops before
// each format, the best so far in the run: the bound bench/kernels/dot_peak.cc measures, 32
// MAC an instruction).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <ctime>
#include <vector>

#include "block_matmul_k_builds.h"
#include "bench_team.h"
#include "kquant_blocks.h"

#ifdef KQ_OLD
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace kq_old {
#include KQ_OLD
}  // namespace kq_old
#pragma GCC pop_options
#endif

namespace {

using bench::Blocks;
using bench::Team;

// This thread's CPU seconds: with THREADS 1 the products are timed on it, so a time slice
// lost to another process on the shared host is not counted (wall time, best of ROUNDS, was
// several times the product at load 10 on 2 cores).
double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// vpdpwssd zmm a second on this thread: 12 independent chains, ~1 ms a loop, best of `rounds`
__attribute__((target("avx512f,avx512vnni"), noinline)) double DotPeak(int rounds) {
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    __m512i a[12];
    __m512i x = _mm512_set1_epi16(3), y = _mm512_set1_epi16(5);
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
    constexpr long kIters = 300'000;
    const double t0 = ThreadSeconds();
    for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) a[j] = _mm512_dpwssd_epi32(a[j], x, y);
      asm volatile("" : "+v"(x));
    }
    const double s = ThreadSeconds() - t0;
    int sink = 0;
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_epi32(a[i]);
    if (sink == 42) std::puts("");
    best = std::max(best, kIters * 12.0 / s);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s THREADS ROUNDS K N ROWS\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), rounds = std::atoi(argv[2]);
  const int64_t k = std::atoll(argv[3]), n = std::atoll(argv[4]), m = std::atoll(argv[5]);
  Team team(threads);
  std::mt19937 rng(1);
  std::vector<float> x(m * k);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  const int fmts[3] = {kQ4_K, kQ5_K, kQ6_K};
  const char* names[3] = {"Q4_K", "Q5_K", "Q6_K"};
#ifdef KQ_OLD  // one buffer for both versions' activations: the larger of their sizes
  std::vector<uint8_t> wide_buf(std::max(ferrox_k_vnni::WideKBytes(m, k), kq_old::WideKBytes(m, k)));
#else
  std::vector<uint8_t> wide_buf(ferrox_k_vnni::WideKBytes(m, k));
#endif
  uint8_t* wide_at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide_buf.data()) + 63) & ~uintptr_t{63});
  const int64_t chunks = threads * 4, chunk = ((n + chunks - 1) / chunks + 3) / 4 * 4;
  std::printf("[%lld, %lld] x %lld rows, %d threads, best of %d rounds%s\n", static_cast<long long>(k),
              static_cast<long long>(n), static_cast<long long>(m), threads, rounds,
              threads == 1 ? " (thread CPU time)" : "");
  [[maybe_unused]] double peak = 0;
  for (int fi = 0; fi < 3; ++fi) {
    const std::vector<uint8_t> w = Blocks(fmts[fi], n * k / kSuper * SuperBytes(fmts[fi]), &rng);
    std::vector<float> out_f(m * n), out_i(m * n);
#ifdef KQ_OLD
    peak = std::max(peak, DotPeak(rounds) * 32 / 1e9);  // GMAC/s, the best so far in this run
#endif
    double best[2] = {1e9, 1e9};
    for (int round = 0; round < rounds; ++round) {
      for (int path = 0; path < 2; ++path) {
        const Problem p{x.data(), w.data(), path == 0 ? out_f.data() : out_i.data(), m, n, k};
        ferrox_k_vnni::WideRowsK xw{};
#ifdef KQ_OLD
        kq_old::WideRowsK xw_old{};
#endif
        std::atomic<int64_t> next{0};
        const double c0 = ThreadSeconds();
        double s = team.Time(
            [&] {
              next = 0;
              if (path == 1) xw = ferrox_k_vnni::QuantizeWideK(x.data(), m, k, wide_at);
#ifdef KQ_OLD
              if (path == 0) xw_old = kq_old::QuantizeWideK(x.data(), m, k, wide_at);
#endif
            },
            [&](int) {
              for (int64_t c; (c = next.fetch_add(1)) * chunk < n;) {
                const int64_t b = c * chunk, e = std::min(n, b + chunk);
#ifdef KQ_OLD
                if (path == 0) kq_old::WideRunK(fmts[fi], p, xw_old, b, e);
#else
                if (path == 0) ferrox_k_avx512::Run(fmts[fi], p, b, e, ferrox_k_avx512::kRowPathRows);
#endif
                else ferrox_k_vnni::WideRunK(fmts[fi], p, xw, b, e);
              }
            });
        if (threads == 1) s = ThreadSeconds() - c0;
        best[path] = std::min(best[path], s);
      }
    }
    double diff = 0, top = 0;
    for (int64_t i = 0; i < m * n; ++i)
      diff = std::max(diff, double(std::fabs(out_i[i] - out_f[i]))), top = std::max(top, double(std::fabs(out_f[i])));
    const double macs = double(m) * n * k;
#ifdef KQ_OLD
    std::printf("  %s  old %8.3f ms %6.1f GMAC/s %5.1f %%   new %8.3f ms %6.1f GMAC/s %5.1f %%   %.2fx   "
                "vpdpwssd peak %.1f GMAC/s   max diff / max|out| %.1e\n",
                names[fi], best[0] * 1e3, macs / best[0] / 1e9, 100 * macs / best[0] / 1e9 / peak, best[1] * 1e3,
                macs / best[1] / 1e9, 100 * macs / best[1] / 1e9 / peak, best[0] / best[1], peak, diff / top);
    continue;
#endif
    std::printf("  %s  float %8.3f ms %6.1f GMAC/s   int16 %8.3f ms %6.1f GMAC/s   %.2fx   max diff / max|out| %.1e\n",
                names[fi], best[0] * 1e3, macs / best[0] / 1e9, best[1] * 1e3, macs / best[1] / 1e9,
                best[0] / best[1], diff / top);
  }
}
