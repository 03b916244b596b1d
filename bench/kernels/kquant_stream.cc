// The K-quant kernel's few-row products (1 to 15 rows) over weights streamed from DRAM, against the two
// cores' DRAM read rate measured in the same run. As many copies of a projection as fill
// 256 MB (8x this host's L3), each product on the next copy, split over THREADS spinning
// threads by columns, as a decode step runs a model's layers. Per round, in this order:
// the DRAM probe (the threads sum a 256 MB buffer 16 MB at a time, each its half of the
// 16 MB, AVX-512 loads, 4 chains),
// then each path of each format (the tile path, Run's row_rows 0; the row path,
// block_matmul_k_row512.inc, at 1 to 3 rows; the integer paths, block_matmul_k_rowint.inc's
// design at any row count and block_matmul_k_rows16.inc's 16-bit weights, their times
// including the rows' quantization on the calling thread before the threads start, as the
// kernel does it once per call; at 1 to 8 rows also block_matmul_k_rows8.inc's rows in lanes,
// every lane computed whatever the rows; rows x GB/s is the rate of row products); the best sample of ROUNDS rounds is printed for each,
// in GB/s of bytes read, with each path's max difference from the tile path relative to
// |tile| + 1 (the row path: both float32 sums of the same dequantized weights, ~1e-5; the
// integer path adds its 16-bit activation rounding, ~1e-3 here: a bug shows as O(1); the
// exact checks are tests/models/test_block_matmul_k.py's). At 9 to 15 rows (a decode step
// mixed with a few prompt tokens) the one-row design is skipped (it takes at most 8) and
// two more are timed: the prompt-chunk path (block_matmul_k_i16.inc, its 16-lane row group
// padded) and the 16-bit weights as two whole calls (8 rows, then the rest), against the
// kernel's two passes per 64 columns.
//   c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/kquant_stream.cc -o /tmp/kquant_stream
//   /tmp/kquant_stream THREADS ROUNDS K N [ROWS, 1 to 15]
//   /tmp/kquant_stream 2 15 2048 8192     # a 1B model's gate / up projection, one row
//   CACHED=1 /tmp/kquant_stream 1 50 2048 512   # one copy, from L2: the paths' compute rate
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

#include "block_matmul_k_builds.h"
#include "bench_team.h"
#include "kquant_blocks.h"

namespace {

using bench::Blocks;
using bench::kProbeChunk;
using bench::kStreamBytes;
using bench::SumFloats;
using bench::Team;

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5 || (argc > 5 && (std::atoll(argv[5]) < 1 || std::atoll(argv[5]) > ferrox_k_vnni::kW16Rows))) {
    std::fprintf(stderr, "usage: %s THREADS ROUNDS K N [ROWS, 1 to %d]\n", argv[0], ferrox_k_vnni::kW16Rows);
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
  const int fmts[3] = {kQ4_K, kQ5_K, kQ6_K};
  const char* names[3] = {"Q4_K", "Q5_K", "Q6_K"};
  std::vector<std::vector<uint8_t>> weights;
  std::vector<int64_t> copies;
  const int64_t per_thread = (n / threads + 15) / 16 * 16;
  for (int f : fmts) {
    const int64_t bytes = n * k / kSuper * SuperBytes(f);
    copies.push_back(bench::StreamCopies(bytes));  // CACHED=1: one copy, from cache
    weights.push_back(Blocks(f, bytes * copies.back(), &rng));
  }
  // the integer path: its activation buffer, the rows quantized once per product; past the
  // row path's rows the kernel's float path is the tile (path 0), so path 1 is skipped
  const bool row_path = m <= ferrox_k_avx512::kRowPathRows;
  std::vector<uint8_t> int_buf(std::max(m * ferrox_k_vnni::IntRowBytes(k), ferrox_k_vnni::Int16RowsBytes(m, k)) + 64);
  // path 5's second call's scale table (its rows from kIntRows)
  std::vector<float> rest_table(k / kSuper * 16 + 16);
  float* rest_at = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(rest_table.data()) + 63) & ~uintptr_t{63});
  uint8_t* int_at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(int_buf.data()) + 63) & ~uintptr_t{63});
  // 9 to 15 rows (kIntRows < m): the one-row design takes no more than kIntRows rows (path 2
  // skipped); the prompt-chunk path (block_matmul_k_i16.inc, its 16-lane row group padded) is
  // path 4, and the 16-bit weights as two calls, kIntRows rows then the rest (each decoding the
  // super-blocks again), path 5
  const bool many = m > ferrox_k_vnni::kIntRows;
  std::vector<uint8_t> wide_buf(many ? ferrox_k_vnni::WideKBytes(m, k) + 64 : 0);
  uint8_t* wide_at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide_buf.data()) + 63) & ~uintptr_t{63});
  // 1 to 8 rows: the rows-in-lanes path (block_matmul_k_rows8.inc), path 6, its time including
  // the int16 quantization and the lanes' layout
  std::vector<uint8_t> lane_buf(ferrox_k_vnni::Lane8Bytes(k) + 64);
  uint8_t* lane_at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(lane_buf.data()) + 63) & ~uintptr_t{63});
  constexpr int kPaths = 7;
  double best_probe = 0, best[3][kPaths] = {}, best_quant = 1e9, best_quant16 = 1e9, best_quant_wide = 1e9;
  double max_diff[3][kPaths] = {};
  std::vector<float> out(m * n), tile_out(m * n);
  for (int round = 0; round < rounds; ++round) {
    best_probe = std::max(best_probe, bench::ProbeBest(team, probe_at, threads));
    for (int fi = 0; fi < 3; ++fi) {
      const int64_t bytes = n * k / kSuper * SuperBytes(fmts[fi]);
      for (int path = 0; path < kPaths; ++path) {
        if (path == 1 && !row_path) continue;
        if ((path == 2 && many) || (path >= 4 && path <= 5 && !many) || (path == 6 && many)) continue;
        float* o = path ? out.data() : tile_out.data();
        for (int64_t c = 0; c < copies[fi]; ++c) {
          const Problem p{x.data(), weights[fi].data() + c * bytes, o, m, n, k};
          double s = 0;
          ferrox_k_vnni::IntRows xr{};
          ferrox_k_vnni::Int16Rows xr16{}, head{}, rest{};
          ferrox_k_vnni::WideRowsK xw{};
          ferrox_k_vnni::Lane8Rows xl{};
          if (path >= 2) {  // the caller quantizes the rows once, then the threads share them
            const auto q0 = std::chrono::steady_clock::now();
            if (path == 2) xr = ferrox_k_vnni::QuantizeIntRows(x.data(), m, k, int_at);
            else if (path == 4) xw = ferrox_k_vnni::QuantizeWideK(x.data(), m, k, wide_at);
            else xr16 = ferrox_k_vnni::QuantizeInt16Rows(x.data(), m, k, int_at);
            if (path == 6) xl = ferrox_k_vnni::LayLane8Rows(xr16, k, lane_at, fmts[fi] != kQ4_K, fmts[fi] == kQ4_K);
            s = std::chrono::duration<double>(std::chrono::steady_clock::now() - q0).count();
            double& bq = path == 2 ? best_quant : path == 4 ? best_quant_wide : best_quant16;
            bq = std::min(bq, s);
          }
          const int64_t first = ferrox_k_vnni::kIntRows;
          if (path == 5) {  // the same quantized rows as two products
            head.m = first, rest.m = m - first;
            for (int64_t r = 0; r < m; ++r) (r < first ? head.row[r] : rest.row[r - first]) = xr16.row[r];
            head.scale_t = xr16.scale_t;  // lanes from kIntRows unused by its 8 rows
            ferrox_k_vnni::FillScaleTable(&rest, k, rest_at);
          }
          const Problem p_head{x.data(), p.w, o, first, n, k}, p_rest{x.data() + first * k, p.w, o + first * n, m - first, n, k};
          s += team.Time([&](int t) {
            const int64_t begin = std::min(n, t * per_thread), end = t == threads - 1 ? n : std::min(n, begin + per_thread);
            if (path == 5) {
              ferrox_k_vnni::W16Run(fmts[fi], p_head, head, begin, end);
              ferrox_k_vnni::W16Run(fmts[fi], p_rest, rest, begin, end);
            } else if (path == 4) ferrox_k_vnni::WideRunK(fmts[fi], p, xw, begin, end);
            else if (path == 6) ferrox_k_vnni::L8Run(fmts[fi], p, xl, begin, end);
            else if (path == 3) ferrox_k_vnni::W16Run(fmts[fi], p, xr16, begin, end);
            else if (path == 2) ferrox_k_vnni::IntRun(fmts[fi], p, xr, begin, end);
            else ferrox_k_avx512::Run(fmts[fi], p, begin, end, path ? ferrox_k_avx512::kRowPathRows : 0);
          });
          best[fi][path] = std::max(best[fi][path], bytes / s / 1e9);
          if (path >= 1 && c == copies[fi] - 1) {
            // the paths' difference on the last copy (the one tile_out holds)
            for (int64_t i = 0; i < m * n; ++i)
              max_diff[fi][path] = std::max<double>(max_diff[fi][path], std::fabs(out[i] - tile_out[i]) / (std::fabs(tile_out[i]) + 1.0));
          }
        }
      }
    }
  }
  std::printf("DRAM read probe, %d threads: %.1f GB/s (best of %d)\n", threads, best_probe, rounds);
  for (int fi = 0; fi < 3; ++fi) {
    // the path serving these rows today: the row path (1 to 3 rows), the tile from 4
    const int served = row_path ? 1 : 0;
    if (row_path)
      std::printf("%s, %ld row(s) x [%ld -> %ld], %d threads: tile path %.1f GB/s, row path %.1f GB/s "
                  "(%.0f%% of the probe), %.2fx; max |row - tile| / (|tile| + 1) %.2g\n",
                  names[fi], static_cast<long>(m), static_cast<long>(k), static_cast<long>(n), threads, best[fi][0],
                  best[fi][1], 100 * best[fi][1] / best_probe, best[fi][1] / best[fi][0], max_diff[fi][1]);
    else
      std::printf("%s, %ld row(s) x [%ld -> %ld], %d threads: tile path %.1f GB/s (%.0f%% of the probe), "
                  "%.1f rows x GB/s\n",
                  names[fi], static_cast<long>(m), static_cast<long>(k), static_cast<long>(n), threads, best[fi][0],
                  100 * best[fi][0] / best_probe, m * best[fi][0]);
    if (many) {
      const char* what[3] = {"int16-weight path, one call", "prompt-chunk path (16 lanes)", "int16-weight path, two calls"};
      for (int path = 3; path < kPaths; ++path)
        std::printf("  %s %s %.1f GB/s (%.0f%% of the probe), %.1f rows x GB/s, %.2fx the tile path; "
                    "max |path - tile| / (|tile| + 1) %.2g\n",
                    names[fi], what[path - 3], best[fi][path], 100 * best[fi][path] / best_probe, m * best[fi][path],
                    best[fi][path] / best[fi][0], max_diff[fi][path]);
      continue;
    }
    std::printf("  %s integer path %.1f GB/s (%.0f%% of the probe), %.1f rows x GB/s, %.2fx the %s path; "
                "max |int - tile| / (|tile| + 1) %.2g\n",
                names[fi], best[fi][2], 100 * best[fi][2] / best_probe, m * best[fi][2], best[fi][2] / best[fi][served],
                row_path ? "row" : "tile", max_diff[fi][2]);
    std::printf("  %s int16-weight path %.1f GB/s (%.0f%% of the probe), %.1f rows x GB/s, %.2fx the %s path, "
                "%.2fx the integer path; max |int16 - tile| / (|tile| + 1) %.2g\n",
                names[fi], best[fi][3], 100 * best[fi][3] / best_probe, m * best[fi][3], best[fi][3] / best[fi][served],
                row_path ? "row" : "tile", best[fi][3] / best[fi][2], max_diff[fi][3]);
    std::printf("  %s rows-in-lanes path %.1f GB/s (%.0f%% of the probe), %.1f rows x GB/s, %.2fx the int16-weight "
                "path; max |lanes - tile| / (|tile| + 1) %.2g\n",
                names[fi], best[fi][6], 100 * best[fi][6] / best_probe, m * best[fi][6], best[fi][6] / best[fi][3],
                max_diff[fi][6]);
  }
  if (many)
    std::printf("  quantizing the %ld rows, int16: %.1f us, prompt-chunk int16: %.1f us (best)\n", static_cast<long>(m),
                best_quant16 * 1e6, best_quant_wide * 1e6);
  else
    std::printf("  quantizing the %ld row(s): %.1f us, int16: %.1f us (best)\n", static_cast<long>(m), best_quant * 1e6,
                best_quant16 * 1e6);
}
