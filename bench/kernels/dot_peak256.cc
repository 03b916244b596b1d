// Probe, not a kernel path: what AVX2 code can multiply-add a second on this CPU, per thread
// and with every thread at once, for the three ways a many-row product can run without
// AVX-512 (a CPU without it, or FERROX_CPU_ISA=avx2):
//   float32 FMA                     8 multiply-adds an instruction (ferrox's float panels);
//   vpmaddwd + vpaddd               16 per instruction pair (16-bit activations, ferrox's
//                                   accuracy: error <= amax / 65534 of a super-block);
//   vpmaddubsw + vpmaddwd + vpaddd  32 per three (8-bit activations: llama.cpp's Q8_K / Q8_0).
// Each first as bare dependent chains (12, enough to cover the latency: the issue rate), then
// as the register tile a kernel would run over operands in L1 (loads, broadcasts and the
// per-block float step included): the float panel's 3 rows x 4 columns (panel256.inc), and a
// 16-bit tile of 2 row groups (rows in the 8 lanes) x 3 columns with each 32-wide block's int32
// dot converted and added in float, as block_matmul_k_i16.inc does with vpdpwssd.
// docs/benchmarks.md ("The AVX2 instruction set") has what it showed on the Xeon.
//   c++ -O3 -march=haswell -pthread bench/kernels/dot_peak256.cc -o /tmp/dot_peak256 && /tmp/dot_peak256 [rounds]
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "bench_team.h"

namespace {
constexpr long kIters = 20'000'000;
constexpr int kChains = 12;

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bare chains: multiply-adds a second. The float chains are 12 FMAs on constants (latency 4,
// two ports); the integer ones 8 vpaddd chains (latency 1) fed by products of 4 operands
// renewed every iteration and 2 constants, so no product is hoisted or shared between chains
// and everything stays in the 16 registers.
template <int Op>
__attribute__((noinline)) double Chains() {
  constexpr int kInt = 8;
  __m256i a[kInt], x[4];
  const __m256i y[2] = {_mm256_set1_epi16(5), _mm256_set1_epi16(7)}, ones = _mm256_set1_epi16(1);
  __m256 f[kChains];
  __m256 fx = _mm256_set1_ps(1.0001f), fy = _mm256_set1_ps(0.9999f);
  for (int i = 0; i < kInt; ++i) a[i] = _mm256_set1_epi32(i);
  for (int i = 0; i < 4; ++i) x[i] = _mm256_set1_epi16(static_cast<int16_t>(i + 3));
  for (int i = 0; i < kChains; ++i) f[i] = _mm256_set1_ps(static_cast<float>(i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) {
    if constexpr (Op == 0) {
#pragma GCC unroll 12
      for (int j = 0; j < kChains; ++j) f[j] = _mm256_fmadd_ps(f[j], fx, fy);
      asm volatile("" : "+x"(fx));
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < kInt; ++j) {
        const __m256i p = Op == 1 ? _mm256_madd_epi16(x[j % 4], y[j / 4])
                                  : _mm256_madd_epi16(_mm256_maddubs_epi16(x[j % 4], y[j / 4]), ones);
        a[j] = _mm256_add_epi32(a[j], p);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) asm volatile("" : "+x"(x[j]));
    }
  }
  const double s = Seconds(t0);
  int sink = 0;
  alignas(32) int32_t v[8];
  alignas(32) float w[8];
  for (int i = 0; i < kInt; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(v), a[i]), sink += v[0];
  for (int i = 0; i < kChains; ++i) _mm256_store_ps(w, f[i]), sink += static_cast<int>(w[0]);
  if (sink == 42) std::puts("");
  constexpr int kMacs[3] = {8, 16, 32};
  return static_cast<double>(kIters) * (Op == 0 ? kChains : kInt) * kMacs[Op] / s;
}

// Register tiles over operands in L1 (64 blocks of activations and weights, cycled).
alignas(64) float g_xf[3 * 512], g_wf[4 * 512];
alignas(64) int32_t g_x16[64 * 2 * 128], g_w16[64 * 3 * 16];

// Uses a tile's sums, so that the loop computing them is kept.
template <int R, int C>
void Keep(const __m256 (&acc)[R][C]) {
  float sink = 0;
  alignas(32) float v[8];
  for (auto& r : acc)
    for (auto& a : r) _mm256_store_ps(v, a), sink += v[0];
  if (sink == 42) std::puts("");
}

__attribute__((noinline)) double FloatTile() {  // 3 rows x 4 columns, 8 inputs a step
  __m256 acc[3][4];
  for (auto& r : acc)
    for (auto& a : r) a = _mm256_setzero_ps();
  constexpr long kSteps = 100'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kSteps; ++i) {
    const long o = (i & 63) * 8;
    __m256 xv[3];
#pragma GCC unroll 3
    for (int r = 0; r < 3; ++r) xv[r] = _mm256_load_ps(g_xf + r * 512 + o);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 w = _mm256_load_ps(g_wf + j * 512 + o);
#pragma GCC unroll 3
      for (int r = 0; r < 3; ++r) acc[r][j] = _mm256_fmadd_ps(w, xv[r], acc[r][j]);
    }
  }
  const double s = Seconds(t0);
  Keep(acc);
  return kSteps * 12.0 * 8 / s;
}

__attribute__((noinline)) double Int16Tile() {  // 2 groups of 8 rows x 3 columns, blocks of 32
  __m256 part[2][3];
  for (auto& g : part)
    for (auto& p : g) p = _mm256_setzero_ps();
  constexpr long kBlocks = 20'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long b = 0; b < kBlocks; ++b) {
    __m256i dot[2][3];
    for (auto& g : dot)
      for (auto& d : g) d = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {  // a block's 16 pairs
      __m256i xv[2];
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g)
        xv[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g_x16 + ((b & 63) * 2 + g) * 128 + 8 * j));
#pragma GCC unroll 3
      for (int c = 0; c < 3; ++c) {
        const __m256i w = _mm256_set1_epi32(g_w16[((b & 63) * 3 + c) * 16 + j]);
#pragma GCC unroll 2
        for (int g = 0; g < 2; ++g) dot[g][c] = _mm256_add_epi32(dot[g][c], _mm256_madd_epi16(xv[g], w));
      }
    }
    for (int g = 0; g < 2; ++g)
      for (int c = 0; c < 3; ++c) part[g][c] = _mm256_add_ps(part[g][c], _mm256_cvtepi32_ps(dot[g][c]));
  }
  const double s = Seconds(t0);
  Keep(part);
  return kBlocks * 16.0 * 2 * 3 * 8 * 2 / s;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  for (int i = 0; i < 3 * 512; ++i) g_xf[i] = 1e-3f * static_cast<float>(i % 97);
  for (int i = 0; i < 4 * 512; ++i) g_wf[i] = 1e-3f * static_cast<float>(i % 89);
  for (int i = 0; i < 64 * 2 * 128; ++i) g_x16[i] = (i * 7) & 0x3fff3fff;
  for (int i = 0; i < 64 * 3 * 16; ++i) g_w16[i] = (i * 3) & 0x03ff03ff;
  struct Row {
    const char* name;
    double (*f)();
  };
  const Row rows[] = {
      {"chains: vfmadd ps ymm (float32, 8 MAC)", Chains<0>},
      {"chains: vpmaddwd + vpaddd (16-bit, 16 MAC)", Chains<1>},
      {"chains: vpmaddubsw + vpmaddwd + vpaddd (8-bit, 32)", Chains<2>},
      {"tile: float 3 rows x 4 cols over L1", FloatTile},
      {"tile: 16-bit 2 x 8 rows x 3 cols over L1", Int16Tile},
  };
  for (int threads : {1, cores})
    for (const Row& row : rows)
      std::printf("%d thread%s  %-52s %7.1f GMAC/s\n", threads, threads > 1 ? "s" : " ", row.name,
                  bench::BestSummedRate(row.f, threads, rounds) / 1e9);
  return 0;
}
