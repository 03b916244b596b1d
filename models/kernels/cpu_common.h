// Small pieces the x86 kernels share (block_matmul_builds.h, block_matmul_k.cc,
// decode_attention.cc, sample_rows.cc). Included outside the per-ISA `#pragma GCC target` blocks: what
// needs an ISA extension says so in its own target attribute, and GCC inlines it into
// any build whose target includes that extension.

#ifndef FERROX_MODELS_KERNELS_CPU_COMMON_H_
#define FERROX_MODELS_KERNELS_CPU_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace ferrox {

// The most the kernels may use, from FERROX_CPU_ISA (`models/cpu_isa.py`, which refuses other
// values before this library loads): 1 "avx2" (the AVX2 builds, as on an AVX2-only host),
// 2 "avx512" (AVX-512, no AMX), 3 unset or "native" (whatever cpuid offers). Each kernel's
// build is the lesser of this and what the CPU has.
inline int IsaCap() {
  const char* v = std::getenv("FERROX_CPU_ISA");
  if (v != nullptr && std::strcmp(v, "avx2") == 0) return 1;
  if (v != nullptr && std::strcmp(v, "avx512") == 0) return 2;
  return 3;
}

// The IEEE half (a GGUF scale or offset) at p, as float32.
__attribute__((target("f16c"))) inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The sum of a 256-bit vector's 8 floats (halves added, then pairs, then the last two).
__attribute__((target("avx"))) inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The largest of a 256-bit vector's 8 floats.
__attribute__((target("avx"))) inline float Max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// exp(x) for x <= 0 (Cephes' expf: 2^n times a degree-5 polynomial on [-ln2/2, ln2/2],
// within 2 ulp of the true value; x below kExpFloor gives 2^-126). Exp8 and Exp16 take the
// same steps with these constants, so each lane's result is the same at either width.
constexpr float kExpFloor = -87.33654f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

__attribute__((target("avx512f"))) inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// 32 int32 already within int8 (four registers of 8, in order) as 32 int8 in order: the two
// saturating packs work within 128-bit lanes, a dword permute puts the pieces back in order.
__attribute__((target("avx2"))) inline __m256i PackInt8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 activations v times inv (127 / amax of their block or super-block) split into two int8
// parts on base 254, the AVX2 integer paths' 16-bit activation: q1 = round(t), q2 = round(254 (t
// - q1)), both in [-127, 127] (so Q8_0's sign trick never negates -128), x ~= (q1 + q2 / 254) /
// inv within 1 / (508 inv) = amax / 64516. Stored as 32 bytes each at q1, q2 (32-byte aligned).
__attribute__((target("avx2"))) inline void SplitBase254(const __m256 (&v)[4], __m256 inv, int8_t* q1, int8_t* q2) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 k254 = _mm256_set1_ps(254.0f);
  __m256i i1[4], i2[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 t = _mm256_mul_ps(v[i], inv);
    const __m256 r1 = _mm256_round_ps(t, kRound);
    i1[i] = _mm256_cvtps_epi32(r1);
    i2[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, r1), k254), kRound));
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(q1), PackInt8(i1[0], i1[1], i1[2], i1[3]));
  _mm256_store_si256(reinterpret_cast<__m256i*>(q2), PackInt8(i2[0], i2[1], i2[2], i2[3]));
}

// The order in which the float panel kernels (panel256.inc, panel512.inc, the block kernel's
// AVX2 panel) visit their panels: columns [n_begin, n_end) in panels of `cols` and the m x k
// activations' K in pieces of `piece`, step(n0, width, k0, len) dequantizing one panel and
// running every row over it. While the rows fit kPanelRowBytes, columns outer, each panel over
// all of K. Past it the rows no longer stay in L2 while one panel runs over all of K, and every
// panel read them again from L3 (K = 8192, a down projection, at 128 rows: 4 MB a panel), so
// K outer within spans of columns whose m rows of sums fit kPanelOutBytes: each piece of every
// panel of the span in turn, the rows' piece (m x piece floats) and the span's sums in L2.
// Each output's pieces are summed in the same order either way (k0 ascending): the same bits.
constexpr int64_t kPanelRowBytes = 1024 * 1024, kPanelOutBytes = 256 * 1024;

template <typename Step>
inline void ForPanels(int64_t m, int64_t k, int64_t n_begin, int64_t n_end, int64_t cols, int64_t piece, Step step) {
  if (m * k * static_cast<int64_t>(sizeof(float)) <= kPanelRowBytes) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += cols)
      for (int64_t k0 = 0; k0 < k; k0 += piece) step(n0, std::min(cols, n_end - n0), k0, std::min(piece, k - k0));
    return;
  }
  const int64_t span = std::max<int64_t>(cols, kPanelOutBytes / (m * static_cast<int64_t>(sizeof(float))) / cols * cols);
  for (int64_t s0 = n_begin; s0 < n_end; s0 += span)
    for (int64_t k0 = 0; k0 < k; k0 += piece)
      for (int64_t n0 = s0; n0 < std::min(n_end, s0 + span); n0 += cols)
        step(n0, std::min(cols, n_end - n0), k0, std::min(piece, k - k0));
}

// Every cache line of [at, at + bytes) requested into L1 (`Hint` _MM_HINT_T1: into L2). A
// prefetch never faults, so the span may run past the data.
template <auto Hint = _MM_HINT_T0>
inline void PrefetchSpan(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, Hint);
}

// A tile of NB output columns reads their NB weight rows (contiguous bytes) as NB
// interleaved streams, NB blocks a step. The rows are short (360 to 960 bytes in the
// default model) and the hardware prefetcher, which follows one stream at a time, fell
// behind: with one activation row the tiles waited on memory (one thread, Zen 4,
// [576 -> 1536]^T Q4_1 weights streamed from DRAM: 5.3 GB/s against 12 from cache). So
// each step also fetches its share of the tile kAheadTiles tiles further on, and the tiles
// after this one are in L1 by the time they are read. Past the last column this touches
// other weights or nothing.
constexpr int64_t kAheadTiles = 2;

// Step `step` of a tile of `tile_bytes` starting at `tile`, read `step_bytes` a step.
inline void PrefetchTileAhead(const uint8_t* tile, int64_t tile_bytes, int64_t step_bytes, int64_t step) {
  PrefetchSpan(tile + kAheadTiles * tile_bytes + step * step_bytes, step_bytes);
}

}  // namespace ferrox

#endif  // FERROX_MODELS_KERNELS_CPU_COMMON_H_
