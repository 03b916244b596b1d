// Decode attention on x86 CPUs with AVX2: one query per row over its paged KV cache.
//
// The pure-JAX path (models/attention.py:paged_attention) gathers each row's blocks into
// a contiguous copy, transposes it for a batched dot and walks it in chunks; on XLA CPU
// that was about half of a 32-row decode step of the default model at context 192. This
// handler reads every key and value once, in place, through the block table.
//
// Operands (the cache layout is ferrox_jax/kv_cache.py's):
//   q        f32[B, H, hd]      rotated queries; head h belongs to kv head h / (H / K)
//   k, v     [K, N, bs, hd]     the layer's cache: f32, or u16 holding bfloat16 words
//   tables   s32[B, MB]         block ids of each row's positions, in order
//   lengths  s32[B]             keys each row sees (its position + 1), 1 <= length <= MB bs
//   scale    f32 attribute      the scores' factor (1 / sqrt(hd) for most models)
//   out      f32[B, H, hd]      softmax(q k^T scale) v, per row and head
// hd must be a multiple of 8 (checked). Work is shared over (row, kv head) pairs.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (Cephes' expf: 2^n times a degree-5 polynomial on [-ln2/2, ln2/2],
// within 2 ulp of the true value; x below -87.3 gives 2^-126).
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// 8 cache elements as f32: a float cache as is, a u16 one as bfloat16 words (<< 16).
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

struct Problem {
  const float* q;
  const int32_t* tables;
  const int32_t* lengths;
  float* out;
  int64_t heads, kv_heads, blocks, block_size, head_dim, max_blocks;
  float scale;
};

// One (row, kv head): its G = H / K query heads over the row's `length` keys.
template <typename T>
void RowHead(const Problem& p, const T* k_cache, const T* v_cache, int64_t row, int64_t kv_head,
             std::vector<float>& scores) {
  const int64_t groups = p.heads / p.kv_heads, hd = p.head_dim, length = p.lengths[row];
  const float* q = p.q + (row * p.heads + kv_head * groups) * hd;
  float* out = p.out + (row * p.heads + kv_head * groups) * hd;
  const int32_t* table = p.tables + row * p.max_blocks;
  const int64_t head_stride = p.blocks * p.block_size * hd;  // elements per kv head of the cache
  auto key_row = [&](const T* cache, int64_t j) {
    return cache + kv_head * head_stride + (int64_t{table[j / p.block_size]} * p.block_size + j % p.block_size) * hd;
  };
  const int64_t padded = (length + 7) / 8 * 8;
  scores.assign(groups * padded, -INFINITY);
  for (int64_t j = 0; j < length; ++j) {
    const T* k = key_row(k_cache, j);
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), Load8(k + d), acc);
      scores[g * padded + j] = HorizontalSum(acc) * p.scale;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores.data() + g * padded;
    const float max = *std::max_element(s, s + length);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 x = _mm256_loadu_ps(s + j);  // the tail past `length` is -inf: weight 0
      const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(Exp(_mm256_sub_ps(x, _mm256_set1_ps(max))), live);
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    }
    const float inv = 1.0f / HorizontalSum(total);
    float* o = out + g * hd;
    for (int64_t d0 = 0; d0 < hd; d0 += 32) {  // up to 4 registers of the output at a time
      const int64_t width = std::min<int64_t>(32, hd - d0);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t j = 0; j < length; ++j) {
        const T* v = key_row(v_cache, j) + d0;
        const __m256 w = _mm256_set1_ps(s[j]);
        for (int64_t r = 0; r < width / 8; ++r) acc[r] = _mm256_fmadd_ps(w, Load8(v + 8 * r), acc[r]);
      }
      for (int64_t r = 0; r < width / 8; ++r)
        _mm256_storeu_ps(o + d0 + 8 * r, _mm256_mul_ps(acc[r], _mm256_set1_ps(inv)));
    }
  }
}

#pragma GCC pop_options

// Below this many multiply-adds (keys x heads x head_dim, twice) the caller works alone.
constexpr int64_t kParallelMacs = 1 << 17;

template <typename T>
void Run(ffi::ThreadPool& pool, const Problem& p, const T* k_cache, const T* v_cache, int64_t rows) {
  int64_t work = 0;
  for (int64_t b = 0; b < rows; ++b) work += int64_t{p.lengths[b]} * p.heads * p.head_dim * 2;
  const int64_t threads = work >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  ferrox::ParallelFor(pool, threads, rows * p.kv_heads, [&p, k_cache, v_cache](int64_t task) {
    thread_local std::vector<float> scores;
    RowHead(p, k_cache, v_cache, task / p.kv_heads, task % p.kv_heads, scores);
  });
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                               float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || td[0] != qd[0])
    return ffi::Error::InvalidArgument("ferrox_decode_attention: q [B, H, hd], k/v [K, N, bs, hd], tables [B, MB]");
  const auto vd = v.dimensions();
  if (k.element_type() != v.element_type() || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("ferrox_decode_attention: k and v caches must match");
  const int64_t rows = qd[0], heads = qd[1], hd = qd[2];
  if (kd[3] != hd || hd % 8 != 0 || heads % kd[0] != 0)
    return ffi::Error::InvalidArgument("ferrox_decode_attention: head_dim must match and be a multiple of 8, "
                                       "and kv heads divide the heads");
  const Problem p{q.typed_data(), tables.typed_data(), lengths.typed_data(), out->typed_data(),
                  heads, kd[0], kd[1], kd[2], hd, td[1], scale};
  for (int64_t b = 0; b < rows; ++b)
    if (p.lengths[b] < 1 || p.lengths[b] > p.max_blocks * p.block_size)
      return ffi::Error::InvalidArgument("ferrox_decode_attention: a row's length is outside its block table");
  switch (k.element_type()) {
    case ffi::DataType::F32:
      Run(pool, p, static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()), rows);
      break;
    case ffi::DataType::U16:
      Run(pool, p, static_cast<const uint16_t*>(k.untyped_data()), static_cast<const uint16_t*>(v.untyped_data()),
          rows);
      break;
    default:
      return ffi::Error::InvalidArgument("ferrox_decode_attention: the cache must be f32 or u16 (bfloat16 words)");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
