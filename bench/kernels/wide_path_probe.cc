// One-thread probe of the block kernel's 16-bit activation path (models/kernels/
// block_matmul_i16.inc) against its float path (ferrox_avx512::Run), without XLA: random
// Q4_1 / Q8_0 blocks, weights in cache, rows 2 to 160; the 16-bit time includes the
// activation quantization. The largest difference from the float path is the int16
// rounding of the activations (about 1e-5 of the outputs). docs/benchmarks.md, "16-bit
// activation blocks for many rows", has the figures.
//   c++ -O3 -std=c++17 -mf16c -I models/kernels bench/kernels/wide_path_probe.cc -o /tmp/wide_probe
//   /tmp/wide_probe 1    # Q4_1 [576 -> 1536] and [1536 -> 576]; 2: Q8_0 [576 -> 8192]
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "block_matmul_builds.h"
int main(int argc, char** argv) {
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  int fmt = argc > 1 ? atoi(argv[1]) : 1;
  int64_t shapes[][2] = {{576, 1536}, {1536, 576}};
  for (auto& sh : shapes) {
    int64_t k = sh[0], n = sh[1];
    if (fmt == 2) { if (k != 576) continue; n = 8192; }
    int64_t bb = BlockBytes(fmt);
    std::vector<uint8_t> w(n * k / 32 * bb);
    for (auto& b : w) b = rng();
    for (int64_t i = 0; i < n * k / 32; ++i) { uint16_t h = _cvtss_sh(0.002f * (1 + rng() % 20), 0), mh = _cvtss_sh(-0.01f * (rng() % 5), 0); memcpy(&w[i * bb], &h, 2); if (fmt==1) memcpy(&w[i * bb + 2], &mh, 2); }
    for (int64_t m : {2, 4, 5, 8, 12, 16, 32, 64, 160}) {
      std::vector<float> x(m * k), of(m * n), oi(m * n);
      for (auto& v : x) v = nd(rng);
      auto time = [&](auto f) { double best = 1e30; for (int i = 0; i < 20; ++i) { auto t = std::chrono::steady_clock::now(); f(); best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count()); } return best; };
      Problem p{x.data(), w.data(), of.data(), m, n, k};
      double tf = time([&] { ferrox_avx512::Run(fmt, p, nullptr, 0, n); });
      int64_t lanes = ferrox_avx512::WideLanes(m), groups = (m + lanes - 1) / lanes, blocks = k / 32;
      std::vector<Lanes16> pairs(groups * blocks * lanes); std::vector<float> sc(groups * blocks * lanes), su(groups * blocks * lanes);
      Problem pi{x.data(), w.data(), oi.data(), m, n, k};
      double tq = time([&] { for (int64_t g = 0; g < groups; ++g) ferrox_avx512::QuantizeWideGroup(x.data(), m, k, lanes, g, pairs.data()->v, sc.data(), su.data()); });
      ferrox_avx512::WideRows xw{pairs.data()->v, sc.data(), su.data(), lanes};
      double ti = time([&] { ferrox_avx512::RunWide(fmt, pi, xw, 0, n); });
      double err = 0, mag = 0;
      for (int64_t i = 0; i < m * n; ++i) { err = std::max(err, (double)std::fabs(of[i] - oi[i])); mag = std::max(mag, (double)std::fabs(of[i])); }
      printf("fmt %d [%ld->%ld] rows %3ld lanes %2ld: float %6.0f us, wide %6.0f+%3.0f us x%.2f; max diff %.2e of %.2e\n",
             fmt, (long)k, (long)n, (long)m, (long)lanes, tf, ti, tq, tf/(ti+tq), err, mag);
    }
  }
}
