// The int8 micro-kernels of linear_avx2.cpp: rows of x in 16-bit fixed point against one panel of int8 weights,
// integer multiply-adds summed exactly in int32 and scaled in fp32 (int4's are in int4_tiles.h).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "linear_avx2.h"

namespace GPTLAB_NS::int_tiles {

constexpr int64_t kExactPairs = 256;
// rows of x per call. AVX2's 16 ymm registers hold 3 rows' 6 accumulators, the two widened weight registers and the
// broadcasts with room to spare: at 4 or 6 rows GCC kept an accumulator on the stack, a chain through memory that
// every pair waited on (576 x 1536 at 32 rows, one thread of a Zen 3: 6 rows 36 GMAC/s, 4 rows 35, 3 rows 56, and
// 68 with the pair loop unrolled twice, where bf16's FMAs give 44)
#if defined(GPTLAB_AVX512)
constexpr int kRows = 6;
#else
constexpr int kRows = 3;
#endif

// int8: x in 16-bit fixed point (per row: x ~ xq * xscale, |xq| <= 32767) against the weights' integers.
// A panel's column pair (k, k + 1) is laid out so that 8 rows' weights widen to (q[r][k], q[r][k + 1]) int16 pairs
// in one register; _mm256_madd_epi16 multiplies them by the pair (xq[k], xq[k + 1]) and adds the two products into
// an int32. Per 32 weights and row of x: 2 multiply-adds and 2 adds (AVX-VNNI: 2 vpdpwssd), plus 2 widenings shared
// by the rows, where converting every weight to fp32 took 18 instructions.
// 32 bytes per pair, rows 0-7 then 8-15. The int32 sums are exact for 256 pairs (2 * 32767 * 127 * 256 < 2^31),
// then go to fp32 totals, scaled by xscale at the end; the weight's row scale comes in linear_impl.
#if !defined(GPTLAB_AVX512)
// acc + the pair products of w and x in each int32 lane: AVX-VNNI's vpdpwssd does both in one instruction (the
// same exact sums)
inline __m256i madd_add(__m256i acc, __m256i w, __m256i x) {
#if defined(GPTLAB_AVXVNNI)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
#define GPTLAB_QROW(r)                                                                        \
  if constexpr (R > r) {                                                                      \
    int32_t pair;                                                                             \
    std::memcpy(&pair, xq + r * ldx + 2 * j, sizeof pair);                                    \
    const __m256i xb = _mm256_set1_epi32(pair);                                               \
    a##r##0 = madd_add(a##r##0, w0, xb);                                                      \
    a##r##1 = madd_add(a##r##1, w1, xb);                                                      \
  }
#define GPTLAB_QROWS GPTLAB_QROW(0) GPTLAB_QROW(1) GPTLAB_QROW(2)
// tot[r] += a * s + m * sum (here s = 1, m = 0)
#define GPTLAB_QFLUSH(r, s0, s1, m0, m1, sum)                                                 \
  if constexpr (R > r) {                                                                      \
    const __m256 xs = _mm256_set1_ps(sum);                                                    \
    _mm256_storeu_ps(tot[r], _mm256_fmadd_ps(m0, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##r##0), s0,             \
                                                                       _mm256_loadu_ps(tot[r]))));               \
    _mm256_storeu_ps(tot[r] + 8, _mm256_fmadd_ps(m1, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##r##1), s1,         \
                                                                           _mm256_loadu_ps(tot[r] + 8))));       \
  }
#define GPTLAB_QZERO \
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;

template <int R>
inline void tile_i8(const int16_t* xq, int64_t ldx, const float* xscale, const int8_t* panel, int64_t pairs,
                    float out[][kPanel]) {
  static_assert(R <= kRows, "AVX2's int8 micro-kernel takes up to 3 rows");
  float tot[R][kPanel] = {};
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += kExactPairs) {
    GPTLAB_QZERO
    const int64_t j1 = std::min(pairs, j0 + kExactPairs);
    // two pairs a trip: GCC then adds into the accumulators in place, without a register copy for each
#pragma GCC unroll 2
    for (int64_t j = j0; j < j1; ++j) {
      const int8_t* col = panel + j * 2 * kPanel;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + kPanel)));
      GPTLAB_QROWS
    }
    GPTLAB_QFLUSH(0, one, one, zero, zero, 0.0f) GPTLAB_QFLUSH(1, one, one, zero, zero, 0.0f)
    GPTLAB_QFLUSH(2, one, one, zero, zero, 0.0f)
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanel; ++c) out[r][c] = tot[r][c] * xscale[r];
}

#undef GPTLAB_QROW
#undef GPTLAB_QROWS
#undef GPTLAB_QFLUSH
#undef GPTLAB_QZERO

#else
// AVX-512 VNNI: one register holds a column pair's 16 rows as int16 pairs, and vpdpwssd multiplies them by
// (xq[k], xq[k + 1]) and adds both products to the int32 lane: the int32 sums of AVX2's madd + add, exactly, and
// the same fp32 operations on them in the same order, so both builds give bit-identical outputs.
// The pair's 32 bytes (rows 0-7 then 8-15) sign-extend to one register, lanes in output order.
// Pairs alternate between C accumulators per row (C = 4 for one row, 2 for two or three: chains that do not wait
// on each other), added exactly in int32 before each flush.
#define GPTLAB_ZQACC                                                                                             \
  __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,        \
          a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00,     \
          a40 = a00, a41 = a00, a42 = a00, a43 = a00, a50 = a00, a51 = a00, a52 = a00, a53 = a00;
#define GPTLAB_ZQ(r, c, w, jj)                                                      \
  if constexpr (R > r) {                                                            \
    int32_t pair;                                                                   \
    std::memcpy(&pair, xq + r * ldx + 2 * (jj), sizeof pair);                       \
    a##r##c = _mm512_dpwssd_epi32(a##r##c, w, _mm512_set1_epi32(pair));             \
  }
#define GPTLAB_ZQS(c, w, jj) GPTLAB_ZQ(0, c, w, jj) GPTLAB_ZQ(1, c, w, jj) GPTLAB_ZQ(2, c, w, jj) \
  GPTLAB_ZQ(3, c, w, jj) GPTLAB_ZQ(4, c, w, jj) GPTLAB_ZQ(5, c, w, jj)
#define GPTLAB_ZSTEP(c)                 \
  if constexpr (C > c) {                \
    const __m512i w = wload(j + c);     \
    GPTLAB_ZQS(c, w, j + c)             \
  }
// the accumulators of pairs [jbegin, jend)
#define GPTLAB_ZBLOCK(jbegin, jend)                                                          \
  GPTLAB_ZQACC {                                                                             \
    int64_t j = jbegin;                                                                      \
    for (; j + C <= (jend); j += C) {                                                        \
      prefetch_ahead(wptr(j), C * kPairBytes);                                               \
      GPTLAB_ZSTEP(0) GPTLAB_ZSTEP(1) GPTLAB_ZSTEP(2) GPTLAB_ZSTEP(3)                        \
    }                                                                                        \
    for (; j < (jend); ++j) {                                                                \
      const __m512i w = wload(j);                                                            \
      GPTLAB_ZQS(0, w, j)                                                                    \
    }                                                                                        \
  }
// t[r] = m * sum + (a * s + t[r]), AVX2's two FMAs per half
#define GPTLAB_ZQFLUSH(r, s, m, sum)                                                                           \
  if constexpr (R > r) {                                                                                       \
    const __m512i a = _mm512_add_epi32(_mm512_add_epi32(a##r##0, a##r##1), _mm512_add_epi32(a##r##2, a##r##3)); \
    t##r = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, t##r));            \
  }
#define GPTLAB_ZQOUT(r) \
  if constexpr (R > r) _mm512_storeu_ps(out[r], _mm512_mul_ps(t##r, _mm512_set1_ps(xscale[r])));
#define GPTLAB_ZQOUTS GPTLAB_ZQOUT(0) GPTLAB_ZQOUT(1) GPTLAB_ZQOUT(2) GPTLAB_ZQOUT(3) GPTLAB_ZQOUT(4) GPTLAB_ZQOUT(5)

template <int R>
constexpr int kChains = R == 1 ? 4 : R <= 3 ? 2 : 1;

template <int R>
inline void tile_i8(const int16_t* xq, int64_t ldx, const float* xscale, const int8_t* panel, int64_t pairs,
                    float out[][kPanel]) {
  constexpr int C = kChains<R>;
  constexpr int kPairBytes = 2 * kPanel;
  const auto wptr = [panel](int64_t j) { return panel + j * 2 * kPanel; };
  const auto wload = [panel](int64_t j) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 2 * kPanel)));
  };
  __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0, t4 = t0, t5 = t0;
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += kExactPairs) {
    GPTLAB_ZBLOCK(j0, std::min(pairs, j0 + kExactPairs))
    GPTLAB_ZQFLUSH(0, one, zero, 0.0f) GPTLAB_ZQFLUSH(1, one, zero, 0.0f) GPTLAB_ZQFLUSH(2, one, zero, 0.0f)
    GPTLAB_ZQFLUSH(3, one, zero, 0.0f) GPTLAB_ZQFLUSH(4, one, zero, 0.0f) GPTLAB_ZQFLUSH(5, one, zero, 0.0f)
  }
  GPTLAB_ZQOUTS
}

#undef GPTLAB_ZQACC
#undef GPTLAB_ZQ
#undef GPTLAB_ZQS
#undef GPTLAB_ZSTEP
#undef GPTLAB_ZBLOCK
#undef GPTLAB_ZQFLUSH
#undef GPTLAB_ZQOUT
#undef GPTLAB_ZQOUTS
#endif

}  // namespace GPTLAB_NS::int_tiles
