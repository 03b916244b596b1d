// The block kernel's one-row (1-3 row) float path for Q4_0 / Q4_1 / Q8_0 over weights
// streamed from DRAM, against the two cores' DRAM read rate measured in the same run:
// bench/kernels/kquant_stream.cc's method, on block_matmul_builds.h (no XLA). As many copies
// of a projection as fill 256 MB (8x this host's L3), each product on the next copy, split
// over THREADS spinning threads by columns, as a decode step runs a model's layers. Per
// round, in this order: the DRAM probe (the threads sum a 256 MB buffer 16 MB at a time,
// each its half of the 16 MB, AVX-512 loads, 4 chains), then for each format the kernel's
// AVX-512 float path (the register tile, FloatTile512) and the alternatives of
// block_row_paths.inc (RowPairs: the K-quants' row path shape; TilePieces: the tile over
// 2048-input pieces; for Q4, ShiftIndex: the whole-row tile with its weight indices made by
// a broadcast and per-lane shifts instead of a byte widening), one after the other. The best sample of ROUNDS rounds is printed for
// each, in GB/s of weight bytes read, with each alternative's max difference from the tile
// relative to |tile| + 1 (float32 sums of the same dequantized weights in another order: a
// bug shows as O(1)).
//   c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_row_stream.cc -o /tmp/block_row_stream
//   /tmp/block_row_stream THREADS ROUNDS K N [ROWS]
//   /tmp/block_row_stream 2 8 2048 8192          # a 1B model's gate / up projection, one row
//   CACHED=1 /tmp/block_row_stream 1 50 2048 512  # one copy, from cache: the paths' compute rate
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "block_matmul_builds.h"
#include "bench_team.h"
#include "block_random.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace ferrox_avx512 {
#include "block_row_paths.inc"
}  // namespace ferrox_avx512
#pragma GCC pop_options

namespace {

using bench::kProbeChunk;
using bench::kStreamBytes;
using bench::SumFloats;
using bench::Team;

using bench::RandomBlocks;

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5 || (argc > 5 && (std::atoll(argv[5]) < 1 || std::atoll(argv[5]) > 3))) {
    std::fprintf(stderr, "usage: %s THREADS ROUNDS K N [ROWS, 1 to 3]\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), rounds = std::atoi(argv[2]);
  const int64_t k = std::atoll(argv[3]), n = std::atoll(argv[4]), m = argc > 5 ? std::atoll(argv[5]) : 1;
  Team team(threads);
  std::mt19937 rng(1);
  std::vector<float> x(m * k);
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
  double best_probe = 0, best[3][4] = {};
  double max_diff[3][4] = {};
  std::vector<float> out(m * n), tile_out(m * n);
  for (int round = 0; round < rounds; ++round) {
    best_probe = std::max(best_probe, bench::ProbeBest(team, probe_at, threads));
    for (int fi = 0; fi < 3; ++fi) {
      const int64_t bytes = n * k / kBlock * BlockBytes(fmts[fi]);
      for (int path = 0; path < 4; ++path) {
        float* o = path ? out.data() : tile_out.data();
        for (int64_t c = 0; c < copies[fi]; ++c) {
          const Problem p{x.data(), weights[fi].data() + c * bytes, o, m, n, k};
          const auto product = [&](int t) {
            const int64_t begin = std::min(n, t * per_thread), end = t == threads - 1 ? n : std::min(n, begin + per_thread);
            if (path == 0) ferrox_avx512::Run(fmts[fi], p, nullptr, begin, end);
            else ferrox_avx512::RunAlt(path, fmts[fi], p, begin, end);
          };
          if (copies[fi] == 1) team.Time(product);  // CACHED: every path times its weights from cache
          const double s = team.Time(product);
          best[fi][path] = std::max(best[fi][path], bytes / s / 1e9);
          if (path > 0 && c == copies[fi] - 1) {
            // the difference on the last copy (the one tile_out holds)
            for (int64_t i = 0; i < m * n; ++i)
              max_diff[fi][path] = std::max<double>(max_diff[fi][path],
                                                    std::fabs(out[i] - tile_out[i]) / (std::fabs(tile_out[i]) + 1.0));
          }
        }
      }
    }
  }
  std::printf("DRAM read probe, %d threads: %.1f GB/s (best of %d)\n", threads, best_probe, rounds);
  for (int fi = 0; fi < 3; ++fi)
    std::printf("%s, %ld row(s) x [%ld -> %ld], %d threads: tile %.1f GB/s (%.0f%% of the probe), "
                "row pairs %.1f (%.2fx, diff %.2g), tile pieces %.1f (%.2fx, diff %.2g)\n",
                names[fi], static_cast<long>(m), static_cast<long>(k), static_cast<long>(n), threads, best[fi][0],
                100 * best[fi][0] / best_probe, best[fi][1], best[fi][1] / best[fi][0], max_diff[fi][1], best[fi][2],
                best[fi][2] / best[fi][0], max_diff[fi][2]);
  for (int fi = 0; fi < 2; ++fi)  // Q8_0 has no such variant (path 3 runs its tile)
    std::printf("  %s, whole-row tile with shift-picked indices (x permuted): %.1f GB/s (%.2fx, diff %.2g)\n",
                names[fi], best[fi][3], best[fi][3] / best[fi][0], max_diff[fi][3]);
}
