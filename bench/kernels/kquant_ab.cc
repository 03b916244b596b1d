// Old against new: the K-quant kernel's 2-15-row path (block_matmul_k_rows16.inc) of two trees
// in one process (kquant_ab_side.cc built from each), alternated per round (the order swapped
// every round), over weights streamed from DRAM (as many copies as fill 256 MB, each product
// on the next copy) or, with CACHED=1, one copy from cache. Each product's time includes its
// rows' quantization on the calling thread, as the kernel does once per call; its columns are
// split over THREADS spinning threads. Prints, per format, each side's best and median sample
// in rows x GB/s, new / old, and the sides' difference on the last product: how many outputs
// differ in any bit and the max |new - old| / (|old| + 1) (0 and 0 where the sums' order is
// unchanged).
//   bash bench/kernels/kquant_ab.sh OLD_TREE THREADS ROUNDS K N ROWS [FORMATS, e.g. 3,5]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "block_matmul_k_builds.h"  // SuperBytes, for kquant_blocks.h
#include "bench_team.h"
#include "kquant_blocks.h"

namespace kq_old {
int64_t Bytes(int64_t m, int64_t k);
void Quantize(const float* x, int64_t m, int64_t k, uint8_t* buf, void* rows);
void Run(int fmt, const void* rows, const float* x, const uint8_t* w, float* out, int64_t m, int64_t n, int64_t k,
         int64_t begin, int64_t end);
}  // namespace kq_old
namespace kq_new {
int64_t Bytes(int64_t m, int64_t k);
void Quantize(const float* x, int64_t m, int64_t k, uint8_t* buf, void* rows);
void Run(int fmt, const void* rows, const float* x, const uint8_t* w, float* out, int64_t m, int64_t n, int64_t k,
         int64_t begin, int64_t end);
}  // namespace kq_new

namespace {

struct Side {
  int64_t (*bytes)(int64_t, int64_t);
  void (*quantize)(const float*, int64_t, int64_t, uint8_t*, void*);
  void (*run)(int, const void*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s THREADS ROUNDS K N ROWS [FORMATS]\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), rounds = std::atoi(argv[2]);
  const int64_t k = std::atoll(argv[3]), n = std::atoll(argv[4]), m = std::atoll(argv[5]);
  std::vector<int> fmts;
  for (const char* f = argc > 6 ? argv[6] : "3,4,5"; *f; ++f)
    if (*f >= '3' && *f <= '5') fmts.push_back(*f - '0');
  const Side sides[2] = {{kq_old::Bytes, kq_old::Quantize, kq_old::Run}, {kq_new::Bytes, kq_new::Quantize, kq_new::Run}};
  bench::Team team(threads);
  std::mt19937 rng(1);
  std::vector<float> x(m * k);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  const int64_t per_thread = (n / threads + 15) / 16 * 16;
  std::vector<uint8_t> buf(std::max(sides[0].bytes(m, k), sides[1].bytes(m, k)) + 64);
  uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  alignas(64) unsigned char rows[4096];  // either side's Int16Rows
  std::vector<float> out[2] = {std::vector<float>(m * n), std::vector<float>(m * n)};
  const char* names[6] = {"", "", "", "Q4_K", "Q5_K", "Q6_K"};
  for (int fmt : fmts) {
    const int64_t bytes = n * k / kSuper * SuperBytes(fmt), copies = bench::StreamCopies(bytes);
    const std::vector<uint8_t> w = bench::Blocks(fmt, bytes * copies, &rng);
    std::vector<double> samples[2];
    for (int round = 0; round < rounds; ++round) {
      for (int o = 0; o < 2; ++o) {
        const int side = (round + o) % 2;
        const Side& sd = sides[side];
        for (int64_t c = 0; c < copies; ++c) {
          const uint8_t* wc = w.data() + c * bytes;
          float* oc = out[side].data();
          const double s = team.Time([&] { sd.quantize(x.data(), m, k, at, rows); },
                                     [&](int t) {
                                       const int64_t begin = std::min(n, t * per_thread);
                                       const int64_t end = t == threads - 1 ? n : std::min(n, begin + per_thread);
                                       sd.run(fmt, rows, x.data(), wc, oc, m, n, k, begin, end);
                                     });
          samples[side].push_back(m * bytes / s / 1e9);
        }
      }
    }
    int64_t differ = 0;
    double max_rel = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      differ += std::memcmp(&out[0][i], &out[1][i], 4) != 0;
      max_rel = std::max<double>(max_rel, std::fabs(out[1][i] - out[0][i]) / (std::fabs(out[0][i]) + 1.0));
    }
    const double b0 = *std::max_element(samples[0].begin(), samples[0].end());
    const double b1 = *std::max_element(samples[1].begin(), samples[1].end());
    const double m0 = Median(samples[0]), m1 = Median(samples[1]);
    std::printf("%s %ld rows [%ld -> %ld] %d thr %s: old %.1f / %.1f, new %.1f / %.1f rows x GB/s (best / median), "
                "new/old %.3f / %.3f; %ld of %ld outputs differ, max rel %.2g\n",
                names[fmt], static_cast<long>(m), static_cast<long>(k), static_cast<long>(n), threads,
                std::getenv("CACHED") ? "cached" : "DRAM", b0, m0, b1, m1, b1 / b0, m1 / m0, static_cast<long>(differ),
                static_cast<long>(m * n), max_rel);
    std::fflush(stdout);
  }
}
