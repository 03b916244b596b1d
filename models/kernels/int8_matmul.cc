// The w8a8 projection on x86 CPUs with AVX2: out = quantize_rows(x) @ w^T, rescaled.
//
// XLA CPU's int8 x int8 -> int32 dot has no AVX2 kernel of its own: measured on a 2-core
// AMD EPYC (AVX2, no VNNI), a [2, 576] x [576, 1536] int8 product ran at ~5 GB/s of
// weights and a [32, 576] one at ~1.5 GB/s, far under the ~18 GB/s the machine streams.
// This handler reads each weight once per block of rows, at memory speed for one row.
//
// Operands (row-major; see models/quant.py for the layout):
//   x    f32[M, K]  activations; quantized here per row exactly as quantize_rows does:
//                   scale = amax * (1 / 127) (XLA's rewrite of quantize_rows' amax / 127;
//                   1 where the row is all zeros),
//                   q = round_half_even(x / scale), clipped to [-127, 127]
//   w    s8[N, K]   weights, one output channel per row ("[out, in]", channel_axis 0),
//                   values in [-127, 127]
//   ws   f32[N]     per-channel weight scales
//   out  f32[M, N]  (float(sum_k q[m, k] w[n, k]) * x_scale[m]) * ws[n], the order
//                   quantized_matmul multiplies in, so both paths give the same bits
//
// The product of 32 pairs uses llama.cpp's AVX2 sign trick: maddubs(|x|, sign(w, x))
// multiplies unsigned by signed bytes; |x|, |w| <= 127 keep each pair sum <= 32258, so
// the 16-bit lanes never saturate. K must be a multiple of 32 (checked; the caller
// falls back to XLA's dot otherwise). Columns are split into chunks shared over XLA's
// intra-op pool (parallel.h); every output element is computed whole by one thread, so
// the result does not depend on how the chunks were shared.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLane = 32;  // int8 values per AVX2 register

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline int32_t HorizontalSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// acc += 32 products of x and w bytes, as 8 int32 lanes (abs_x = |x|).
inline __m256i Dot32(__m256i acc, __m256i abs_x, __m256i x, __m256i w, __m256i ones) {
  const __m256i pairs = _mm256_maddubs_epi16(abs_x, _mm256_sign_epi8(w, x));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
}

// sums[i * NB + j] = dot(x row i, w row j) over K, for MB rows and NB weight rows.
template <int MB, int NB>
inline void DotBlock(const int8_t* x, const int8_t* w, int64_t k_size, int32_t* sums) {
  __m256i acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < k_size; k += kLane) {
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j) {
      // The NB weight rows are one contiguous stretch; asking for it 1 KiB ahead took the
      // 30-layer chain from ~10 to ~13.5 GB/s at one row (DRAM streams ~14-19 GB/s here).
      _mm_prefetch(reinterpret_cast<const char*>(w + j * k_size + k + 1024), _MM_HINT_T0);
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k_size + k));
    }
    for (int i = 0; i < MB; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * k_size + k));
      const __m256i ax = _mm256_abs_epi8(xv);
      for (int j = 0; j < NB; ++j) acc[i][j] = Dot32(acc[i][j], ax, xv, wv[j], ones);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) sums[i * NB + j] = HorizontalSum(acc[i][j]);
}

// Per-row symmetric int8 of one f32 row (module comment); returns the row's scale.
float QuantizeRow(const float* x, int64_t k_size, int8_t* q) {
  __m256 vmax = _mm256_setzero_ps();
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t k = 0; k < k_size; k += 8)
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  const float scale = amax > 0.0f ? amax * (1.0f / 127.0f) : 1.0f;  // XLA's amax / 127
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int64_t k = 0; k < k_size; k += 8) {
    __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + k), vscale);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i i32 = _mm256_cvtps_epi32(v);
    alignas(32) int32_t vals[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(vals), i32);
    for (int j = 0; j < 8; ++j) q[k + j] = static_cast<int8_t>(vals[j]);
  }
  return scale;
}

// Columns [n_begin, n_end) of out, every row.
struct Problem {
  const int8_t* xq;   // [M, K]
  const float* xs;    // [M]
  const int8_t* w;    // [N, K]
  const float* ws;    // [N]
  float* out;         // [M, N]
  int64_t m, n, k;
};

template <int NB>
inline void ColumnBlock(const Problem& p, int64_t n0) {
  int32_t sums[2 * NB];
  const int8_t* w = p.w + n0 * p.k;
  int64_t m0 = 0;
  for (; m0 + 2 <= p.m; m0 += 2) {
    DotBlock<2, NB>(p.xq + m0 * p.k, w, p.k, sums);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < NB; ++j)
        p.out[(m0 + i) * p.n + n0 + j] = static_cast<float>(sums[i * NB + j]) * p.xs[m0 + i] * p.ws[n0 + j];
  }
  if (m0 < p.m) {
    DotBlock<1, NB>(p.xq + m0 * p.k, w, p.k, sums);
    for (int j = 0; j < NB; ++j)
      p.out[m0 * p.n + n0 + j] = static_cast<float>(sums[j]) * p.xs[m0] * p.ws[n0 + j];
  }
}

void Columns(const Problem& p, int64_t n_begin, int64_t n_end) {
  int64_t n0 = n_begin;
  for (; n0 + 4 <= n_end; n0 += 4) ColumnBlock<4>(p, n0);
  for (; n0 < n_end; ++n0) ColumnBlock<1>(p, n0);
}

#pragma GCC pop_options

// Below this many multiply-adds a product runs on the calling thread alone.
constexpr int64_t kParallelMacs = 1 << 18;

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> ws, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("ferrox_int8_matmul: x must be [M, K] and w [N, K]");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if (k % kLane != 0) return ffi::Error::InvalidArgument("ferrox_int8_matmul: K must be a multiple of 32");
  if (static_cast<int64_t>(ws.element_count()) != n)
    return ffi::Error::InvalidArgument("ferrox_int8_matmul: ws must be [N]");

  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = QuantizeRow(x.typed_data() + i * k, k, xq.data() + i * k);
  const Problem p{xq.data(), xs.data(), w.typed_data(), ws.typed_data(), out->typed_data(), m, n, k};

  const int64_t threads = m * n * k >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  // 4 chunks per thread balance uneven progress; chunks are whole 4-column blocks.
  const int64_t target = threads * 4;
  const int64_t chunk = std::max<int64_t>(4, ((n + target - 1) / target + 3) / 4 * 4);
  ferrox::ParallelFor(pool, threads, (n + chunk - 1) / chunk, [&p, chunk](int64_t c) {
    Columns(p, c * chunk, std::min(p.n, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 if this CPU can run the handlers of this library (AVX2); the loader asks before registering them.
extern "C" int ferrox_cpu_kernels_supported() { return __builtin_cpu_supports("avx2") ? 1 : 0; }
