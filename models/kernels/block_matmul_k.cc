// Projections on GGUF's K-quant super-blocks, as shipped: out = x @ dequantize(w)^T.
//
// Operands (row-major; models/gguf_kquants.py lays them out):
//   x    f32[M, K]           activations, K a multiple of 256
//   w    u8[N, K/256 * B]    one output channel per row, its K inputs as K / 256 super-blocks
//                            of B bytes, exactly the bytes of the file (ggml's structs):
//     Q4_K (B 144): f16 d, f16 dmin, u8 scales[12], u8 qs[128]
//     Q5_K (B 176): f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
//     Q6_K (B 210): u8 ql[128], u8 qh[64], s8 scales[16], f16 d
//   out  f32[M, N]
// Q4_K / Q5_K: eight 32-wide sub-blocks s with 6-bit scale sc_s and min m_s packed in
//   `scales` (get_scale_min_k4); w = d sc_s q - dmin m_s, q the 4-bit value (Q5_K: plus
//   16 times bit s of qh[l]). Bytes 32c .. 32c + 31 of qs hold sub-block 2c in their low
//   nibbles and 2c + 1 in their high nibbles.
// Q6_K: sixteen 16-wide sub-blocks with int8 scales; w = d sc q, q in [-32, 31] from a
//   nibble of ql and two bits of qh (each 128-weight half: weight 32k + l takes ql[l]
//   (k 0, 2) or ql[32 + l] (k 1, 3), low nibble for k < 2, and bits 2k, 2k + 1 of qh[l]).
// Attributes: fmt (3 Q4_K, 4 Q5_K, 5 Q6_K); wide_rows 1: a product of 1 to kW16Rows (15) rows
// runs on 16-bit integer activations where the CPU has AVX-512 VNNI (one row
// block_matmul_k_rowint.inc, 7 and 8 block_matmul_k_rows8.inc, the other rows to 15
// block_matmul_k_rows16.inc), and so do products of
// kWideRowsK (16) rows and more (prompt chunks: block_matmul_k_i16.inc, 32-wide int16 activation
// blocks, error <= amax / 65534 of a block); any other value, or another CPU: the float paths. int_rows and
// amx_rows are accepted for the shared call signature of models/gguf_blocks.py and ignored.
//
// The float paths: float32 activations times the super-blocks dequantized in
// registers, 16 weights at a time (w = a q + b, one FMA from the group's integers; on
// AVX-512 from 16 rows into an L1 panel once for all rows), accumulated in float32. That
// is the float32 product of the dequantized weights up to float32 rounding
// (tests/models/test_block_matmul_k.py checks it against float64).
// One to three rows (a decode step's) on AVX-512 take the row path instead
// (block_matmul_k_row512.inc): each weight row read once, front to back, its weights made by
// permuting a per-sub-block table of the sub-block's possible values (Q4_K / Q5_K) or from 128
// quants assembled at once (Q6_K): the same dequantized weights, ~1.5x (Q4_K, Q5_K) and
// ~1.15x (Q6_K) the tile's rate at one row (docs/benchmarks.md).
// With wide_rows 1 on AVX-512 VNNI a product of 1 to kW16Rows rows (a decode step's)
// instead quantizes its activation rows once per call (two int8 parts per 256 inputs: error
// <= amax / 64516 of the super-block, the 16-bit accuracy of the block kernel's int16 path)
// and multiplies the quants as integers (vpmaddubsw + vpdpwssd with the sub-block scales,
// the mins through the exact float sums of the activations), each super-block decoded once
// for all rows: at one row 1.5-2.2x the float row path through DRAM
// (block_matmul_k_rowint.inc, docs/benchmarks.md).
// Which ISA: AVX-512F + BW where cpuid has them, AVX2 + FMA + F16C elsewhere
// (block_matmul_k_body.inc, compiled once per ISA in block_matmul_k_builds.h);
// FerroxBlockMatmulKAvx2 forces the AVX2 build so tests on an AVX-512 host check both. Columns are shared over XLA's intra-op pool (parallel.h); one thread
// computes each output element whole, so results do not depend on the sharing.
// FerroxBlockMatmulKMulti multiplies 2 or 3 weights of the same x (a layer's q/k/v, its
// gate/up; formats may differ) in one call, their columns shared over the pool as one
// problem: the same values as one call per weight, with 4 calls a layer instead of 7.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "block_matmul_k_builds.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 2: AVX-512F + BW, 1: AVX2 + FMA + F16C, 0: neither (the caller keeps XLA).
int DetectIsa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
  return avx2 ? 1 : 0;
}

const int kIsa = std::min(DetectIsa(), ferrox::IsaCap());
// The integer path's vpdpwssd (on top of the AVX-512 F + BW build).
const bool kVnni = kIsa == 2 && __builtin_cpu_supports("avx512vnni");

// Below this many multiply-adds a product runs on the calling thread alone.
constexpr int64_t kParallelMacs = 1 << 18;

// One weight's operands checked and described as a Problem (`what` names the handler).
ffi::Error CheckOperands(const char* what, const ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8> w, float* out,
                         int32_t fmt, int isa, Problem* problem) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(what) + ": x must be [M, K] and w [N, row bytes]");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if (fmt < kQ4_K || fmt > kQ6_K) return ffi::Error::InvalidArgument(std::string(what) + ": unknown fmt");
  if (k % kSuper != 0 || wd[1] != k / kSuper * SuperBytes(fmt))
    return ffi::Error::InvalidArgument(std::string(what) + ": w's row bytes do not match K / 256 super-blocks");
  if (isa == 0) return ffi::Error::Internal(std::string(what) + ": this CPU has no AVX2 + FMA + F16C");
  *problem = Problem{x.typed_data(), w.typed_data(), out, m, n, k};
  return ffi::Error::Success();
}

// The products of one call: outs[i] = x @ dequantize(ws[i])^T for `count` weights of the
// same x (the multi-weight handler fuses q/k/v and gate/up this way; one weight is the
// plain call). The columns of all of them are shared over the pool as one problem: one
// fork and join a call instead of one a weight, and no thread idles at a weight's end
// while the other finishes it. Each output element is computed exactly as a one-weight call
// computes it (one thread, whole, the same order), so fusing changes no value.
// wide_rows 1: products of up to kW16Rows rows on the integer paths where they run, and
// products of kWideRowsK rows or more on the 16-bit path (x's rows quantized here, once for
// every weight of the call: they share x).
ffi::Error RunProducts(ffi::ThreadPool& pool, const Problem* ps, const int32_t* fmts, int64_t count, int isa,
                       int32_t wide_rows) {
  int64_t macs = 0, n_total = 0;
  for (int64_t i = 0; i < count; ++i) macs += ps[i].m * ps[i].n * ps[i].k, n_total += ps[i].n;
  const int64_t m = ps[0].m, k = ps[0].k;
  const bool vnni = isa == 2 && kVnni && wide_rows == 1;
  // kW16FromRows to kW16Rows rows, and one row of kW16FromK inputs or more: the weights as
  // 16-bit integers, once for all rows (block_matmul_k_rows16.inc); else one row on the
  // one-row integer path (block_matmul_k_rowint.inc)
  const bool w16 = vnni && (m >= ferrox_k_vnni::kW16FromRows || k >= ferrox_k_vnni::kW16FromK) &&
                   m <= ferrox_k_vnni::kW16Rows;
  const bool int_row = vnni && (w16 || m < ferrox_k_vnni::kW16FromRows);
  // kL8FromRows to kL8Rows rows: the same 16-bit rows laid out in the lanes of a vector
  // (block_matmul_k_rows8.inc)
  const bool lanes8 = w16 && m >= ferrox_k_vnni::kL8FromRows && m <= ferrox_k_vnni::kL8Rows;
  std::vector<uint8_t> int_buf;
  ferrox_k_vnni::IntRows xr{};
  ferrox_k_vnni::Int16Rows xr16{};
  ferrox_k_vnni::Lane8Rows xl{};
  if (lanes8) {
    xl = ferrox_k_vnni::QuantizeLane8Rows(ps[0].x, m, k, fmts, count, &int_buf);
  } else if (int_row) {
    int_buf.resize((w16 ? ferrox_k_vnni::Int16RowsBytes(m, k) : m * ferrox_k_vnni::IntRowBytes(k)) + 64);
    uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(int_buf.data()) + 63) & ~uintptr_t{63});
    if (w16) xr16 = ferrox_k_vnni::QuantizeInt16Rows(ps[0].x, m, k, at);
    else xr = ferrox_k_vnni::QuantizeIntRows(ps[0].x, m, k, at);
  }
  // many rows (prompt chunks) on 16-bit integer activations (block_matmul_k_i16.inc); past whole
  // 16-row groups, a last kL8FromRows to kL8Rows rows (a c8 mixed step: a 128-token chunk and 7
  // decode rows) take the lanes path, at the decode rows' accuracy (S per 256), instead of a
  // 16-lane group of their own: about half its time. One thread from L2, [2048 -> 1024], best of
  // 15 alternated: 135 rows Q4_K 1.064x, Q6_K 1.028x; 136 rows 1.083x / 1.067x.
  // AVX2: 1 to kIntRows256 rows on 16-bit integer activations (block_matmul_k_row256.inc)
  const bool int256 = isa == 1 && wide_rows == 1 && m <= ferrox_k_avx2::kIntRows256;
  std::vector<uint8_t> int256_buf(int256 ? m * ferrox_k_avx2::IntRow256Bytes(k) + 64 : 0);
  const auto x256 = int256 ? ferrox_k_avx2::QuantizeIntRows256(
                                 ps[0].x, m, k,
                                 reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(int256_buf.data()) + 63) &
                                                            ~uintptr_t{63}))
                           : ferrox_k_avx2::IntRows256{};
  const bool wide = isa == 2 && kVnni && wide_rows == 1 && m >= ferrox_k_vnni::kWideRowsK;
  const int64_t rest = m % ferrox_k_vnni::kWideLanesK;
  const int64_t tail = wide && rest >= ferrox_k_vnni::kL8FromRows && rest <= ferrox_k_vnni::kL8Rows ? rest : 0;
  const int64_t wide_m = m - tail;
  std::vector<uint8_t> wide_buf(wide ? ferrox_k_vnni::WideKBytes(wide_m, k) : 0);
  uint8_t* wide_at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide_buf.data()) + 63) & ~uintptr_t{63});
  const auto xw = wide ? ferrox_k_vnni::QuantizeWideK(ps[0].x, wide_m, k, wide_at) : ferrox_k_vnni::WideRowsK{};
  std::vector<uint8_t> tail_buf;
  const auto xt = tail ? ferrox_k_vnni::QuantizeLane8Rows(ps[0].x + wide_m * k, tail, k, fmts, count, &tail_buf)
                       : ferrox_k_vnni::Lane8Rows{};
  const int64_t threads = macs >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  // 4 chunks per thread balance uneven progress; chunks are whole tiles of one weight (4
  // columns, 8 on the lanes path; a weight's last chunk may be short).
  const int64_t target = threads * 4, tile = lanes8 ? ferrox_k_vnni::kL8Cols : 4;
  const int64_t chunk = std::max<int64_t>(tile, ((n_total + target - 1) / target + tile - 1) / tile * tile);
  int64_t first[4] = {0, 0, 0, 0};  // the first task of each weight (count <= 3)
  int64_t tasks = 0;
  for (int64_t i = 0; i < count; ++i) first[i] = tasks, tasks += (ps[i].n + chunk - 1) / chunk;
  ferrox::ParallelFor(pool, threads, tasks, [ps, fmts, count, &first, chunk, isa, int_row, w16, &xr,
                                              &xr16, wide, &xw, lanes8, &xl, wide_m, tail, &xt, int256, &x256](int64_t t) {
    int64_t i = count - 1;
    while (t < first[i]) --i;
    const Problem& p = ps[i];
    const int64_t begin = (t - first[i]) * chunk, end = std::min(p.n, begin + chunk);
    if (wide) {
      ferrox_k_vnni::WideRunK(fmts[i], Problem{p.x, p.w, p.out, wide_m, p.n, p.k}, xw, begin, end);
      if (tail)
        ferrox_k_vnni::L8Run(fmts[i], Problem{p.x + wide_m * p.k, p.w, p.out + wide_m * p.n, tail, p.n, p.k}, xt,
                             begin, end);
    } else if (lanes8) ferrox_k_vnni::L8Run(fmts[i], p, xl, begin, end);
    else if (w16) ferrox_k_vnni::W16Run(fmts[i], p, xr16, begin, end);
    else if (int_row) ferrox_k_vnni::IntRun(fmts[i], p, xr, begin, end);
    else if (int256) ferrox_k_avx2::IntRun256(fmts[i], p, x256, begin, end);
    else if (isa == 2) ferrox_k_avx512::Run(fmts[i], p, begin, end, ferrox_k_avx512::kRowPathRows);
    else ferrox_k_avx2::Run(fmts[i], p, begin, end, 0);
  });
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& w,
                  ffi::ResultBuffer<ffi::F32>& out, int32_t fmt, int isa, int32_t wide_rows) {
  Problem p{};
  if (ffi::Error e = CheckOperands("ferrox_block_matmul_k", x, w, out->typed_data(), fmt, isa, &p); e.failure())
    return e;
  return RunProducts(pool, &p, &fmt, 1, isa, wide_rows);
}

ffi::Error BlockMatmulKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                            ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int32_t /*int_rows*/,
                            int32_t wide_rows, int32_t /*amx_rows*/) {
  return Matmul(pool, x, w, out, fmt, kIsa, wide_rows);
}

ffi::Error BlockMatmulKAvx2Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                                ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int32_t /*int_rows*/,
                                int32_t wide_rows, int32_t /*amx_rows*/) {
  return Matmul(pool, x, w, out, fmt, std::min(kIsa, 1), wide_rows);
}

// x, then 2 or 3 weights of any K-quant formats; as many outputs, outs[i] f32[M, N_i];
// fmts[i] the format of ws[i]. q/k/v of a Q4_K_M file mix Q4_K and Q6_K: one call still.
ffi::Error BlockMatmulKMultiImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                                 ffi::RemainingRets outs, ffi::Span<const int32_t> fmts, int32_t /*int_rows*/,
                                 int32_t wide_rows, int32_t /*amx_rows*/) {
  constexpr const char* kWhat = "ferrox_block_matmul_k_multi";
  const int64_t count = static_cast<int64_t>(ws.size());
  if (count < 2 || count > 3 || outs.size() != ws.size() || fmts.size() != ws.size())
    return ffi::Error::InvalidArgument("ferrox_block_matmul_k_multi: 2 or 3 weights, as many outputs and fmts");
  Problem ps[3];
  int32_t formats[3];
  for (int64_t i = 0; i < count; ++i) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (out.has_error()) return out.error();
    formats[i] = fmts[i];
    if (ffi::Error e = CheckOperands(kWhat, x, *w, (*out)->typed_data(), formats[i], kIsa, &ps[i]); e.failure())
      return e;
    const auto od = (*out)->dimensions();
    if (od.size() != 2 || od[0] != ps[i].m || od[1] != ps[i].n)
      return ffi::Error::InvalidArgument("ferrox_block_matmul_k_multi: an output is not [M, N] of its weight");
  }
  return RunProducts(pool, ps, formats, count, kIsa, wide_rows);
}

}  // namespace

#define FERROX_K_BINDING                       \
  ffi::Ffi::Bind()                             \
      .Ctx<ffi::ThreadPool>()                  \
      .Arg<ffi::Buffer<ffi::F32>>()            \
      .Arg<ffi::Buffer<ffi::U8>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()            \
      .Attr<int32_t>("fmt")                    \
      .Attr<int32_t>("int_rows")               \
      .Attr<int32_t>("wide_rows")              \
      .Attr<int32_t>("amx_rows")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmulK, BlockMatmulKImpl, FERROX_K_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmulKAvx2, BlockMatmulKAvx2Impl, FERROX_K_BINDING);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmulKMulti, BlockMatmulKMultiImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("fmts")
                                  .Attr<int32_t>("int_rows")
                                  .Attr<int32_t>("wide_rows")
                                  .Attr<int32_t>("amx_rows"));

// Which build of this kernel runs here: 2 AVX-512F, 1 AVX2, 0 none.
extern "C" int ferrox_block_k_isa() { return kIsa; }
