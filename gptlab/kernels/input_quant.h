// The inputs of the int8 and int4 products rounded to integers, once per Linear call (linear_avx2.cpp's
// `product`): int8's rows in 16-bit fixed point, int4's blocks of 32 in int8 (llama.cpp's q8_0).
//
// At 32 rows this rounding is a quarter of an int4 product's time when done one value at a time, and it runs on one
// thread while the product runs on all: so it is written in AVX2 (every build has it; one code for all three keeps
// their outputs equal to the bit) and rows are split over the threads. Every value is the same IEEE operation as
// the scalar definition's (max of |x|, x * (127 / max) rounded to nearest even, clamped; integer sums exact), so the
// results do not depend on the vector width or the split.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "linear_avx2.h"

namespace GPTLAB_NS::input_quant {

constexpr int64_t kBlock = 32;  // int4's inputs per activation scale

// max |v| over n values (n a multiple of 8), and whether all are finite (an inf or NaN: false; the max is then unused)
inline float abs_max(const float* v, int64_t n, bool* finite) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 top = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k));
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and NaN
    top = _mm256_max_ps(top, a);
  }
  *finite = _mm256_movemask_ps(ok) == 0xff;
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// 8 values times `inv`, rounded to nearest even and clamped to +-limit, as int32
inline __m256i rounded(const float* v, __m256 inv, __m256 limit) {
  const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit));
}

// the rows of x split over the threads, each task at least ~16K values (fewer: the hand-off costs more than it saves)
template <typename F>
inline void over_rows(int64_t M, int64_t K, const F& f) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) f(m);
  });
}

// x (M, K) fp32 -> 16-bit fixed point per row: xq = round(x / s) with s = max|x| / 32767 (a row of zeros:
// s = 1; a row with inf or NaN: s = NaN, so its outputs are NaN as a float product's would be)
inline void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* scale) {
  over_rows(M, K, [&](int64_t m) {
    const float* row = x + m * K;
    const int64_t K8 = K - K % 8;
    bool finite;
    float top = abs_max(row, K8, &finite);
    for (int64_t k = K8; k < K; ++k) {
      top = std::max(top, std::fabs(row[k]));
      finite = finite && std::isfinite(row[k]);
    }
    scale[m] = !finite ? std::nanf("") : top > 0.0f ? top / 32767.0f : 1.0f;
    const float inv = finite && top > 0.0f ? 32767.0f / top : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv), limit = _mm256_set1_ps(32767.0f);
    int16_t* out = xq + m * K;
    if (!finite) return (void)std::memset(out, 0, K * sizeof *out);  // never a NaN cast to an integer
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256i i = rounded(row + k, vinv, limit);  // |i| <= 32767: packs without saturating
      const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), p);
    }
    for (int64_t k = K8; k < K; ++k)
      out[k] = static_cast<int16_t>(std::clamp(std::nearbyint(row[k] * inv), -32767.0f, 32767.0f));
  });
}

// x (M, K) fp32, K a multiple of 32 -> int8 per block of 32 (int4's activations: q8_0's rounding): xq =
// round(x * (127 / max|x|)) and d = max|x| / 127 per block (a block of zeros: d = 0; with inf or NaN: xq = 0 and
// d = NaN, so its outputs are NaN as a float product's would be), and per row and group of gs inputs the sum over
// its blocks of d * sum(xq), added in block order
inline void quantize_blocks(const float* x, int64_t M, int64_t K, int64_t gs, int8_t* xq, float* d, float* msum) {
  over_rows(M, K, [&](int64_t m) {
    const __m256 limit = _mm256_set1_ps(127.0f);
    for (int64_t g0 = 0; g0 < K; g0 += gs) {
      float group_sum = 0.0f;
      for (int64_t k0 = g0; k0 < g0 + gs; k0 += kBlock) {
        const float* block = x + m * K + k0;
        bool finite;
        const float top = abs_max(block, kBlock, &finite);
        const float scale = !finite ? std::nanf("") : top / 127.0f, inv = finite && top > 0.0f ? 127.0f / top : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i sum = _mm256_setzero_si256();
        int8_t* out = xq + m * K + k0;
        if (!finite) std::memset(out, 0, kBlock);  // never a NaN cast to an integer
        for (int k = 0; finite && k < kBlock; k += 16) {  // two groups of 8 int32 -> 16 int8 (|v| <= 127: no saturation)
          const __m256i a = rounded(block + k, vinv, limit), b = rounded(block + k + 8, vinv, limit);
          sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
          const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)),
                        z = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(w, z));
        }
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
        d[m * (K / kBlock) + k0 / kBlock] = scale;
        group_sum += scale * static_cast<float>(total);
      }
      msum[m * (K / gs) + g0 / gs] = group_sum;
    }
  });
}

}  // namespace GPTLAB_NS::input_quant
