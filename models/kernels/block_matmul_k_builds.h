// The K-quant kernel's body (block_matmul_k_body.inc) built once per ISA: the operands'
// constants and `Problem`, then the body compiled for AVX2 + FMA + F16C (namespace
// ferrox_k_avx2) and for AVX-512 (ferrox_k_avx512: F for the float tiles, BW for the
// one-row path's byte work), and the VNNI build of the 16-bit integer paths (ferrox_k_vnni:
// one row, block_matmul_k_rowint.inc; 2 to 15 rows, block_matmul_k_rows16.inc, 7 and 8 rows
// block_matmul_k_rows8.inc; 16 rows and more, block_matmul_k_i16.inc). Included by
// block_matmul_k.cc and by the kernel's harnesses (bench/kernels/kquant_stream.cc,
// kquant_prefill.cc), which need no XLA.

#ifndef FERROX_MODELS_KERNELS_BLOCK_MATMUL_K_BUILDS_H_
#define FERROX_MODELS_KERNELS_BLOCK_MATMUL_K_BUILDS_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int kQ4_K = 3, kQ5_K = 4, kQ6_K = 5;
constexpr int64_t kSuper = 256;

constexpr int SuperBytes(int fmt) { return fmt == kQ4_K ? 144 : fmt == kQ5_K ? 176 : 210; }

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, row bytes]
  float* out;        // [M, N]
  int64_t m, n, k;
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace ferrox_k_avx2 {
#define FERROX_K_AVX512 0
#include "block_matmul_k_body.inc"
#undef FERROX_K_AVX512
#include "block_matmul_k_row256.inc"  // 1 to 8 rows on 16-bit integer activations
}  // namespace ferrox_k_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw")
namespace ferrox_k_avx512 {
#define FERROX_K_AVX512 1
#include "block_matmul_k_body.inc"
#undef FERROX_K_AVX512
}  // namespace ferrox_k_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace ferrox_k_vnni {
#include "block_matmul_k_rowint.inc"
#include "block_matmul_k_rows16.inc"
#include "block_matmul_k_rows8.inc"  // 7 and 8 rows, the rows in the lanes
#include "block_matmul_k_rows8_bytes.inc"  // (Q4_K there on byte products)
#include "block_matmul_k_i16.inc"  // many rows on 16-bit integer activations
}  // namespace ferrox_k_vnni
#pragma GCC pop_options

#endif  // FERROX_MODELS_KERNELS_BLOCK_MATMUL_K_BUILDS_H_
