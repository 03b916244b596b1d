// The sampler's passes over the vocabulary on x86 CPUs with AVX2 (ferrox_jax/sampling.py,
// its kernel path): per row, the raw logits' maximum, log-sum-exp and finiteness, the
// greedy token, and for a row with a temperature the filtered, seeded draw.
//
// XLA CPU ran each of the sampler's reductions over a [B, V] array as a scalar loop
// (~1.5 ns an element: 0.28 ms for one row of SmolLM2's 49,152 logits, 3.1 ms for 32), and
// the top-k / top-p filters as 24 bisection steps of two masked reductions each (41 ms for
// 32 rows at temperature 0.7, top_p 0.9). Here each row is a few vectorised passes, rows
// shared over XLA's intra-op pool.
//
// Operands, B rows, V logits each:
//   raw          f32[B, V]  the model's logits (what logprobs are taken from)
//   logits       f32[B, V]  after penalties, logit_bias and the grammar mask (may equal raw)
//   temperature  f32[B]     0: greedy (the token is the first maximum of `logits`)
//   top_k        s32[B]     0: off (the host clamps k >= V to 0)
//   top_p        f32[B]     1: off
//   min_p        f32[B]     0: off
//   uniform      f32[B]     the row's draw in [0, 1): uniform(fold_in(key(seed), position))
// Results:
//   token        s32[B]     the greedy or drawn token
//   row_max      f32[B]     max(raw)
//   log_sum      f32[B]     log(sum(exp(raw - row_max)))
//   finite       s32[B]     1 if every raw logit is finite (0: the step's NaN fault)
//
// The draw is the jnp path's (sampling.py:_draw), with the thresholds exact instead of
// bisected: e_i = exp(logits_i / T - max / T) (so the most likely token has e = 1); a token
// survives if e_i >= t, t the largest of
//   top-k: the smallest value keeping at most k tokens (just above the (k+1)-th largest e),
//   top-p: the largest value whose kept mass still reaches top_p of the total,
//   min-p: min_p (min_p times the most likely token's probability),
// capped at 1 (the most likely token always survives). The (k+1)-th largest and the top-p
// crossing are found without a sort of the vocabulary: a histogram of count and mass over
// the top 12 bits of e's float bits (non-negative floats order as their bits), walked from
// the top to the bucket holding the crossing, then that bucket's values sorted. The token is
// the first whose running sum of surviving e (in vocabulary order) reaches (1 - u) times their
// total: the inverse-CDF draw, so it depends only on (seed, position) and the row's logits.
// Exponentials below float's range (a masked -inf logit among them) are 0.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

constexpr int kBucketShift = 20;         // e's float bits >> 20: exponent and 3 mantissa bits
constexpr int kBuckets = 1024;           // e in [0, 1]: 1.0f is bucket 0x3f8
constexpr int64_t kSumBlock = 256;       // the draw's running sum walks blocks of this many

inline __m256 ExpOrZero(__m256 x) {
  return _mm256_and_ps(ferrox::Exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(ferrox::kExpFloor), _CMP_GE_OQ));
}

// 8 floats from x[i..i+8), -inf past the row's end (n): a row's tail takes the vector path.
inline __m256 Load(const float* x, int64_t i, int64_t n) {
  if (i + 8 <= n) return _mm256_loadu_ps(x + i);
  alignas(32) float tail[8];
  for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? x[i + j] : -std::numeric_limits<float>::infinity();
  return _mm256_load_ps(tail);
}

// The largest value (NaN ignored; -inf if there is none).
float RowMax(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(Load(x, i, n), m);  // max_ps keeps m on NaN
  return ferrox::Max8(m);
}

// Whether every value is finite: x - x is 0 for a finite x, NaN for inf or NaN.
bool AllFinite(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_sub_ps(v, v));
  }
  for (; i < n; ++i) acc = _mm256_add_ps(acc, _mm256_set1_ps(x[i] - x[i]));
  return ferrox::Sum8(acc) == 0.0f;
}

// sum(exp(x - max)): float lanes over blocks of kSumBlock, the blocks' sums added in double
// (one float sum over 49,152 values was 4e-6 off).
double ExpSum(const float* x, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  double total = 0.0;
  for (int64_t start = 0; start < n; start += kSumBlock) {
    const int64_t end = std::min(n, start + kSumBlock);
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t i = start;
    for (; i + 16 <= end; i += 16) {
      a = _mm256_add_ps(a, ExpOrZero(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
      b = _mm256_add_ps(b, ExpOrZero(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m)));
    }
    for (; i < end; i += 8) a = _mm256_add_ps(a, ExpOrZero(_mm256_sub_ps(Load(x, i, n), m)));
    total += ferrox::Sum8(_mm256_add_ps(a, b));
  }
  return total;
}

// The first index of the value `max` (0 if none equals it: an all-NaN row).
int32_t FirstIndexOf(const float* x, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  for (int64_t i = 0; i < n; i += 8) {
    int bits = _mm256_movemask_ps(_mm256_cmp_ps(Load(x, i, n), m, _CMP_EQ_OQ));
    if (i + 8 > n) bits &= (1 << (n - i)) - 1;  // not the tail's -inf padding
    if (bits != 0) return static_cast<int32_t>(i + __builtin_ctz(bits));
  }
  return 0;
}

// e_i = exp(x_i / t - top / t) into e; returns sum(e) by blocks of kSumBlock into `blocks`.
void Exponentials(const float* x, int64_t n, float temperature, float top, float* e, std::vector<double>& blocks) {
  const __m256 t = _mm256_set1_ps(temperature), m = _mm256_set1_ps(top / temperature);
  blocks.assign((n + kSumBlock - 1) / kSumBlock, 0.0);
  for (int64_t start = 0; start < n; start += kSumBlock) {
    __m256 sum = _mm256_setzero_ps();
    const int64_t end = std::min(n, start + kSumBlock);
    for (int64_t i = start; i < end; i += 8) {
      const __m256 v = ExpOrZero(_mm256_sub_ps(_mm256_div_ps(Load(x, i, n), t), m));
      sum = _mm256_add_ps(sum, v);
      if (i + 8 <= n) {
        _mm256_storeu_ps(e + i, v);
      } else {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, v);
        std::memcpy(e + i, tail, (n - i) * sizeof(float));
      }
    }
    blocks[start / kSumBlock] = ferrox::Sum8(sum);
  }
}

inline int Bucket(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return std::min<int>(bits >> kBucketShift, kBuckets - 1);
}

// The values of e in bucket b, largest first.
std::vector<float> BucketValues(const float* e, int64_t n, int b) {
  std::vector<float> out;
  for (int64_t i = 0; i < n; ++i)
    if (Bucket(e[i]) == b) out.push_back(e[i]);
  std::sort(out.begin(), out.end(), std::greater<float>());
  return out;
}

// The survival threshold of the module comment (e units), total = sum(e).
float Threshold(const float* e, int64_t n, double total, int32_t top_k, float top_p, float min_p) {
  float t = min_p > 0.0f ? min_p : 0.0f;
  const bool want_k = top_k > 0 && top_k < n, want_p = top_p < 1.0f;
  if (want_k || want_p) {
    thread_local std::vector<int64_t> count;
    thread_local std::vector<double> mass;
    count.assign(kBuckets, 0);
    mass.assign(kBuckets, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const int b = Bucket(e[i]);
      count[b] += 1;
      mass[b] += e[i];
    }
    const double target = static_cast<double>(top_p) * total;
    int bk = -1, bp = -1;
    int64_t above = 0, count_above_k = 0;
    double mass_above = 0.0, mass_above_p = 0.0;
    for (int b = kBuckets - 1; b >= 0 && ((want_k && bk < 0) || (want_p && bp < 0)); --b) {
      if (count[b] == 0) continue;
      if (want_k && bk < 0 && above + count[b] > top_k) bk = b, count_above_k = above;
      if (want_p && bp < 0 && mass_above + mass[b] >= target) bp = b, mass_above_p = mass_above;
      above += count[b];
      mass_above += mass[b];
    }
    std::vector<float> values;  // the last bucket read, largest first (both crossings may share one)
    int read = -1;
    if (bk >= 0) {  // the (k+1)-th largest e; keep what is above it
      values = BucketValues(e, n, read = bk);
      t = std::max(t, std::nextafter(values[top_k - count_above_k], std::numeric_limits<float>::infinity()));
    }
    if (bp >= 0) {  // the value at which the running mass, largest first, reaches the target
      if (bp != read) values = BucketValues(e, n, read = bp);
      double cum = mass_above_p;
      float at = values.back();
      for (float v : values) {
        cum += v;
        if (cum >= target) {
          at = v;
          break;
        }
      }
      t = std::max(t, at);
    }
  }
  return std::min(t, 1.0f);
}

// The inverse-CDF draw over e >= t (module comment).
int32_t Draw(const float* e, int64_t n, float t, float uniform, std::vector<double>& blocks) {
  if (t > 0.0f) {  // the blocks' sums of what survives
    const __m256 tv = _mm256_set1_ps(t);
    for (int64_t start = 0; start < n; start += kSumBlock) {
      __m256 sum = _mm256_setzero_ps();
      const int64_t end = std::min(n, start + kSumBlock);
      for (int64_t i = start; i < end; i += 8) {
        const __m256 v = i + 8 <= n ? _mm256_loadu_ps(e + i) : Load(e, i, n);
        sum = _mm256_add_ps(sum, _mm256_and_ps(v, _mm256_cmp_ps(v, tv, _CMP_GE_OQ)));
      }
      blocks[start / kSumBlock] = ferrox::Sum8(sum);
    }
  }
  double total = 0.0;
  for (double b : blocks) total += b;
  const double target = (1.0 - static_cast<double>(uniform)) * total;
  double cum = 0.0;
  int64_t block = 0;
  for (; block + 1 < static_cast<int64_t>(blocks.size()) && cum + blocks[block] < target; ++block) cum += blocks[block];
  for (int64_t i = block * kSumBlock; i < n; ++i) {
    if (e[i] >= t && e[i] > 0.0f) {
      cum += e[i];
      if (cum >= target) return static_cast<int32_t>(i);
    }
  }
  for (int64_t i = n - 1; i > 0; --i)  // rounding left the target unreached: the last survivor
    if (e[i] >= t && e[i] > 0.0f) return static_cast<int32_t>(i);
  return 0;
}

struct Rows {
  const float *raw, *logits, *temperature, *top_p, *min_p, *uniform;
  const int32_t* top_k;
  int32_t *token, *finite;
  float *row_max, *log_sum;
  int64_t vocab;
};

void SampleRow(const Rows& p, int64_t r) {
  const int64_t n = p.vocab;
  const float* raw = p.raw + r * n;
  const float* x = p.logits + r * n;
  const float max = RowMax(raw, n);
  p.row_max[r] = max;
  p.log_sum[r] = static_cast<float>(std::log(ExpSum(raw, n, max)));
  p.finite[r] = AllFinite(raw, n) ? 1 : 0;
  const float top = x == raw ? max : RowMax(x, n);
  const float temperature = p.temperature[r];
  if (!(temperature > 0.0f) || !std::isfinite(top)) {
    p.token[r] = FirstIndexOf(x, n, top);
    return;
  }
  thread_local std::vector<float> e;
  thread_local std::vector<double> blocks;
  e.resize(n);
  Exponentials(x, n, temperature, top, e.data(), blocks);
  double total = 0.0;
  for (double b : blocks) total += b;
  const float t = Threshold(e.data(), n, total, p.top_k[r], p.top_p[r], p.min_p[r]);
  p.token[r] = Draw(e.data(), n, t, p.uniform[r], blocks);
}

#pragma GCC pop_options

// Rows per thread below which one thread does them all (a row is ~0.05-0.2 ms).
constexpr int64_t kMinRowsPerThread = 2;

ffi::Error SampleRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> raw, ffi::Buffer<ffi::F32> logits,
                          ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                          ffi::Buffer<ffi::F32> min_p, ffi::Buffer<ffi::F32> uniform,
                          ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::F32> row_max,
                          ffi::ResultBuffer<ffi::F32> log_sum, ffi::ResultBuffer<ffi::S32> finite) {
  const auto rd = raw.dimensions(), ld = logits.dimensions();
  if (rd.size() != 2 || ld.size() != 2 || rd[0] != ld[0] || rd[1] != ld[1] || rd[1] < 1)
    return ffi::Error::InvalidArgument("ferrox_sample_rows: raw and logits must both be f32[B, V], V >= 1");
  const int64_t rows = rd[0];
  for (auto d : {temperature.dimensions(), top_k.dimensions(), top_p.dimensions(), min_p.dimensions(),
                 uniform.dimensions()})
    if (d.size() != 1 || d[0] != rows) return ffi::Error::InvalidArgument("ferrox_sample_rows: settings must be [B]");
  const Rows p{raw.typed_data(), logits.typed_data(), temperature.typed_data(), top_p.typed_data(),
               min_p.typed_data(), uniform.typed_data(), top_k.typed_data(), token->typed_data(),
               finite->typed_data(), row_max->typed_data(), log_sum->typed_data(), rd[1]};
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), rows / kMinRowsPerThread);
  ferrox::ParallelFor(pool, threads, rows, [&](int64_t r) { SampleRow(p, r); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerroxSampleRows, SampleRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
