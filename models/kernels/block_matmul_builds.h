// The float and integer paths of block_matmul.cc, built once per ISA: the operands'
// constants and `Problem`, then block_matmul_body.inc compiled for AVX2 (namespace
// ferrox_avx2) and for AVX-512 VL + VNNI (ferrox_avx512). Included by block_matmul.cc and by
// the kernel's one-thread harness (bench/kernels/block_harness.cc), which needs no XLA.

#ifndef FERROX_MODELS_KERNELS_BLOCK_MATMUL_BUILDS_H_
#define FERROX_MODELS_KERNELS_BLOCK_MATMUL_BUILDS_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2;
constexpr int64_t kBlock = 32;

constexpr int64_t BlockBytes(int fmt) { return fmt == kQ4_0 ? 18 : fmt == kQ4_1 ? 20 : 34; }

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, row bytes]
  float* out;        // [M, N]
  int64_t m, n, k;
};

// 16 int32 lanes on a 64-byte boundary (a std::vector of them is aligned storage for
// aligned 512-bit loads).
struct alignas(64) Lanes16 {
  int32_t v[16];
};

// Activations quantized per 32-wide block (M * K / 32 blocks, row-major).
struct QuantizedRows {
  const int8_t* values;  // [M, K]
  const float* scales;   // [M, K / 32]
  const float* sums;     // [M, K / 32]: scale * sum(values) of the block
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace ferrox_avx2 {
#define FERROX_VNNI 0
#include "block_matmul_body.inc"
#undef FERROX_VNNI
}  // namespace ferrox_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace ferrox_avx512 {
#define FERROX_VNNI 1
#include "block_matmul_body.inc"
#undef FERROX_VNNI
}  // namespace ferrox_avx512
#pragma GCC pop_options

// One row on integer dot products with 16-bit-accurate activations (AVX-512 VNNI only).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace ferrox_rowint {
#include "block_matmul_rowint.inc"
}  // namespace ferrox_rowint
#pragma GCC pop_options

// One row on integer dot products with 16-bit-accurate activations, for AVX2 without VNNI.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace ferrox_rowint256 {
#include "block_matmul_rowint256.inc"
}  // namespace ferrox_rowint256
#pragma GCC pop_options

#endif  // FERROX_MODELS_KERNELS_BLOCK_MATMUL_BUILDS_H_
