// One side of kquant_ab.cc: the K-quant kernel's 2-15-row path (block_matmul_k_rows16.inc) of
// one tree, compiled with -I <tree>/models/kernels and -DKQ_SIDE=<name> (kquant_ab.sh builds
// it twice, the old tree's and this one's, so both run in one process, alternated).
#include "block_matmul_k_builds.h"

#ifndef KQ_SIDE
#error "build with -DKQ_SIDE=<name>"
#endif

namespace KQ_SIDE {

// x [m, k] quantized into buf (Bytes(m, k), 64-byte aligned) and kept in `rows`.
int64_t Bytes(int64_t m, int64_t k) { return ferrox_k_vnni::Int16RowsBytes(m, k); }

void Quantize(const float* x, int64_t m, int64_t k, uint8_t* buf, void* rows) {
  *static_cast<ferrox_k_vnni::Int16Rows*>(rows) = ferrox_k_vnni::QuantizeInt16Rows(x, m, k, buf);
}

// Columns [begin, end) of out [m, n] = x @ dequantize(w)^T from the quantized rows.
void Run(int fmt, const void* rows, const float* x, const uint8_t* w, float* out, int64_t m, int64_t n, int64_t k,
         int64_t begin, int64_t end) {
  const Problem p{x, w, out, m, n, k};
  ferrox_k_vnni::W16Run(fmt, p, *static_cast<const ferrox_k_vnni::Int16Rows*>(rows), begin, end);
}

}  // namespace KQ_SIDE
