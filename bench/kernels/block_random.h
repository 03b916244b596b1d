// Random Q4_0 / Q4_1 / Q8_0 blocks for the block kernel's harnesses (block_row_stream.cc,
// block_rowint_stream.cc, block_rows_stream.cc): random quants with finite scales (d 0.01,
// Q4_1's m -0.08), so no product takes a slow path on a NaN or a denormal; Q8_0's quants skip
// -128 (llama.cpp's quantizer never writes it). Include after block_matmul_builds.h.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace bench {

inline std::vector<uint8_t> RandomBlocks(int fmt, int64_t bytes, std::mt19937* rng) {
  std::vector<uint8_t> w(bytes);
  for (auto& b : w) b = static_cast<uint8_t>((*rng)());
  const uint16_t d = _cvtss_sh(0.01f, 0), m = _cvtss_sh(-0.08f, 0);
  for (int64_t at = 0; at + BlockBytes(fmt) <= bytes; at += BlockBytes(fmt)) {
    std::memcpy(&w[at], &d, 2);
    if (fmt == kQ4_1) std::memcpy(&w[at + 2], &m, 2);
    if (fmt == kQ8_0)
      for (int j = 0; j < 32; ++j) w[at + 2 + j] = w[at + 2 + j] == 0x80 ? 0x81 : w[at + 2 + j];
  }
  return w;
}

}  // namespace bench
