// One-thread harness of the GGUF block kernel's body (models/kernels/block_matmul_body.inc),
// without XLA: random blocks and activations, each path timed (min of R calls) and checked
// against a float64 product of the dequantized weights (max error in units of sum |x||w|).
//   c++ -O3 -std=c++17 -mf16c -I models/kernels bench/kernels/block_harness.cc -o /tmp/block_harness
//   /tmp/block_harness [reps [rows [avx512 only]]]
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "block_matmul_builds.h"

static float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static void Weights(int fmt, int64_t n, int64_t k, std::vector<uint8_t>* w, std::vector<double>* deq) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t bb = BlockBytes(fmt), blocks = k / kBlock;
  w->assign(n * blocks * bb, 0);
  deq->assign(n * k, 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* blk = w->data() + (r * blocks + b) * bb;
      for (int64_t i = 0; i < bb; ++i) blk[i] = byte(rng);
      const uint16_t d = _cvtss_sh(0.01f + 0.02f * (byte(rng) / 255.0f), 0), m = _cvtss_sh(-0.1f * (byte(rng) / 255.0f), 0);
      std::memcpy(blk, &d, 2);
      if (fmt == kQ4_1) std::memcpy(blk + 2, &m, 2);
      const double dd = Half(blk), mm = fmt == kQ4_1 ? Half(blk + 2) : -8.0 * dd;
      for (int j = 0; j < 32; ++j) {
        double v;
        if (fmt == kQ8_0) v = dd * static_cast<int8_t>(blk[2 + j]);
        else {
          const uint8_t q = blk[bb - 16 + (j % 16)];
          v = dd * (j < 16 ? (q & 15) : (q >> 4)) + mm;
        }
        (*deq)[r * k + b * kBlock + j] = v;
      }
    }
}

template <typename F>
static double MinUs(F f, int reps) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count());
  }
  return best;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t shapes[][3] = {{kQ4_1, 576, 1536}, {kQ4_1, 1536, 576}, {kQ4_1, 576, 576}, {kQ8_0, 576, 8192}};
  std::vector<int64_t> rows = {1, 2, 4, 8, 16, 32, 128};
  if (argc > 2) rows = {std::atoll(argv[2])};
  const bool only512 = argc > 3;  // one path alone (for perf stat)
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::printf("| fmt | K x N | rows | avx2 us | avx512 us | avx512 GFLOP/s | max err (of sum|x||w|) |\n|---|---|---|---|---|---|---|\n");
  for (auto& s : shapes) {
    const int fmt = static_cast<int>(s[0]);
    const int64_t k = s[1], n = s[2];
    std::vector<uint8_t> w;
    std::vector<double> deq;
    Weights(fmt, n, k, &w, &deq);
    for (int64_t m : rows) {
      std::vector<float> x(m * k), o2(m * n), o5(m * n);
      for (auto& v : x) v = normal(rng);
      Problem p2{x.data(), w.data(), o2.data(), m, n, k}, p5{x.data(), w.data(), o5.data(), m, n, k};
      const double t2 = only512 ? 0.0 : MinUs([&] { ferrox_avx2::Run(fmt, p2, nullptr, 0, n); }, reps);
      const double t5 = MinUs([&] { ferrox_avx512::Run(fmt, p5, nullptr, 0, n); }, reps);
      if (only512) o2 = o5;
      double err = 0;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < n; ++c) {
          double ref = 0, mag = 0;
          for (int64_t i = 0; i < k; ++i) {
            ref += x[r * k + i] * deq[c * k + i];
            mag += std::fabs(x[r * k + i] * deq[c * k + i]);
          }
          err = std::max(err, std::max(std::fabs(o2[r * n + c] - ref), std::fabs(o5[r * n + c] - ref)) / mag);
        }
      std::printf("| %s | %ldx%ld | %ld | %.0f | %.0f | %.1f | %.1e |\n", fmt == kQ8_0 ? "q8_0" : "q4_1", k, n, m, t2, t5,
                  2.0 * m * n * k / t5 / 1e3, err);
    }
  }
}
