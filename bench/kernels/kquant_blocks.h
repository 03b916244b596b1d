// What the K-quant harnesses share (kquant_stream.cc, kquant_prefill.cc): random super-blocks
// with finite scales of a real model's size (no slow float paths). Include after
// block_matmul_k_builds.h.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace bench {

inline std::vector<uint8_t> Blocks(int fmt, int64_t bytes, std::mt19937* rng) {
  std::vector<uint8_t> w(bytes);
  for (auto& b : w) b = static_cast<uint8_t>((*rng)());
  const uint16_t d = _cvtss_sh(0.0005f, 0), dmin = _cvtss_sh(0.0004f, 0);
  for (int64_t at = 0; at + SuperBytes(fmt) <= bytes; at += SuperBytes(fmt)) {
    if (fmt == kQ6_K) {
      std::memcpy(&w[at + 208], &d, 2);
    } else {
      std::memcpy(&w[at], &d, 2);
      std::memcpy(&w[at + 2], &dmin, 2);
    }
  }
  return w;
}

}  // namespace bench
