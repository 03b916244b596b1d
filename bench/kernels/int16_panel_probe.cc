// Probe, not a kernel path: the many-row Q4_1 product with activations in 16-bit blocks of
// 32 (one float scale and the float sum per block) and VNNI `vpdpwssd` over a panel of 16
// output columns, each lane one column's pair of weights, against the float panel
// (ferrox_avx512::Run), one thread, weights in cache. It measures what docs/benchmarks.md
// names as the next lever for many rows: on Zen 4 `vpdpwssd` issues at a float
// FMA's rate with twice the products. The panel here is packed with gathers, once per 16
// columns for all rows, which is what costs it the 16- and 32-row cases.
//   c++ -O3 -std=c++17 -mf16c -I models/kernels bench/kernels/int16_panel_probe.cc -o /tmp/int16_probe
//   /tmp/int16_probe     # rows 16, 32, 128 of [576 -> 1536]; time, GFLOP/s, largest difference
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "block_matmul_builds.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
static float H(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

// activations: per row per block: int16 values, scale, float sum
struct Q16 { std::vector<int16_t> v; std::vector<float> s, sum; };
static void Quant16(const float* x, int64_t m, int64_t k, Q16* q) {
  const int64_t nb = k / 32;
  q->v.resize(m * k); q->s.resize(m * nb); q->sum.resize(m * nb);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * 32;
      __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      float s = amax > 0 ? amax / 32767.0f : 1.0f;
      __m512 inv = _mm512_set1_ps(1.0f / s);
      __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inv));
      _mm256_storeu_si256((__m256i*)(q->v.data() + r * k + b * 32), _mm512_cvtsepi32_epi16(i0));
      _mm256_storeu_si256((__m256i*)(q->v.data() + r * k + b * 32 + 16), _mm512_cvtsepi32_epi16(i1));
      q->s[r * nb + b] = s;
      q->sum[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

// panel for 16 columns: per block: 16 pair-vectors (lane c: q[c][2p] | q[c][2p+1] << 16), d[16], m[16]
static void Pack(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t nb, int32_t* pairs, float* d, float* mm) {
  alignas(64) int16_t col[16][32];
  for (int64_t b = 0; b < nb; ++b) {
    for (int c = 0; c < 16; ++c) {
      const uint8_t* blk = w + (n0 + c) * row_bytes + b * 20;
      d[b * 16 + c] = H(blk); mm[b * 16 + c] = H(blk + 2);
      __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(blk + 4)));
      _mm256_store_si256((__m256i*)col[c], _mm256_and_si256(q, _mm256_set1_epi16(15)));
      _mm256_store_si256((__m256i*)(col[c] + 16), _mm256_srli_epi16(q, 4));
    }
    // transpose: pairs[b][p][c] = col[c][2p..2p+1] as int32
    const int32_t* src = reinterpret_cast<const int32_t*>(col);  // [16 cols][16 pairs]
    __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int p = 0; p < 16; ++p)
      _mm512_store_si512(pairs + (b * 16 + p) * 16, _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(p)), src, 4));
  }
}

template <int MB>
static void Tile16(const Q16& q, int64_t k, int64_t r0, const int32_t* pairs, const float* d, const float* mm, int64_t nb,
                   float* out, int64_t n, int64_t n0) {
  __m512 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[MB];
    for (int r = 0; r < MB; ++r) ia[r] = _mm512_setzero_si512();
    const int32_t* pb = pairs + b * 256;
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m512i wv = _mm512_load_si512(pb + p * 16);
#pragma GCC unroll 8
      for (int r = 0; r < MB; ++r) {
        int32_t xp; memcpy(&xp, q.v.data() + (r0 + r) * k + b * 32 + 2 * p, 4);
        ia[r] = _mm512_dpwssd_epi32(ia[r], wv, _mm512_set1_epi32(xp));
      }
    }
    const __m512 vd = _mm512_load_ps(d + b * 16), vm = _mm512_load_ps(mm + b * 16);
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(vd, _mm512_set1_ps(q.s[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(vm, _mm512_set1_ps(q.sum[at]), acc[r]);
    }
  }
  for (int r = 0; r < MB; ++r) _mm512_storeu_ps(out + (r0 + r) * n + n0, acc[r]);
}

static void Run16(const float* x, const uint8_t* w, float* out, int64_t m, int64_t n, int64_t k) {
  Q16 q; Quant16(x, m, k, &q);
  const int64_t nb = k / 32, row_bytes = nb * 20;
  alignas(64) static int32_t pairs[64 * 256]; alignas(64) static float d[64 * 16], mm[64 * 16];
  for (int64_t n0 = 0; n0 < n; n0 += 16) {
    Pack(w, row_bytes, n0, nb, pairs, d, mm);
    int64_t r = 0;
    for (; r + 8 <= m; r += 8) Tile16<8>(q, k, r, pairs, d, mm, nb, out, n, n0);
    for (; r < m; ++r) Tile16<1>(q, k, r, pairs, d, mm, nb, out, n, n0);
  }
}
#pragma GCC pop_options

int main() {
  const int64_t k = 576, n = 1536;
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  std::vector<uint8_t> w(n * k / 32 * 20);
  for (auto& b : w) b = rng();
  for (int64_t i = 0; i < n * k / 32; ++i) { uint16_t h = _cvtss_sh(0.002f * (1 + rng() % 20), 0), mh = _cvtss_sh(-0.01f * (rng() % 5), 0); memcpy(&w[i * 20], &h, 2); memcpy(&w[i * 20 + 2], &mh, 2); }
  for (int64_t m : {16, 32, 128}) {
    std::vector<float> x(m * k), of(m * n), oi(m * n);
    for (auto& v : x) v = nd(rng);
    auto time = [&](auto f) { double best = 1e30; for (int i = 0; i < 30; ++i) { auto t = std::chrono::steady_clock::now(); f(); best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count()); } return best; };
    Problem p{x.data(), w.data(), of.data(), m, n, k};
    double tf = time([&] { ferrox_avx512::Run(kQ4_1, p, nullptr, 0, n); });
    double ti = time([&] { Run16(x.data(), w.data(), oi.data(), m, n, k); });
    double err = 0, mag = 0;
    for (int64_t i = 0; i < m * n; ++i) { err = std::max(err, (double)std::fabs(of[i] - oi[i])); mag = std::max(mag, (double)std::fabs(of[i])); }
    printf("rows %ld: float panel %.0f us (%.1f GFLOP/s), int16 vpdpwssd %.0f us (%.1f GFLOP/s), x%.2f; max |diff| %.2e of max |out| %.2e\n",
           (long)m, tf, 2.0 * m * n * k / tf / 1e3, ti, 2.0 * m * n * k / ti / 1e3, tf / ti, err, mag);
  }
}
