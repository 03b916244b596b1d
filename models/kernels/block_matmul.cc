// Projections on GGUF's own quantized blocks, as shipped: out = x @ dequantize(w)^T.
//
// Operands (row-major; models/gguf_blocks.py lays them out):
//   x    f32[M, K]          activations
//   w    u8[N, K/32 * B]    one output channel per row, its K inputs as K / 32 GGUF blocks
//                           of B bytes, exactly the bytes of the file:
//                             Q4_0 (B 18): f16 d, u8 qs[16]          w = d * (q - 8)
//                             Q4_1 (B 20): f16 d, f16 m, u8 qs[16]   w = d * q + m
//                             Q8_0 (B 34): f16 d, s8 qs[32]          w = d * q
//                           (Q4: value j in the low nibble of qs[j], j + 16 in the high one)
//   out  f32[M, N]
// Attributes: fmt (0 Q4_0, 1 Q4_1, 2 Q8_0), int_rows (M at or above which the integer
// path runs; 0 never), wide_rows (M at or above which the 16-bit activation path runs on
// the AVX-512 VNNI build, where int_rows does not; 0 never; on AVX2 any value > 0 puts one row
// on its integer dots and changes nothing else), amx_rows (M
// at or above which the AMX-BF16 path runs where the CPU and the OS allow it, before the
// others are looked at; 0 never).
// The multi-weight handler (ferrox_block_matmul_multi) takes x and 2 or 3 weights of the
// same K, returns one output per weight and names their formats in `fmts`: the q/k/v and
// gate/up products of a layer in one call, their columns shared over the pool together
// (per layer of the default model at one row, the separate k and v calls cost ~8.5 µs each
// for 69 KB of weights, mostly a call's start and end).
//
// Five paths, chosen by the row count M:
// - M >= amx_rows on a CPU with AMX-BF16: activations and dequantized blocks split into
//   bf16 hi + lo pairs, three tile products (block_matmul_amx.inc has why and how exact).
// - M >= wide_rows on the AVX-512 VNNI build (and below int_rows): activations in 32-wide
//   int16 blocks, the weights' integers widened to int16, vpdpwssd block dots
//   (block_matmul_i16.inc: one thread, 1.45x the float path at 8 rows, 1.5-1.7x at
//   16-160; activation rounding at most 1/65534 of a block's largest value). From 5 to 12
//   rows the same activation blocks and block terms with rows and columns in the lanes, 4
//   rows x 2 columns a vector (block_matmul_rows16.inc: the same bits, 1.4x the float path
//   at 8 and 12 rows where the 8-lane row groups ran 1.2x; one thread from L2); at 5 to 8
//   rows on the activations' byte halves and vpdpbusd, the same bits again
//   (block_matmul_rows16_halves.inc: no widened weight panel).
// - M == 1 with wide_rows > 0 on the AVX-512 VNNI build (below int_rows): the row split into
//   two int8 parts per 32-wide block, x ~= S (q1 + q2 / 256), vpdpbusd on the weights' own
//   nibbles / bytes (block_matmul_rowint.inc: 1.6-1.7x the float tile from L2 on one thread;
//   activation rounding at most amax / 65024 of a block).
// - M == 1 with wide_rows > 0 on the AVX2 build (a CPU without AVX-512 VNNI): the same split on
//   base 254, vpmaddubsw + vpmaddwd on the weights' own nibbles / bytes, eight blocks' dots
//   reduced into one float step (block_matmul_rowint256.inc; activation rounding at most amax /
//   64516 of a block).
// - M < int_rows: float32 activations times the blocks dequantized in registers
//   (d * q + m, one FMA per 8 weights; from a few rows into an L1 panel, once for all
//   rows: AVX2 from 4 rows, AVX-512 from 5, 16 for Q8_0), accumulated in float32: the
//   float32 product of the dequantized weights up to float32 rounding; nothing but the
//   weights is rounded.
// - M >= int_rows: the activations are quantized in blocks of 32 as llama.cpp's Q8_0 /
//   Q8_1 do (one float32 scale per 32 values, round half to even, and the block's sum for
//   Q4's offset term), then each block pair is one integer dot: VNNI's vpdpbusd where the
//   CPU has AVX-512 VNNI, AVX2's maddubs + madd elsewhere. Per block,
//     d_w * d_x * sum_j q_j x_j  +  m_w * d_x * sum_j x_j      (Q4_0: m_w = -8 d_w)
//   summed over blocks in float32. The integer sums are exact; only the float32 sum of
//   the per-block terms rounds (tests/models/test_block_matmul.py checks both paths against
//   float64 references).
// Which ISA: chosen at run time from cpuid (`ferrox_block_isa`); both builds come from
// block_matmul_body.inc (its integer path in block_matmul_int.inc). Columns are shared
// over XLA's intra-op pool (parallel.h); one thread computes each output element whole, so
// results do not depend on the sharing.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "block_matmul_builds.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-bf16")
namespace ferrox_amx {
#include "block_matmul_amx.inc"
}  // namespace ferrox_amx
#pragma GCC pop_options

namespace {

// AMX-BF16 usable here: cpuid says AMX-TILE, AMX-BF16 and AVX512-BF16, the OS saves the
// tile state (XCR0 bits 17 and 18), and Linux grants this process the tile data.
bool DetectAmx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// 2: AVX-512 VL + VNNI, 1: AVX2 + FMA + F16C, 0: neither (the caller keeps XLA).
int DetectIsa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

const int kIsa = std::min(DetectIsa(), ferrox::IsaCap());
const bool kAmx = kIsa == 2 && ferrox::IsaCap() == 3 && DetectAmx();

// Below this many multiply-adds a product runs on the calling thread alone.
constexpr int64_t kParallelMacs = 1 << 18;

// The AMX path: rows packed into bf16 hi / lo tiles once, then whole 16-channel panels
// shared over the pool (each panel dequantized once, for every row).
ffi::Error RunAmxProduct(ffi::ThreadPool pool, const Problem& p, int fmt, int64_t threads) {
  const int64_t tiles = (p.m + ferrox_amx::kTile - 1) / ferrox_amx::kTile;
  const int64_t bytes = tiles * (p.k / kBlock) * ferrox_amx::kTileBytes;
  std::vector<uint8_t> packed(2 * bytes, 0);
  uint8_t *xh = packed.data(), *xl = packed.data() + bytes;
  ferrox::ParallelFor(pool, std::min<int64_t>(threads, p.m), p.m,
                      [&](int64_t r) { ferrox_amx::PackRow(p.x + r * p.k, p.k, r, xh, xl); });
  const int64_t panels = p.n / ferrox_amx::kTile;
  const int64_t per_task = std::max<int64_t>(1, panels / (threads * 4));
  ferrox::ParallelFor(pool, threads, (panels + per_task - 1) / per_task, [&](int64_t c) {
    const int64_t begin = c * per_task * ferrox_amx::kTile;
    const int64_t end = std::min(p.n, (c + 1) * per_task * ferrox_amx::kTile);
    ferrox_amx::RunAmx(fmt, p, xh, xl, begin, end);
  });
  return ffi::Error::Success();
}

// x [m, k] in 32-wide int8 blocks (the integer path), a row a task, on the build cpuid chose.
struct Int8Activations {
  std::vector<int8_t> values;
  std::vector<float> scales, sums;
  QuantizedRows rows{};

  void Quantize(ffi::ThreadPool& pool, int64_t threads, const float* x, int64_t m, int64_t k) {
    const int64_t blocks = k / kBlock;
    values.resize(m * k);
    scales.resize(m * blocks);
    sums.resize(m * blocks);
    ferrox::ParallelFor(pool, std::min<int64_t>(threads, m), m, [&](int64_t r) {
      if (kIsa == 2)
        ferrox_avx512::QuantizeRowBlocks(x + r * k, k, &values[r * k], &scales[r * blocks], &sums[r * blocks]);
      else
        ferrox_avx2::QuantizeRowBlocks(x + r * k, k, &values[r * k], &scales[r * blocks], &sums[r * blocks]);
    });
    rows = QuantizedRows{values.data(), scales.data(), sums.data()};
  }
};

// x [m, k] in 32-wide int16 blocks (the 16-bit path, AVX-512 VNNI): rows in groups of 8 or
// 16 lanes, a group a task.
struct WideActivations {
  std::vector<Lanes16> pairs;
  std::vector<float> scales, sums;
  ferrox_avx512::WideRows rows{};

  void Quantize(ffi::ThreadPool& pool, int64_t threads, const float* x, int64_t m, int64_t k) {
    const int64_t lanes = ferrox_avx512::WideLanes(m), groups = (m + lanes - 1) / lanes, blocks = k / kBlock;
    pairs.resize(groups * blocks * lanes);  // 16 pairs of `lanes` int32 a block: lanes Lanes16
    scales.resize(groups * blocks * lanes);
    sums.resize(groups * blocks * lanes);
    int32_t* pair_data = pairs.data()->v;
    ferrox::ParallelFor(pool, std::min<int64_t>(threads, groups), groups, [&](int64_t g) {
      ferrox_avx512::QuantizeWideGroup(x, m, k, lanes, g, pair_data, scales.data(), sums.data());
    });
    rows = ferrox_avx512::WideRows{pair_data, scales.data(), sums.data(), lanes};
  }
};

// x [1, k] quantized once, on the calling thread, for a one-row integer path: block_matmul_rowint.inc
// (AVX-512 VNNI) or block_matmul_rowint256.inc (AVX2): 16-bit-accurate int8 pairs per block.
// `Bytes` sizes the path's buffer, `Split` fills it (64-byte aligned).
template <typename Row, int64_t (*Bytes)(int64_t), Row (*Split)(const float*, int64_t, uint8_t*)>
struct OneRow {
  std::vector<uint8_t> buf;
  Row row{};

  void Quantize(const float* x, int64_t k) {
    buf.resize(Bytes(k) + 64);
    uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    row = Split(x, k, at);
  }
};
using OneRowActivations = OneRow<ferrox_rowint::RowIntX, ferrox_rowint::RowIntBytes, ferrox_rowint::QuantizeRowInt>;
using OneRowActivations256 = OneRow<ferrox_rowint256::RowInt256X, ferrox_rowint256::RowInt256Bytes,
                                    ferrox_rowint256::QuantizeRowInt256>;

// x [m, k] for block_matmul_rows16.inc (2 to 15 rows, AVX-512 VNNI): groups of R rows, each
// row in P = 8 / R lanes; a row a task. At 5 to 8 rows every format takes the byte halves
// (block_matmul_rows16_halves.inc) instead of the int16 pairs.
struct Rows16Activations {
  std::vector<Lanes16> pairs, halves;  // 8 Lanes16 (16 slots x 8 lanes) a group and block
  std::vector<float> scales, sums;
  ferrox_avx512::Rows16 rows{};

  void Quantize(ffi::ThreadPool& pool, int64_t threads, const float* x, int64_t m, int64_t k) {
    const int64_t per = ferrox_avx512::Rows16PerGroup(m), groups = (m + per - 1) / per, blocks = k / kBlock;
    const bool use_halves = ferrox_avx512::Rows16TakesHalves(m);
    pairs.resize(use_halves ? 0 : groups * blocks * 8);  // zero: lanes of rows past m
    halves.resize(use_halves ? groups * blocks * 8 : 0);
    scales.resize(groups * blocks * 8);
    sums.resize(groups * blocks * 8);
    int32_t* pair_data = pairs.empty() ? nullptr : pairs.data()->v;
    int32_t* half_data = halves.empty() ? nullptr : halves.data()->v;
    ferrox::ParallelFor(pool, std::min<int64_t>(threads, m), m, [&](int64_t r) {
      ferrox_avx512::QuantizeRows16Row(x, k, per, r, pair_data, scales.data(), sums.data(), half_data);
    });
    rows = ferrox_avx512::Rows16{pair_data, scales.data(), sums.data(), per, half_data};
  }
};

// Products that ran on block_matmul_rows16.inc since the library loaded (the tests' check
// that the path ran: its results are block_matmul_i16.inc's bits).
std::atomic<int64_t> rows16_calls{0};
// Of them, those that took the byte halves (block_matmul_rows16_halves.inc: 5 to 8 rows).
std::atomic<int64_t> rows16_halves_calls{0};

// The products of one call: outs[i] = x @ dequantize(ws[i])^T for `count` weights of the
// same x (the multi-weight handler fuses q/k/v and gate/up this way; one weight is the
// plain call). The columns of all of them are shared over the pool as one problem; the
// integer path quantizes x once. Each output element is computed exactly as a one-weight
// call computes it (one thread, whole, the same order), so fusing changes no value.
ffi::Error RunProducts(ffi::ThreadPool pool, const Problem* ps, const int32_t* fmts, int64_t count, int32_t int_rows,
                       int32_t wide_rows, int32_t amx_rows) {
  const int64_t m = ps[0].m, k = ps[0].k;
  int64_t macs = 0, n_total = 0;
  for (int64_t i = 0; i < count; ++i) macs += m * ps[i].n * k, n_total += ps[i].n;
  const int64_t threads = macs >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;

  if (kAmx && amx_rows > 0 && m >= amx_rows) {
    bool tiles = true;
    for (int64_t i = 0; i < count; ++i) tiles = tiles && ps[i].n % ferrox_amx::kTile == 0;
    if (tiles) {
      for (int64_t i = 0; i < count; ++i) RunAmxProduct(pool, ps[i], fmts[i], threads);
      return ffi::Error::Success();
    }
  }
  // x quantized once for every weight of the call, for the integer or the 16-bit path
  const bool integer = int_rows > 0 && m >= int_rows;
  // one row: block_matmul_rowint.inc wherever the 16-bit path is on
  const bool one_row = !integer && kIsa == 2 && wide_rows > 0 && m == 1;
  // one row on AVX2 without VNNI: block_matmul_rowint256.inc, where wide_rows > 0
  const bool one_row256 = !integer && kIsa == 1 && wide_rows > 0 && m == 1;
  const bool wide = !integer && !one_row && kIsa == 2 && wide_rows > 0 && m >= wide_rows;
  // 2 to 15 rows: rows and columns in the lanes where block_matmul_rows16.inc takes M
  const bool rows16 = wide && m <= 15 && ferrox_avx512::Rows16PerGroup(m) > 0;
  Int8Activations xq;
  WideActivations xw;
  Rows16Activations xr;
  OneRowActivations x1;
  OneRowActivations256 x256;
  if (integer) xq.Quantize(pool, threads, ps[0].x, m, k);
  if (one_row) x1.Quantize(ps[0].x, k);
  if (one_row256) x256.Quantize(ps[0].x, k);
  if (rows16) {
    xr.Quantize(pool, threads, ps[0].x, m, k);
    rows16_calls.fetch_add(1, std::memory_order_relaxed);
    if (xr.rows.halves != nullptr) rows16_halves_calls.fetch_add(1, std::memory_order_relaxed);
  }
  else if (wide) xw.Quantize(pool, threads, ps[0].x, m, k);
  // 4 chunks per thread balance uneven progress; chunks are whole 4-column tiles of one
  // weight (a weight's last chunk may be short).
  const int64_t target = threads * 4;
  const int64_t chunk = std::max<int64_t>(4, ((n_total + target - 1) / target + 3) / 4 * 4);
  int64_t first[4] = {0, 0, 0, 0};  // the first task of each weight (count <= 3)
  int64_t tasks = 0;
  for (int64_t i = 0; i < count; ++i) first[i] = tasks, tasks += (ps[i].n + chunk - 1) / chunk;
  const QuantizedRows* rows = integer ? &xq.rows : nullptr;
  const ferrox_avx512::WideRows* wide_rows_ptr = wide && !rows16 ? &xw.rows : nullptr;
  const ferrox_avx512::Rows16* rows16_ptr = rows16 ? &xr.rows : nullptr;
  const ferrox_rowint::RowIntX* one_row_ptr = one_row ? &x1.row : nullptr;
  const ferrox_rowint256::RowInt256X* one_row256_ptr = one_row256 ? &x256.row : nullptr;
  ferrox::ParallelFor(pool, threads, tasks, [ps, fmts, count, &first, rows, wide_rows_ptr, rows16_ptr, one_row_ptr,
                                             one_row256_ptr, chunk](int64_t t) {
    int64_t i = count - 1;
    while (t < first[i]) --i;
    const Problem& p = ps[i];
    const int64_t begin = (t - first[i]) * chunk, end = std::min(p.n, begin + chunk);
    if (one_row_ptr != nullptr) ferrox_rowint::RowIntRun(fmts[i], p, *one_row_ptr, begin, end);
    else if (one_row256_ptr != nullptr) ferrox_rowint256::RowInt256Run(fmts[i], p, *one_row256_ptr, begin, end);
    else if (rows16_ptr != nullptr) ferrox_avx512::RunRows16(fmts[i], p, *rows16_ptr, begin, end);
    else if (wide_rows_ptr != nullptr) ferrox_avx512::RunWide(fmts[i], p, *wide_rows_ptr, begin, end);
    else if (kIsa == 2) ferrox_avx512::Run(fmts[i], p, rows, begin, end);
    else ferrox_avx2::Run(fmts[i], p, rows, begin, end);
  });
  return ffi::Error::Success();
}

// One weight's operands checked and described as a Problem (`what` names the handler).
ffi::Error CheckOperands(const char* what, const ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8> w, float* out,
                         int32_t fmt, Problem* problem) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(what) + ": x must be [M, K] and w [N, row bytes]");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if (fmt < kQ4_0 || fmt > kQ8_0) return ffi::Error::InvalidArgument(std::string(what) + ": unknown fmt");
  if (k % kBlock != 0 || wd[1] != k / kBlock * BlockBytes(fmt))
    return ffi::Error::InvalidArgument(std::string(what) + ": w's row bytes do not match K / 32 blocks of fmt");
  if (kIsa == 0) return ffi::Error::Internal(std::string(what) + ": this CPU has no AVX2");
  *problem = Problem{x.typed_data(), w.typed_data(), out, m, n, k};
  return ffi::Error::Success();
}

ffi::Error BlockMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int32_t int_rows, int32_t wide_rows,
                           int32_t amx_rows) {
  Problem p{};
  if (ffi::Error e = CheckOperands("ferrox_block_matmul", x, w, out->typed_data(), fmt, &p); e.failure()) return e;
  return RunProducts(pool, &p, &fmt, 1, int_rows, wide_rows, amx_rows);
}

// x, then 2 or 3 weights; as many outputs, outs[i] f32[M, N_i]; fmts[i] the format of ws[i].
ffi::Error BlockMatmulMultiImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                                ffi::RemainingRets outs, ffi::Span<const int32_t> fmts, int32_t int_rows,
                                int32_t wide_rows, int32_t amx_rows) {
  constexpr const char* kWhat = "ferrox_block_matmul_multi";
  const int64_t count = static_cast<int64_t>(ws.size());
  if (count < 2 || count > 3 || outs.size() != ws.size() || fmts.size() != ws.size())
    return ffi::Error::InvalidArgument("ferrox_block_matmul_multi: 2 or 3 weights, as many outputs and fmts");
  Problem ps[3];
  int32_t formats[3];
  for (int64_t i = 0; i < count; ++i) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (out.has_error()) return out.error();
    formats[i] = fmts[i];
    if (ffi::Error e = CheckOperands(kWhat, x, *w, (*out)->typed_data(), formats[i], &ps[i]); e.failure()) return e;
    const auto od = (*out)->dimensions();
    if (od.size() != 2 || od[0] != ps[i].m || od[1] != ps[i].n)
      return ffi::Error::InvalidArgument("ferrox_block_matmul_multi: an output is not [M, N] of its weight");
  }
  return RunProducts(pool, ps, formats, count, int_rows, wide_rows, amx_rows);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmul, BlockMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int32_t>("int_rows")
                                  .Attr<int32_t>("wide_rows")
                                  .Attr<int32_t>("amx_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmulMulti, BlockMatmulMultiImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("fmts")
                                  .Attr<int32_t>("int_rows")
                                  .Attr<int32_t>("wide_rows")
                                  .Attr<int32_t>("amx_rows"));

// Which build of this kernel runs here: 2 AVX-512 VNNI, 1 AVX2, 0 none.
extern "C" int ferrox_block_isa() { return kIsa; }

// How many products block_matmul_rows16.inc has run (tests: that the path ran).
extern "C" int64_t ferrox_block_rows16_calls() { return rows16_calls.load(std::memory_order_relaxed); }

// How many of them took the byte halves.
extern "C" int64_t ferrox_block_rows16_halves_calls() { return rows16_halves_calls.load(std::memory_order_relaxed); }

// Whether the AMX-BF16 path can run here (1) or not (0).
extern "C" int ferrox_block_amx() { return kAmx ? 1 : 0; }
