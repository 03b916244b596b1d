// Decode attention on x86 CPUs with AVX2 (and AVX-512 where the CPU has it): one query per row
// over its paged KV cache.
// Prompt chunks use it too: models/cpu_attention.py (`CpuDecodeAttention.chunks`) makes each
// query token a row of its own, with its row's block table and its causal length.
//
// The pure-JAX path (models/attention.py:paged_attention) gathers each row's blocks into
// a contiguous copy, transposes it for a batched dot and walks it in chunks; on XLA CPU
// that was about half of a 32-row decode step of the default model at context 192. This
// handler reads every key and value once, in place, through the block table.
//
// Operands (the cache layout is ferrox_jax/kv_cache.py's):
//   q        f32[B, H, hd]      rotated queries; head h belongs to kv head h / (H / K)
//   k, v     [K, N, bs, hd]     the layer's cache: f32, u16 holding bfloat16 words, or s16
//                               holding float16 words (ferrox_jax/kv_cache.py: storage_dtype)
//   tables   s32[B, MB]         block ids of each row's positions, in order
//   lengths  s32[B]             keys each row sees (its position + 1), 1 <= length <= MB bs
//   scale    f32 attribute      the scores' factor (1 / sqrt(hd) for most models)
//   out      f32[B, H, hd]      softmax(q k^T scale) v, per row and head
// hd must be a multiple of 8 (checked). Consecutive rows with the same table (a prompt
// chunk's tokens, a speculating row's 1 + d tokens) are run together, reading each key
// once for all of them (decode_attention_shared.inc). Lone rows' work is shared over (row,
// kv head) pairs; where they are fewer than 4 per thread (one decoding row has K of them),
// each pair's keys are cut into pieces of at least 64, and the pieces' softmax sums are
// merged as flash-decoding does (each rescaled from its own maximum to the overall one).
// Where the CPU has AVX-512 F / BW / VL (and FERROX_CPU_ISA allows it) and hd is a multiple of
// 16, both paths run their products on 16-lane registers (decode_attention_piece512.inc and
// decode_attention_shared.inc's FERROX_WIDE build); the handler FerroxDecodeAttentionAvx2
// forces the AVX2 build (tests compare the two on one host).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 8 cache elements as f32: a float cache as is, a u16 one as bfloat16 words (<< 16), an
// s16 one as float16 words (F16C's exact conversion).
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 Load8(const int16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

struct Problem {
  const float* q;
  const int32_t* tables;
  const int32_t* lengths;
  float* out;
  int64_t heads, kv_heads, blocks, block_size, head_dim, max_blocks;
  float scale;
};

// The 8 sums of 8 vectors, in order: lane i is the horizontal sum of v[i] (three rounds
// of hadd and one cross-lane add: a few shuffles per 8 keys instead of 3 per key).
inline __m256 Sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// 8 keys' scores at `to` (a padded row: 8 floats are there), -inf past the first `count` (their
// sums were of a repeated key). One store: a copy of `count` floats through the stack cost more
// than the 8 keys' sums at a short head_dim.
inline void StoreScores(__m256 sums, int64_t count, float* to) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane));
  _mm256_storeu_ps(to, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sums, live));
}

// How far ahead of the keys and values being read their cache rows are fetched: the
// hardware prefetcher alone left a decoding row waiting on memory.
constexpr int64_t kAheadKeys = 16;
// And further ahead into L2, keys and values both, while the scores are computed: the values'
// pass then reads L2, and twice the rows are in flight (1.05-1.20x on a long context,
// bench/kernels/ab_decode_attention.py; 64 or 256 keys measured the same as 128).
constexpr int64_t kFarKeys = 128;

// Key or value j of `row` for `kv_head`: its cache row, found through the row's block table.
template <typename T>
inline const T* CacheRow(const Problem& p, const T* cache, int64_t row, int64_t kv_head, int64_t j) {
  const int32_t* table = p.tables + row * p.max_blocks;
  const int64_t head_stride = p.blocks * p.block_size * p.head_dim;  // elements per kv head of the cache
  return cache + kv_head * head_stride +
         (int64_t{table[j / p.block_size]} * p.block_size + j % p.block_size) * p.head_dim;
}

// One (row, kv head, range of keys): for each of its G = H / K query heads, the scores of
// keys [begin, end), their softmax numerators against the range's own maximum, and
// partial[g] = (sum_j e_j v_j [hd], the maximum, sum_j e_j): a piece MergePieces combines.
template <typename T>
struct Piece {
  const Problem& p;
  const T* k_cache;
  const T* v_cache;
  int64_t row, kv_head;

  const T* KeyRow(const T* cache, int64_t j) const { return CacheRow(p, cache, row, kv_head, j); }

  // scores[g * padded + i] = q_g . k_(begin + i) * scale, 8 keys at a time. A 16-bit cache's
  // 8 keys are converted once into `wide` (f32[8][hd], L1) for all G query heads, not once a
  // head (with the run lookups and the four-head values below: 1.10-1.27x on a float16 cache,
  // Zen 4, docs/benchmarks.md; memory, not the conversions, bounds it at long contexts).
  void Scores(int64_t begin, int64_t n, int64_t padded, float* scores, float* wide) const {
    const int64_t groups = p.heads / p.kv_heads, hd = p.head_dim;
    const float* q = p.q + (row * p.heads + kv_head * groups) * hd;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const int64_t count = std::min<int64_t>(8, n - j0);
      const float* keys[8];
      // with blocks of a multiple of 8 positions a run of 8 from a multiple of 8 stays inside
      // one block: one table lookup (and division) for the run
      const T* run = KeyRow(k_cache, begin + j0);
      for (int64_t i = 0; i < 8; ++i) {
        const T* key = p.block_size % 8 == 0 ? run + std::min(i, count - 1) * hd
                                              : KeyRow(k_cache, begin + j0 + std::min(i, count - 1));
        if constexpr (std::is_same_v<T, float>) {
          keys[i] = key;
        } else {
          for (int64_t d = 0; d < hd; d += 8) _mm256_store_ps(wide + i * hd + d, Load8(key + d));
          keys[i] = wide + i * hd;
        }
      }
      // the 8 cache rows kAheadKeys on: contiguous (a run of 8 from a multiple of 8 stays
      // inside one block of 8 or more positions)
      if (j0 + kAheadKeys < n) ferrox::PrefetchSpan(KeyRow(k_cache, begin + j0 + kAheadKeys), 8 * hd * int64_t{sizeof(T)});
      if (j0 + kFarKeys < n) {
        ferrox::PrefetchSpan<_MM_HINT_T1>(KeyRow(k_cache, begin + j0 + kFarKeys), 8 * hd * int64_t{sizeof(T)});
        ferrox::PrefetchSpan<_MM_HINT_T1>(KeyRow(v_cache, begin + j0 + kFarKeys), 8 * hd * int64_t{sizeof(T)});
      }
      for (int64_t g = 0; g < groups; ++g) {
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + g * hd + d);
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[i] + d), acc[i]);
        }
        StoreScores(_mm256_mul_ps(Sum8(acc), _mm256_set1_ps(p.scale)), count, scores + g * padded + j0);
      }
    }
  }

  // acc[g] += e[g][j] v_j over the n keys, for NG query heads from g0, 8 R columns from d0.
  // NG and R are template arguments so that the accumulators stay in registers (a
  // run-time bound made GCC keep them in memory: a store per multiply-add).
  template <int NG, int R>
  void Values(int64_t begin, int64_t n, int64_t padded, const float* e, int64_t g0, int64_t d0,
              float* partial) const {
    const int64_t hd = p.head_dim, stride = hd + 2;
    __m256 acc[NG][R];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps();
    const T* run = nullptr;
    const bool runs = p.block_size % 8 == 0;  // a run of 8 from a multiple of 8 inside one block
    for (int64_t j = 0; j < n; ++j) {
      if (j % 8 == 0) {  // one table lookup for the run
        run = KeyRow(v_cache, begin + j);
        if (d0 == 0 && j + kAheadKeys < n)
          ferrox::PrefetchSpan(KeyRow(v_cache, begin + j + kAheadKeys), 8 * hd * int64_t{sizeof(T)});
      }
      const T* v = (runs ? run + (j % 8) * hd : KeyRow(v_cache, begin + j)) + d0;
      // the NG weights, then one value vector at a time: NG x R accumulators + NG + 1
      // registers (3 x 4 + 4 = 16; R value vectors at once had one accumulator spilled, a
      // store and reload in every key's chain)
      __m256 w[NG];
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) w[g] = _mm256_broadcast_ss(e + (g0 + g) * padded + j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 vr = Load8(v + 8 * r);
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) acc[g][r] = _mm256_fmadd_ps(w[g], vr, acc[g][r]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(partial + (g0 + g) * stride + d0 + 8 * r, acc[g][r]);
  }

  // Values for `width` (8 to 32) columns.
  template <int NG>
  void ValuesOfWidth(int64_t begin, int64_t n, int64_t padded, const float* e, int64_t g0, int64_t d0,
                     int64_t width, float* partial) const {
    switch (width / 8) {
      case 4: return Values<NG, 4>(begin, n, padded, e, g0, d0, partial);
      case 3: return Values<NG, 3>(begin, n, padded, e, g0, d0, partial);
      case 2: return Values<NG, 2>(begin, n, padded, e, g0, d0, partial);
      default: return Values<NG, 1>(begin, n, padded, e, g0, d0, partial);
    }
  }

  // The values' pass for all query heads (Values' tiles over the columns).
  void AllValues(int64_t begin, int64_t n, int64_t padded, const float* e, float* partial) const {
    const int64_t groups = p.heads / p.kv_heads, hd = p.head_dim;
    // Four query heads (Llama 3's and Qwen's 32 / 8 among them) over a 16-bit cache: each value
    // row read and converted once per 16 columns for all four (4 x 2 accumulators, 2 value
    // vectors; a float cache has nothing to convert and reads faster 32 columns at a time).
    if (!std::is_same_v<T, float> && groups == 4 && hd % 16 == 0) {
      for (int64_t d0 = 0; d0 < hd; d0 += 16) Values<4, 2>(begin, n, padded, e, 0, d0, partial);
      return;
    }
    // Else each value row is read once per 32 columns for up to 3 query heads together (the
    // 16 AVX2 registers hold 3 x 4 accumulators and the 4 value vectors).
    for (int64_t d0 = 0; d0 < hd; d0 += 32) {
      const int64_t width = std::min<int64_t>(32, hd - d0);
      int64_t g = 0;
      for (; g + 3 <= groups; g += 3) ValuesOfWidth<3>(begin, n, padded, e, g, d0, width, partial);
      if (groups - g == 2) ValuesOfWidth<2>(begin, n, padded, e, g, d0, width, partial);
      if (groups - g == 1) ValuesOfWidth<1>(begin, n, padded, e, g, d0, width, partial);
    }
  }
};

// One piece (Piece or, on AVX-512, Piece512) of keys [begin, end): its scores, their softmax
// numerators against the range's own maximum, and the values' pass into `partial`.
template <typename P>
void RunPiece(const P& piece, int64_t begin, int64_t end, std::vector<float>& scores, float* partial) {
  const Problem& p = piece.p;
  const int64_t groups = p.heads / p.kv_heads, hd = p.head_dim, stride = hd + 2, n = end - begin;
  if (n <= 0) {  // an empty range (a short row split as a long one is): weight 0 in the merge
    for (int64_t g = 0; g < groups; ++g) {
      std::fill(partial + g * stride, partial + g * stride + hd, 0.0f);
      partial[g * stride + hd] = -INFINITY;
      partial[g * stride + hd + 1] = 0.0f;
    }
    return;
  }
  const int64_t padded = (n + 7) / 8 * 8;
  // the scores, then (16-bit caches) 8 converted keys, 64-byte aligned
  scores.assign(groups * padded + 8 * hd + 16, -INFINITY);
  float* wide = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scores.data() + groups * padded) + 63) & ~uintptr_t{63});
  piece.Scores(begin, n, padded, scores.data(), wide);
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores.data() + g * padded;
    // the maximum 8 lanes at a time (the tail past n is -inf): a scalar max_element was a
    // 4-cycle dependency per key
    __m256 lanes = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + j));
    const float max = HorizontalMax(lanes);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 x = _mm256_loadu_ps(s + j);  // the tail past n is -inf: weight 0
      const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(ferrox::Exp8(_mm256_sub_ps(x, _mm256_set1_ps(max))), live);
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    }
    partial[g * stride + hd] = max;
    partial[g * stride + hd + 1] = HorizontalSum(total);
  }
  piece.AllValues(begin, n, padded, scores.data(), partial);
}

#define FERROX_WIDE 0
#include "decode_attention_shared.inc"
#undef FERROX_WIDE

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
#include "decode_attention_piece512.inc"
namespace wide {
#define FERROX_WIDE 1
#include "decode_attention_shared.inc"
#undef FERROX_WIDE
}  // namespace wide
#pragma GCC pop_options

// 2: AVX-512 F + BW + VL (Piece512 and wide::SharedRows where head_dim is a multiple of 16), 1: AVX2.
int DetectIsa() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  return avx512 ? 2 : 1;
}

const int kIsa = std::min(DetectIsa(), ferrox::IsaCap());

// Below this many multiply-adds (keys x heads x head_dim, twice) the caller works alone.
constexpr int64_t kParallelMacs = 1 << 17;
// Pieces per thread the work is cut into, and the fewest keys a piece of a split row holds.
constexpr int64_t kPiecesPerThread = 4;
constexpr int64_t kMinPieceKeys = 64;

// out[row, h] from a (row, kv head)'s pieces: softmax over all its keys, each piece's sums
// rescaled from its own maximum to the overall one (flash-decoding's merge).
void MergePieces(const Problem& p, int64_t row, int64_t kv_head, int64_t pieces, const float* partials) {
  const int64_t groups = p.heads / p.kv_heads, hd = p.head_dim, stride = hd + 2;
  for (int64_t g = 0; g < groups; ++g) {
    float max = -INFINITY;
    for (int64_t c = 0; c < pieces; ++c) max = std::max(max, partials[(c * groups + g) * stride + hd]);
    float* out = p.out + (row * p.heads + kv_head * groups + g) * hd;
    std::fill(out, out + hd, 0.0f);
    float total = 0.0f;
    for (int64_t c = 0; c < pieces; ++c) {
      const float* piece = partials + (c * groups + g) * stride;
      if (piece[hd + 1] == 0.0f) continue;  // an empty piece
      const float factor = std::exp(piece[hd] - max);  // 1 for the piece holding the maximum
      total += factor * piece[hd + 1];
      for (int64_t d = 0; d < hd; ++d) out[d] += factor * piece[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < hd; ++d) out[d] *= inv;
  }
}

// Rows that share one block table (SharedRows) come in consecutive runs: [first, first + count).
std::vector<std::pair<int64_t, int64_t>> SharedRuns(const Problem& p, int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  const size_t bytes = p.max_blocks * sizeof(int32_t);
  for (int64_t b = 0; b < rows; ++b) {
    if (!runs.empty() && std::memcmp(p.tables + b * p.max_blocks,
                                     p.tables + runs.back().first * p.max_blocks, bytes) == 0)
      ++runs.back().second;
    else
      runs.push_back({b, 1});
  }
  return runs;
}

// The rows with a table of their own: one task per (row, kv head) pair, or per piece of it.
template <template <typename> class Part, typename T>
void RunLone(ffi::ThreadPool& pool, const Problem& p, const T* k_cache, const T* v_cache, int64_t threads,
             const std::vector<int64_t>& lone) {
  int64_t longest = 0;
  for (int64_t b : lone) longest = std::max<int64_t>(longest, p.lengths[b]);
  // Few (row, kv head) pairs for the threads (one decoding row has K of them): each
  // pair's keys are cut into pieces, run in parallel, and merged.
  const int64_t pairs = static_cast<int64_t>(lone.size()) * p.kv_heads, want = threads * kPiecesPerThread;
  const int64_t pieces = pairs >= want ? 1 : std::clamp<int64_t>((want + pairs - 1) / pairs, 1,
                                                                  std::max<int64_t>(1, longest / kMinPieceKeys));
  const int64_t groups = p.heads / p.kv_heads;
  std::vector<float> partials(pairs * pieces * groups * (p.head_dim + 2));
  ferrox::ParallelFor(pool, threads, pairs * pieces, [&](int64_t task) {
    thread_local std::vector<float> scores;
    const int64_t pair = task / pieces, c = task % pieces, row = lone[pair / p.kv_heads];
    const int64_t length = p.lengths[row], per = ((length + pieces - 1) / pieces + 7) / 8 * 8;
    const Part<T> piece{Piece<T>{p, k_cache, v_cache, row, pair % p.kv_heads}};
    RunPiece(piece, std::min(length, c * per), std::min(length, (c + 1) * per), scores,
             partials.data() + task * groups * (p.head_dim + 2));
  });
  for (int64_t pair = 0; pair < pairs; ++pair)
    MergePieces(p, lone[pair / p.kv_heads], pair % p.kv_heads, pieces,
                partials.data() + pair * pieces * groups * (p.head_dim + 2));
}

// Most rows of a slice of shared rows (its queries' state stays in L1/L2). Each slice converts and
// transposes every key tile again: past a long context 64 rows a slice (a 128-token chunk at 1,920:
// 1.09x 16 rows, 1.03x 32). A chunk that is mostly its own causal triangle (its first row sees fewer
// keys than the run has rows) takes 32: its later rows see more keys, and 64-row slices left a
// thread waiting on the other's (a first chunk at 0 ran 0.95x as fast on 64-row slices as on 32).
constexpr int64_t kSliceRows = 64, kTriangleSliceRows = 32;

template <typename T>
void Run(ffi::ThreadPool& pool, const Problem& p, const T* k_cache, const T* v_cache, int64_t rows, bool wide) {
  int64_t work = 0;
  for (int64_t b = 0; b < rows; ++b) work += int64_t{p.lengths[b]} * p.heads * p.head_dim * 2;
  const int64_t threads = work >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  // Lone rows take the Piece path; runs of rows sharing a table are cut into slices of
  // rows, each a task per kv head, small enough that the threads get 2 tasks each.
  std::vector<int64_t> lone;
  std::vector<std::pair<int64_t, int64_t>> slices;
  for (const auto& [first, count] : SharedRuns(p, rows)) {
    if (count == 1) {
      lone.push_back(first);
      continue;
    }
    const int64_t most = p.lengths[first] >= count ? kSliceRows : kTriangleSliceRows;
    const int64_t per = std::clamp<int64_t>(count * p.kv_heads / (2 * threads), 1, most);
    for (int64_t r = 0; r < count; r += per) slices.push_back({first + r, std::min(per, count - r)});
  }
  if (!slices.empty())
    ferrox::ParallelFor(pool, threads, static_cast<int64_t>(slices.size()) * p.kv_heads, [&](int64_t task) {
      thread_local std::vector<float> scratch;
      const auto& [first, count] = slices[task / p.kv_heads];
      if (wide)
        wide::SharedRows<T>{p, k_cache, v_cache, first, count, task % p.kv_heads}.Run(scratch);
      else
        SharedRows<T>{p, k_cache, v_cache, first, count, task % p.kv_heads}.Run(scratch);
    });
  if (lone.empty()) return;
  if (wide)
    RunLone<Piece512>(pool, p, k_cache, v_cache, threads, lone);
  else
    RunLone<Piece>(pool, p, k_cache, v_cache, threads, lone);
}

// kAvx2: the AVX2 build whatever the CPU has (tests compare the builds on one host).
template <bool kAvx2>
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
  for (int64_t b = 0; b < rows; ++b) {
    if (p.lengths[b] < 1 || p.lengths[b] > p.max_blocks * p.block_size)
      return ffi::Error::InvalidArgument("ferrox_decode_attention: a row's length is outside its block table");
    // the blocks a row reads must be in the cache: an id past it would read past the buffer
    // (the scheduler never hands one out; this keeps a bad table an error, not a crash)
    const int32_t* table = p.tables + b * p.max_blocks;
    for (int64_t j = 0; j < (p.lengths[b] + p.block_size - 1) / p.block_size; ++j)
      if (table[j] < 0 || table[j] >= p.blocks)
        return ffi::Error::InvalidArgument("ferrox_decode_attention: a block id in a row's table is outside the cache");
  }
  const bool wide = !kAvx2 && kIsa == 2 && hd % 16 == 0;
  switch (k.element_type()) {
    case ffi::DataType::F32:
      Run(pool, p, static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()), rows,
          wide);
      break;
    case ffi::DataType::U16:
      Run(pool, p, static_cast<const uint16_t*>(k.untyped_data()), static_cast<const uint16_t*>(v.untyped_data()),
          rows, wide);
      break;
    case ffi::DataType::S16:
      Run(pool, p, static_cast<const int16_t*>(k.untyped_data()), static_cast<const int16_t*>(v.untyped_data()),
          rows, wide);
      break;
    default:
      return ffi::Error::InvalidArgument(
          "ferrox_decode_attention: the cache must be f32, u16 (bfloat16 words) or s16 (float16 words)");
  }
  return ffi::Error::Success();
}

}  // namespace

#define FERROX_DECODE_ATTENTION_BINDING                   \
  ffi::Ffi::Bind()                                        \
      .Ctx<ffi::ThreadPool>()                             \
      .Arg<ffi::Buffer<ffi::F32>>()                       \
      .Arg<ffi::AnyBuffer>()                              \
      .Arg<ffi::AnyBuffer>()                              \
      .Arg<ffi::Buffer<ffi::S32>>()                       \
      .Arg<ffi::Buffer<ffi::S32>>()                       \
      .Attr<float>("scale")                               \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxDecodeAttention, DecodeAttentionImpl<false>, FERROX_DECODE_ATTENTION_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxDecodeAttentionAvx2, DecodeAttentionImpl<true>, FERROX_DECODE_ATTENTION_BINDING);

// Which build lone rows run on (2: AVX-512 where head_dim is a multiple of 16, 1: AVX2).
extern "C" int ferrox_decode_attention_isa() { return kIsa; }
