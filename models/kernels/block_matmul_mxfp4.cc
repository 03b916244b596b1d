// Projections on MXFP4 blocks (OCP microscaling, llama.cpp's block_mxfp4), as stored:
// out = x @ dequantize(w)^T.
//
// Operands (row-major; models/gguf_mxfp4.py lays them out):
//   x    f32[M, K]           activations, K a multiple of 32
//   w    u8[N, K/32 * 17]    one output channel per row, its K inputs as K / 32 blocks of
//                            17 bytes, ggml's struct: u8 e (E8M0 scale), u8 qs[16]
//   out  f32[M, N]
// Weight j of a block (j < 16) is the low nibble of qs[j], weight j + 16 its high nibble;
// a nibble is an FP4 (E2M1) code, w = kvalues[code] * 2^(e - 128) with ggml's doubled
// table kvalues = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12} (the same as FP4's
// {0, .5, ..., 6} times 2^(e - 127)). Every weight is exact in float32.
// Attributes: fmt (6), int_rows, wide_rows and amx_rows (the shared call signature of
// models/gguf_blocks.py; only the float path exists, so the last three are ignored).
//
// Each block's 16 possible values (the code table times the block's scale: one multiply,
// exact, the scale being a power of two) are made once, and its 32 weights picked from
// them by their nibbles with a lane permute: AVX-512F vpermps over all 16 (one register
// holds the table), AVX2 vpermps over the 8 magnitudes with the sign bit (bit 3 of the
// code) xored in. Then one FMA per 16 (8) weights and row: the products are exact and only
// the float32 sums round (tests/models/test_block_matmul_mxfp4.py checks against float64).
// A block is dequantized once for up to 8 (AVX-512) or 4 (AVX2) rows of x, so an expert
// tile of 8 rows (models/moe.py) reads each weight once.
// Which ISA: AVX-512F where cpuid has it, AVX2 + FMA elsewhere; FerroxBlockMatmulMxfp4Avx2
// forces the AVX2 build so tests on an AVX-512 host check both. Columns are shared over
// XLA's intra-op pool (parallel.h); one thread computes each output element whole, in the
// same order whatever the sharing or the number of rows, so results do not depend on them.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cpu_common.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kMxfp4 = 6;  // models/gguf_blocks.py's code for the format
constexpr int64_t kBlock = 32, kBlockBytes = 17;
// ggml's kvalues_mxfp4: twice the E2M1 values, so the scale is 2^(e - 128).
alignas(64) constexpr float kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

struct MxProblem {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, K / 32 * 17]
  float* out;        // [M, N]
  int64_t m, n, k;
};

// ggml_e8m0_to_fp32_half: 2^(e - 128), bit for bit (e 0 and 1 are subnormal).
inline float HalfScale(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
namespace ferrox_mx_avx512 {

constexpr int kMaxRows = 8;

// Columns [begin, end) for rows [row0, row0 + R).
template <int R>
void Columns(const MxProblem& p, int64_t row0, int64_t begin, int64_t end) {
  const __m512 values = _mm512_load_ps(kValues);
  const int64_t blocks = p.k / kBlock;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = p.w + n * blocks * kBlockBytes;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kBlockBytes;
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(HalfScale(blk[0])));
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1)));
      const __m512 lo = _mm512_permutexvar_ps(q, table);  // vpermps reads the low 4 bits: the low nibble
      const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
      for (int r = 0; r < R; ++r) {
        const float* xr = p.x + (row0 + r) * p.k + b * kBlock;
        acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
        acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) p.out[(row0 + r) * p.n + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

}  // namespace ferrox_mx_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace ferrox_mx_avx2 {

constexpr int kMaxRows = 4;

// The 8 weights whose codes are the nibbles at bit `shift` of q's lanes: the magnitude
// picked from the table's first 8 entries by the code's low 3 bits, the sign from bit 3.
inline __m256 Pick(__m256 table, __m256i q, int shift) {
  const __m256i code = shift ? _mm256_srli_epi32(q, 4) : q;  // vpermps reads the low 3 bits
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(INT32_MIN));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_permutevar8x32_ps(table, code)), sign));
}

template <int R>
void Columns(const MxProblem& p, int64_t row0, int64_t begin, int64_t end) {
  const __m256 values = _mm256_load_ps(kValues);
  const int64_t blocks = p.k / kBlock;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = p.w + n * blocks * kBlockBytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kBlockBytes;
      const __m256 table = _mm256_mul_ps(values, _mm256_set1_ps(HalfScale(blk[0])));
      for (int h = 0; h < 2; ++h) {  // bytes 8h .. 8h + 7: weights 8h.. (low nibbles), 16 + 8h.. (high)
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 1 + 8 * h)));
        const __m256 lo = Pick(table, q, 0), hi = Pick(table, q, 4);
        for (int r = 0; r < R; ++r) {
          const float* xr = p.x + (row0 + r) * p.k + b * kBlock + 8 * h;
          acc[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), acc[r]);
          acc[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 16), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) p.out[(row0 + r) * p.n + n] = ferrox::Sum8(acc[r]);
  }
}

}  // namespace ferrox_mx_avx2
#pragma GCC pop_options

namespace {

// 2: AVX-512F, 1: AVX2 + FMA, 0: neither (the caller keeps XLA).
int DetectIsa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f")) return 2;
  return avx2 ? 1 : 0;
}

const int kIsa = std::min(DetectIsa(), ferrox::IsaCap());

// Below this many multiply-adds a product runs on the calling thread alone.
constexpr int64_t kParallelMacs = 1 << 18;

// f(std::integral_constant<int, rows>) for rows in 1..I: the row count as a template argument.
template <int I, typename F>
void ByRows(int rows, F&& f) {
  if constexpr (I > 0) {
    if (rows == I) return f(std::integral_constant<int, I>{});
    ByRows<I - 1>(rows, f);
  }
}

// Columns [begin, end), every row, in groups of the build's most rows (the last group fewer).
void Run(const MxProblem& p, int64_t begin, int64_t end, int isa) {
  const int most = isa == 2 ? ferrox_mx_avx512::kMaxRows : ferrox_mx_avx2::kMaxRows;
  for (int64_t row0 = 0; row0 < p.m; row0 += most) {
    const int rows = static_cast<int>(std::min<int64_t>(most, p.m - row0));
    ByRows<8>(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      if (isa == 2) ferrox_mx_avx512::Columns<R>(p, row0, begin, end);
      else if constexpr (R <= ferrox_mx_avx2::kMaxRows) ferrox_mx_avx2::Columns<R>(p, row0, begin, end);
    });
  }
}

ffi::Error Matmul(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& w,
                  ffi::ResultBuffer<ffi::F32>& out, int32_t fmt, int isa) {
  constexpr const char* kWhat = "ferrox_block_matmul_mxfp4";
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(kWhat) + ": x must be [M, K] and w [N, row bytes]");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if (fmt != kMxfp4) return ffi::Error::InvalidArgument(std::string(kWhat) + ": unknown fmt");
  if (k % kBlock != 0 || wd[1] != k / kBlock * kBlockBytes)
    return ffi::Error::InvalidArgument(std::string(kWhat) + ": w's row bytes do not match K / 32 blocks");
  if (od.size() != 2 || od[0] != m || od[1] != n)
    return ffi::Error::InvalidArgument(std::string(kWhat) + ": out is not [M, N]");
  if (isa == 0) return ffi::Error::Internal(std::string(kWhat) + ": this CPU has no AVX2 + FMA");
  const MxProblem p{x.typed_data(), w.typed_data(), out->typed_data(), m, n, k};
  const int64_t threads = m * n * k >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  // 4 chunks per thread balance uneven progress.
  const int64_t chunk = std::max<int64_t>(4, (n + threads * 4 - 1) / (threads * 4));
  const int64_t tasks = (n + chunk - 1) / chunk;
  ferrox::ParallelFor(pool, threads, tasks, [&p, chunk, isa](int64_t t) {
    Run(p, t * chunk, std::min(p.n, (t + 1) * chunk), isa);
  });
  return ffi::Error::Success();
}

ffi::Error BlockMatmulMxfp4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                                ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int32_t /*int_rows*/,
                                int32_t /*wide_rows*/, int32_t /*amx_rows*/) {
  return Matmul(pool, x, w, out, fmt, kIsa);
}

ffi::Error BlockMatmulMxfp4Avx2Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                                    ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int32_t /*int_rows*/,
                                    int32_t /*wide_rows*/, int32_t /*amx_rows*/) {
  return Matmul(pool, x, w, out, fmt, std::min(kIsa, 1));
}

}  // namespace

#define FERROX_MX_BINDING                      \
  ffi::Ffi::Bind()                             \
      .Ctx<ffi::ThreadPool>()                  \
      .Arg<ffi::Buffer<ffi::F32>>()            \
      .Arg<ffi::Buffer<ffi::U8>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()            \
      .Attr<int32_t>("fmt")                    \
      .Attr<int32_t>("int_rows")               \
      .Attr<int32_t>("wide_rows")              \
      .Attr<int32_t>("amx_rows")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmulMxfp4, BlockMatmulMxfp4Impl, FERROX_MX_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxBlockMatmulMxfp4Avx2, BlockMatmulMxfp4Avx2Impl, FERROX_MX_BINDING);

// Which build of this kernel runs here: 2 AVX-512F, 1 AVX2, 0 none.
extern "C" int ferrox_block_mxfp4_isa() { return kIsa; }
