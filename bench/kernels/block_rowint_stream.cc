// The Q4_0 / Q4_1 / Q8_0 one-row products: the block kernel's float tile (FloatTile512, what
// block_matmul.cc ran at one row before) against the integer row path
// (block_matmul_rowint.inc, what it runs with wide_rows > 0 on AVX-512 VNNI), weights
// streamed from DRAM, with the two cores' DRAM read probe in the same run:
// bench/kernels/block_row_stream.cc's method, on block_matmul_builds.h (no XLA). As many
// copies of a projection as fill 256 MB, each product on the next copy, split over THREADS
// spinning threads by columns. Per round, in this order: the probe, then per format the tile
// over every copy, then the integer path over every copy (its time includes quantizing the
// row on the calling thread before the threads start, as the kernel does), so the two
// alternate round by round. Printed per path: the best and the median per-copy sample of all
// rounds, GB/s of weight bytes read; and the integer path's largest |int - tile| relative to
// sum_j |x_j w_j| of the element (the 16-bit activations' rounding: ~1e-5; a bug is O(1)).
//   c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_rowint_stream.cc -o /tmp/brs
//   /tmp/brs THREADS ROUNDS K N
//   CACHED=1 /tmp/brs 1 50 2048 512   # one copy, from cache: the paths' compute rate
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
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s THREADS ROUNDS K N\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), rounds = std::atoi(argv[2]);
  const int64_t k = std::atoll(argv[3]), n = std::atoll(argv[4]);
  Team team(threads);
  std::mt19937 rng(1);
  std::vector<float> x(k);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  const bench::ProbeBuffer probe;
  float* const probe_at = probe.at;
  const int fmts[3] = {kQ4_0, kQ4_1, kQ8_0};
  const char* names[3] = {"Q4_0", "Q4_1", "Q8_0"};
  std::vector<std::vector<uint8_t>> weights;
  std::vector<int64_t> copies;
  const int64_t per_thread = (n / threads + 15) / 16 * 16;
  for (int f : fmts) {
    const int64_t bytes = n * k / kBlock * BlockBytes(f);
    copies.push_back(bench::StreamCopies(bytes));  // CACHED=1: one copy, from cache
    weights.push_back(RandomBlocks(f, bytes * copies.back(), &rng));
  }
  std::vector<uint8_t> buf(ferrox_rowint::RowIntBytes(k) + 64);
  uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  double best_probe = 0;
  std::vector<double> samples[3][2];
  double max_rel[3] = {};
  std::vector<float> out(n), tile_out(n);
  for (int round = 0; round < rounds; ++round) {
    best_probe = std::max(best_probe, bench::ProbeBest(team, probe_at, threads));
    for (int fi = 0; fi < 3; ++fi) {
      const int64_t bytes = n * k / kBlock * BlockBytes(fmts[fi]);
      for (int path = 0; path < 2; ++path) {
        float* o = path ? out.data() : tile_out.data();
        ferrox_rowint::RowIntX xr{};
        for (int64_t c = 0; c < copies[fi]; ++c) {
          const Problem p{x.data(), weights[fi].data() + c * bytes, o, 1, n, k};
          const auto product = [&](int t) {
            const int64_t begin = std::min(n, t * per_thread), end = t == threads - 1 ? n : std::min(n, begin + per_thread);
            if (path == 0) ferrox_avx512::Run(fmts[fi], p, nullptr, begin, end);
            else ferrox_rowint::RowIntRun(fmts[fi], p, xr, begin, end);
          };
          const auto quantize = [&] {
            if (path == 1) xr = ferrox_rowint::QuantizeRowInt(x.data(), k, at);
          };
          if (copies[fi] == 1) team.Time(quantize, product);  // CACHED: every path from cache
          samples[fi][path].push_back(bytes / team.Time(quantize, product) / 1e9);
          if (path == 1 && c == copies[fi] - 1) {  // the last copy, the one tile_out holds
            const int64_t row_bytes = k / kBlock * BlockBytes(fmts[fi]);
            std::vector<float> w(k);
            for (int64_t j = 0; j < n; ++j) {
              double mag = 0;
              const uint8_t* row = p.w + j * row_bytes;
              for (int64_t b = 0; b < k / kBlock; ++b) {
                const uint8_t* blk = row + b * BlockBytes(fmts[fi]);
                const float d = ferrox::HalfToFloat(blk);
                for (int i = 0; i < 32; ++i) {
                  float wv;
                  if (fmts[fi] == kQ8_0) wv = d * static_cast<int8_t>(blk[2 + i]);
                  else {
                    const uint8_t q = blk[(fmts[fi] == kQ4_1 ? 4 : 2) + i % 16];
                    const int v = i < 16 ? q & 15 : q >> 4;
                    wv = fmts[fi] == kQ4_1 ? d * v + ferrox::HalfToFloat(blk + 2) : d * (v - 8);
                  }
                  mag += std::fabs(wv * x[b * kBlock + i]);
                }
              }
              max_rel[fi] = std::max(max_rel[fi], std::fabs(out[j] - tile_out[j]) / mag);
            }
          }
        }
      }
    }
  }
  std::printf("DRAM read probe, %d threads: %.1f GB/s (best of %d)\n", threads, best_probe, rounds);
  for (int fi = 0; fi < 3; ++fi) {
    const double tb = *std::max_element(samples[fi][0].begin(), samples[fi][0].end());
    const double ib = *std::max_element(samples[fi][1].begin(), samples[fi][1].end());
    std::printf("%s, 1 row x [%ld -> %ld], %d threads: tile %.1f / %.1f GB/s (best / median, %.0f%% of the probe), "
                "integer %.1f / %.1f (%.0f%%; %.2fx / %.2fx), max |int - tile| / sum |x w| %.2g\n",
                names[fi], static_cast<long>(k), static_cast<long>(n), threads, tb, Median(samples[fi][0]),
                100 * tb / best_probe, ib, Median(samples[fi][1]), 100 * ib / best_probe, ib / tb,
                Median(samples[fi][1]) / Median(samples[fi][0]), max_rel[fi]);
  }
}
