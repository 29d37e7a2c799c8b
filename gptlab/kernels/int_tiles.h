// The int8 and int4 micro-kernels of linear_avx2.cpp: rows of x in 16-bit fixed point against one panel of integer
// weights, integer multiply-adds summed exactly in int32 and scaled in fp32.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "linear_avx2.h"

namespace gptlab_avx2::int_tiles {

// int8 and int4: x in 16-bit fixed point (per row: x ~ xq * xscale, |xq| <= 32767) against the weights' integers.
// A panel's column pair (k, k + 1) is laid out so that 8 rows' weights widen to (q[r][k], q[r][k + 1]) int16 pairs
// in one register; _mm256_madd_epi16 multiplies them by the pair (xq[k], xq[k + 1]) and adds the two products into
// an int32. Per 32 weights and row of x: 2 multiply-adds and 2 adds, plus 2 widenings shared by the rows (int4: 3
// more to split the nibbles), where converting every weight to fp32 took 18 instructions.
// * int8: 32 bytes per pair, rows 0-7 then 8-15. The int32 sums are exact for 256 pairs (2 * 32767 * 127 * 256 <
//   2^31), then go to fp32 totals; the weight's row scale comes in linear_impl.
// * int4: 16 bytes per pair, the low nibbles holding rows 0-7's pairs and the high ones rows 8-15's. Per group of
//   columns (at most 256: exact in int32) the sum goes to the fp32 total times the group's scale s, plus its offset
//   m times the group's sum of xq (w = q * s + m).
// The totals are scaled by xscale at the end.
constexpr int64_t kExactPairs = 256;
#define GPTLAB_QROW(r)                                                                        \
  if constexpr (R > r) {                                                                      \
    int32_t pair;                                                                             \
    std::memcpy(&pair, xq + r * ldx + 2 * j, sizeof pair);                                    \
    const __m256i xb = _mm256_set1_epi32(pair);                                               \
    a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(w0, xb));                           \
    a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(w1, xb));                           \
  }
#define GPTLAB_QROWS GPTLAB_QROW(0) GPTLAB_QROW(1) GPTLAB_QROW(2) GPTLAB_QROW(3) GPTLAB_QROW(4) GPTLAB_QROW(5)
// tot[r] += a * s + m * sum (int8: s = 1, m = 0)
#define GPTLAB_QFLUSH(r, s0, s1, m0, m1, sum)                                                 \
  if constexpr (R > r) {                                                                      \
    const __m256 xs = _mm256_set1_ps(sum);                                                    \
    _mm256_storeu_ps(tot[r], _mm256_fmadd_ps(m0, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##r##0), s0,             \
                                                                       _mm256_loadu_ps(tot[r]))));               \
    _mm256_storeu_ps(tot[r] + 8, _mm256_fmadd_ps(m1, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##r##1), s1,         \
                                                                           _mm256_loadu_ps(tot[r] + 8))));       \
  }
#define GPTLAB_QZERO                                                                                          \
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,    \
          a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;

template <int R>
inline void tile_i8(const int16_t* xq, int64_t ldx, const float* xscale, const int8_t* panel, int64_t pairs,
                    float out[][kPanel]) {
  float tot[R][kPanel] = {};
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += kExactPairs) {
    GPTLAB_QZERO
    for (int64_t j = j0; j < std::min(pairs, j0 + kExactPairs); ++j) {
      const int8_t* col = panel + j * 2 * kPanel;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + kPanel)));
      GPTLAB_QROWS
    }
    GPTLAB_QFLUSH(0, one, one, zero, zero, 0.0f) GPTLAB_QFLUSH(1, one, one, zero, zero, 0.0f)
    GPTLAB_QFLUSH(2, one, one, zero, zero, 0.0f) GPTLAB_QFLUSH(3, one, one, zero, zero, 0.0f)
    GPTLAB_QFLUSH(4, one, one, zero, zero, 0.0f) GPTLAB_QFLUSH(5, one, one, zero, zero, 0.0f)
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanel; ++c) out[r][c] = tot[r][c] * xscale[r];
}

// qp: the panel's (groups, 2, 16) scales and offsets; xqsum (rows, groups, row stride G): each group's sum of xq
template <int R>
inline void tile_q4(const int16_t* xq, int64_t ldx, const float* xscale, const float* xqsum, const uint8_t* panel,
                    const float* qp, int64_t pairs, int64_t group_pairs, float out[][kPanel]) {
  float tot[R][kPanel] = {};
  const int64_t G = pairs / group_pairs;
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g, qp += 2 * kPanel) {
    GPTLAB_QZERO
    for (int64_t j = g * group_pairs; j < (g + 1) * group_pairs; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + j * kPanel));
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(v, nibble));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nibble));
      GPTLAB_QROWS
    }
    const __m256 s0 = _mm256_loadu_ps(qp), s1 = _mm256_loadu_ps(qp + 8);
    const __m256 m0 = _mm256_loadu_ps(qp + kPanel), m1 = _mm256_loadu_ps(qp + kPanel + 8);
    GPTLAB_QFLUSH(0, s0, s1, m0, m1, xqsum[g]) GPTLAB_QFLUSH(1, s0, s1, m0, m1, xqsum[G + g])
    GPTLAB_QFLUSH(2, s0, s1, m0, m1, xqsum[2 * G + g]) GPTLAB_QFLUSH(3, s0, s1, m0, m1, xqsum[3 * G + g])
    GPTLAB_QFLUSH(4, s0, s1, m0, m1, xqsum[4 * G + g]) GPTLAB_QFLUSH(5, s0, s1, m0, m1, xqsum[5 * G + g])
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanel; ++c) out[r][c] = tot[r][c] * xscale[r];
}
#undef GPTLAB_QROW
#undef GPTLAB_QROWS
#undef GPTLAB_QFLUSH
#undef GPTLAB_QZERO

}  // namespace gptlab_avx2::int_tiles
