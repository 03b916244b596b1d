// The block kernel's one-row (or few-row) float path over weights streamed from memory, not
// from cache: as many copies of one projection as fill 80 MB (past this host's L3), each
// product on the next copy, on one thread or on two spinning threads that split the
// columns, as a decode step runs the 30 layers' projections. The one-thread harness
// (block_harness.cc) times products whose weights sit in cache; this one shows what memory
// adds, which is where the one-row step's prefetch problem was found (docs/benchmarks.md).
//   c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_stream.cc -o /tmp/block_stream
//   /tmp/block_stream THREADS ROWS K N FMT      (FMT: 0 Q4_0, 1 Q4_1, 2 Q8_0; AVX2=1 in the
//                                               environment runs the AVX2 build)
//   /tmp/block_stream 2 1 1536 576 1            # the default model's down projection, 1 row
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "block_matmul_builds.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s THREADS ROWS K N FMT\n", argv[0]);
    return 2;
  }
  const bool avx2 = std::getenv("AVX2") != nullptr;
  const int threads = std::atoi(argv[1]), fmt = std::atoi(argv[5]);
  const int64_t m = std::atoll(argv[2]), k = std::atoll(argv[3]), n = std::atoll(argv[4]);
  const int64_t bytes = n * k / kBlock * BlockBytes(fmt), copies = (80 << 20) / bytes + 1;
  std::vector<uint8_t> w(bytes * copies);
  std::mt19937 rng(1);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  const uint16_t half = _cvtss_sh(0.01f, 0);  // every d and m: finite, so no slow float paths
  for (int64_t i = 0; i < n * k / kBlock * copies; ++i) {
    std::memcpy(&w[i * BlockBytes(fmt)], &half, 2);
    if (fmt == kQ4_1) std::memcpy(&w[i * BlockBytes(fmt) + 2], &half, 2);
  }
  std::vector<float> x(m * k, 0.5f), out(m * n);
  int64_t current = 0;
  auto part = [&](int t) {
    const Problem p{x.data(), w.data() + current * bytes, out.data(), m, n, k};
    const int64_t per = n / threads, begin = t * per, end = t == threads - 1 ? n : begin + per;
    if (avx2) ferrox_avx2::Run(fmt, p, nullptr, begin, end);
    else ferrox_avx512::Run(fmt, p, nullptr, begin, end);
  };
  std::atomic<int> go{0}, done{0};
  std::atomic<bool> quit{false};
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t)
    helpers.emplace_back([&, t] {
      for (int seen = 0; !quit;) {
        const int g = go.load();
        if (g == seen) { _mm_pause(); continue; }
        seen = g;
        part(t);
        ++done;
      }
    });
  for (int round = 0; round < 6; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (current = 0; current < copies; ++current) {
      done = 0;
      ++go;
      part(0);
      while (done.load() < threads - 1) _mm_pause();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s, %d thread(s), %ld row(s), [%ld -> %ld] fmt %d: %.1f us a product, %.1f GB/s\n",
                avx2 ? "avx2" : "avx512", threads, static_cast<long>(m), static_cast<long>(k), static_cast<long>(n),
                fmt, s / copies * 1e6, bytes * copies / s / 1e9);
  }
  quit = true;
  for (auto& t : helpers) t.join();
}
