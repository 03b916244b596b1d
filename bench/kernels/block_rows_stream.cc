// The block kernel's Q4_0 / Q4_1 / Q8_0 products of 2 to 15 rows (a c2-c15 decode step):
// the float path (the 4-row register tile below 5 rows, the L1 panel from 5; Q8_0's tile to
// 15), block_matmul_i16.inc (rows in 8-lane groups: "wide") and block_matmul_rows16.inc with
// 2 rows x 4 columns ("r2") and 4 rows x 2 columns ("r4") in the lanes, and "r4h", the kernel's
// R 4 as it runs (5 to 8 rows on the byte halves of block_matmul_rows16_halves.inc, 9 to 12
// as r4), alternated in every round, with the two cores' DRAM read probe in the same run (block_row_stream.cc's method:
// as many copies of the weights as fill 256 MB, each product on the next copy, columns split
// over THREADS spinning threads; CACHED=1: one copy, the compute rate from cache). The
// 16-bit paths' times include quantizing the rows on the calling thread. Prints the best and
// the median sample of ROUNDS rounds (the best copy of a round is its sample) in GB/s of
// weight bytes, and each path's max difference from the float path relative to |float| + 1
// (the 16-bit activation rounding: ~1e-4; a bug shows as O(1)), and how many outputs of the
// rows16 variants differ in their bits from the wide path's (the same block terms in the same
// order: 0).
//   c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_rows_stream.cc -o /tmp/block_rows_stream
//   /tmp/block_rows_stream THREADS ROUNDS K N ROWS
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "block_matmul_builds.h"
#include "bench_team.h"
#include "block_random.h"

namespace {

using bench::kProbeChunk;
using bench::kStreamBytes;
using bench::SumFloats;
using bench::Team;

using bench::RandomBlocks;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 || std::atoll(argv[5]) < 2 || std::atoll(argv[5]) > 15) {
    std::fprintf(stderr, "usage: %s THREADS ROUNDS K N ROWS (2 to 15)\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), rounds = std::atoi(argv[2]);
  const int64_t k = std::atoll(argv[3]), n = std::atoll(argv[4]), m = std::atoll(argv[5]);
  const int64_t blocks = k / kBlock;
  Team team(threads);
  std::mt19937 rng(1);
  std::vector<float> x(m * k);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  const bench::ProbeBuffer probe;
  float* const probe_at = probe.at;
  const int fmts[3] = {kQ4_0, kQ4_1, kQ8_0};
  const char* names[3] = {"Q4_0", "Q4_1", "Q8_0"};
  constexpr int kPaths = 5;
  const char* paths[kPaths] = {"float", "wide", "r2", "r4", "r4h"};
  std::vector<std::vector<uint8_t>> weights;
  std::vector<int64_t> copies;
  for (int f : fmts) {
    const int64_t bytes = n * k / kBlock * BlockBytes(f);
    copies.push_back(bench::StreamCopies(bytes));  // CACHED=1: one copy, from cache
    weights.push_back(RandomBlocks(f, bytes * copies.back(), &rng));
  }
  // the 16-bit paths' activation buffers (zero: lanes of rows past m stay zero)
  const int64_t lanes = ferrox_avx512::WideLanes(m), wgroups = (m + lanes - 1) / lanes;
  std::vector<Lanes16> wpairs(wgroups * blocks * lanes);
  std::vector<float> wscales(wgroups * blocks * lanes), wsums(wgroups * blocks * lanes);
  std::vector<Lanes16> rpairs[2];
  std::vector<float> rscales[2], rsums[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t per = 2 << i, groups = (m + per - 1) / per;
    rpairs[i].resize(groups * blocks * 8);
    rscales[i].resize(groups * blocks * 8);
    rsums[i].resize(groups * blocks * 8);
  }
  std::vector<Lanes16> rhalves(rpairs[1].size());
  const bool halves = ferrox_avx512::Rows16TakesHalves(m);
  const ferrox_avx512::WideRows wide{wpairs.data()->v, wscales.data(), wsums.data(), lanes};
  const ferrox_avx512::Rows16 r16[2] = {{rpairs[0].data()->v, rscales[0].data(), rsums[0].data(), 2},
                                        {rpairs[1].data()->v, rscales[1].data(), rsums[1].data(), 4}};
  const int64_t per_thread = (n / threads + 7) / 8 * 8;
  std::vector<double> probe_samples, samples[3][kPaths];
  double max_diff[3][kPaths] = {};
  int64_t unequal[3][kPaths] = {};  // outputs whose bits differ from the wide path's
  std::vector<float> out(m * n), ref(m * n), wide_out(m * n);
  for (int round = 0; round < rounds; ++round) {
    double best_probe = 0;
    best_probe = std::max(best_probe, bench::ProbeBest(team, probe_at, threads));
    probe_samples.push_back(best_probe);
    for (int fi = 0; fi < 3; ++fi) {
      const int64_t bytes = n * k / kBlock * BlockBytes(fmts[fi]);
      for (int path = 0; path < kPaths; ++path) {
        double best = 0;
        float* o = path == 0 ? ref.data() : path == 1 ? wide_out.data() : out.data();
        const ferrox_avx512::Rows16 r4h{halves ? nullptr : rpairs[1].data()->v, rscales[1].data(), rsums[1].data(), 4,
                                        halves ? rhalves.data()->v : nullptr};
        const auto quantize = [&] {
          if (path == 1)
            for (int64_t g = 0; g < wgroups; ++g)
              ferrox_avx512::QuantizeWideGroup(x.data(), m, k, lanes, g, wpairs.data()->v, wscales.data(), wsums.data());
          if (path == 2 || path == 3)
            for (int64_t r = 0; r < m; ++r)
              ferrox_avx512::QuantizeRows16Row(x.data(), k, r16[path - 2].rows_per_group, r,
                                               rpairs[path - 2].data()->v, rscales[path - 2].data(),
                                               rsums[path - 2].data());
          if (path == 4)  // as block_matmul.cc: the halves at 5-8 rows, else the pairs
            for (int64_t r = 0; r < m; ++r)
              ferrox_avx512::QuantizeRows16Row(x.data(), k, 4, r, halves ? nullptr : rpairs[1].data()->v,
                                               rscales[1].data(), rsums[1].data(), halves ? rhalves.data()->v : nullptr);
        };
        for (int64_t c = 0; c < copies[fi]; ++c) {
          const Problem p{x.data(), weights[fi].data() + c * bytes, o, m, n, k};
          const auto product = [&](int t) {
            const int64_t begin = std::min(n, t * per_thread), end = t == threads - 1 ? n : std::min(n, begin + per_thread);
            if (path == 0) ferrox_avx512::Run(fmts[fi], p, nullptr, begin, end);
            else if (path == 1) ferrox_avx512::RunWide(fmts[fi], p, wide, begin, end);
            else if (path == 4) ferrox_avx512::RunRows16(fmts[fi], p, r4h, begin, end);
            else ferrox_avx512::RunRows16(fmts[fi], p, r16[path - 2], begin, end);
          };
          if (copies[fi] == 1) team.Time(quantize, product);
          best = std::max(best, bytes / team.Time(quantize, product) / 1e9);
        }
        samples[fi][path].push_back(best);
        for (int64_t i = 0; path > 0 && i < m * n; ++i) {
          const float v = path == 1 ? wide_out[i] : out[i];
          max_diff[fi][path] = std::max<double>(max_diff[fi][path], std::fabs(v - ref[i]) / (std::fabs(ref[i]) + 1.0));
          if (path > 1) unequal[fi][path] += std::memcmp(&v, &wide_out[i], 4) != 0;
        }
      }
    }
  }
  std::printf("DRAM read probe, %d threads: best %.1f / median %.1f GB/s (%d rounds)\n", threads,
              *std::max_element(probe_samples.begin(), probe_samples.end()), Median(probe_samples), rounds);
  for (int fi = 0; fi < 3; ++fi) {
    const double base = *std::max_element(samples[fi][0].begin(), samples[fi][0].end());
    const double base_med = Median(samples[fi][0]);
    std::printf("%s %ld rows x [%ld -> %ld], %d threads, GB/s best / median:", names[fi], static_cast<long>(m),
                static_cast<long>(k), static_cast<long>(n), threads);
    for (int path = 0; path < kPaths; ++path) {
      const double b = *std::max_element(samples[fi][path].begin(), samples[fi][path].end()), md = Median(samples[fi][path]);
      std::printf("  %s %.1f / %.1f", paths[path], b, md);
      if (path > 0) std::printf(" (%.2fx / %.2fx, diff %.1g)", b / base, md / base_med, max_diff[fi][path]);
      if (path > 1) std::printf(" [%ld outputs not wide's bits]", static_cast<long>(unequal[fi][path]));
    }
    std::printf("\n");
  }
}
