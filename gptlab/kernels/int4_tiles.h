// The int4 micro-kernel of linear_avx2.cpp: llama.cpp's q4_0 x q8_0 arithmetic. Each row of x is rounded once per
// Linear to int8 in blocks of 32 inputs (x ~ xq * d, d = max|x| / 127 per block, |xq| <= 127), and the weights'
// 4-bit integers are multiplied with it by byte dot products (four products per int32 lane: AVX512-VNNI's and
// AVX-VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd), summed exactly in int32 per block.
//
// The layout (pack_int4): per panel of 16 output rows, 64 bytes per 8 input columns k0..k0+7, byte 4 r + j holding
// row r's q[k0 + j] in its low nibble and q[k0 + 4 + j] in its high one. One 64-byte load masked to low nibbles is 16
// rows' four consecutive weights, an int32 lane each, against xq[k0..k0+3] broadcast: one vpdpbusd (the weights the
// unsigned operand, 0..15; x the signed one); the high nibbles go against xq[k0+4..k0+7]. An AVX2 register takes the
// first 32 bytes (rows 0-7) and then the last (rows 8-15).
//
// Per row and output lane, with w = q * s + m per group of inputs (s, m fp16 per group and row, exact: see
// gptlab/integer_weights.py), every build runs the same fp32 operations in the same order, so their outputs are
// equal to the bit: per block b, u = fma(float(sum_b q * xq), d_b, u); per group, t = fma(u, s, fma(m, M_g, t)),
// with M_g = sum over the group's blocks of d_b * (sum_b xq) made once per row (`block_sums`).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "input_quant.h"
#include "linear_avx2.h"

namespace GPTLAB_NS::int4_tiles {

constexpr int64_t kBlock = input_quant::kBlock;  // inputs per activation scale; a weight group is whole blocks
#if defined(GPTLAB_AVX512)
constexpr int kRows = 8;  // rows of x per call: 8 accumulators, 8 block sums and 8 totals stay in 32 zmm registers
#else
constexpr int kRows = 4;  // AVX2 has 16 ymm registers: a 16-row panel is two of them per row
#endif

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(GPTLAB_AVX512)
// xq (R rows, stride ldx), d (rows, stride ldb: one per block), msum (rows, stride ldg: M_g), panel's K / 2 * 16
// bytes, qp its (groups, 2, 16) fp16 scales and offsets
template <int R>
inline void tile(const int8_t* xq, int64_t ldx, const float* d, int64_t ldb, const float* msum, int64_t ldg,
                 const uint8_t* panel, const at::Half* qp, int64_t K, int64_t group, float out[][kPanel]) {
  constexpr int C = R == 1 ? 4 : R <= 3 ? 2 : 1;  // accumulators per row: chains that do not wait on each other
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 t[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
  const int64_t G = K / group, per_group = group / kBlock;  // counted, not divided, in the loops
  for (int64_t g = 0, b = 0; g < G; ++g, qp += 2 * kPanel) {
    __m512 u[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) u[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < per_group; ++i, ++b) {
      const int64_t k0 = b * kBlock;
      const uint8_t* w = panel + k0 * kPanel / 2;
      prefetch_ahead(w, kBlock * kPanel / 2);
      __m512i acc[R][C];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xq + r * ldx + k0 + 8 * c;
          acc[r][(2 * c) % C] = _mm512_dpbusd_epi32(acc[r][(2 * c) % C], lo, _mm512_set1_epi32(quad(x)));
          acc[r][(2 * c + 1) % C] = _mm512_dpbusd_epi32(acc[r][(2 * c + 1) % C], hi, _mm512_set1_epi32(quad(x + 4)));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i a = acc[r][0];
#pragma GCC unroll 4
        for (int c = 1; c < C; ++c) a = _mm512_add_epi32(a, acc[r][c]);
        u[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(d[r * ldb + b]), u[r]);
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp))),
                 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + kPanel)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      t[r] = _mm512_fmadd_ps(u[r], s, _mm512_fmadd_ps(m, _mm512_set1_ps(msum[r * ldg + g]), t[r]));
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], t[r]);
}

#else
// acc + (four byte products of lo and xlo) + (four of hi and xhi) in each int32 lane: weights unsigned (0..15), x
// signed
inline __m256i dot8(__m256i acc, __m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
#if defined(GPTLAB_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, xlo), hi, xhi);
#else
  // pairs of products in int16 (at most 2 * 15 * 127), both halves' pairs added there (at most 7620: no
  // saturation), then pairs of those in int32
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

template <int R>
inline void tile(const int8_t* xq, int64_t ldx, const float* d, int64_t ldb, const float* msum, int64_t ldg,
                 const uint8_t* panel, const at::Half* qp, int64_t K, int64_t group, float out[][kPanel]) {
  const __m256i nibble = _mm256_set1_epi8(15);
  float t[R][kPanel] = {};
  const int64_t G = K / group, per_group = group / kBlock;
  for (int64_t g = 0, b = 0; g < G; ++g, qp += 2 * kPanel) {
    float u[R][kPanel] = {};
    for (int64_t i = 0; i < per_group; ++i, ++b) {
      const int64_t k0 = b * kBlock;
      const uint8_t* w = panel + k0 * kPanel / 2;
      // both halves of the panel (rows 0-7, then 8-15) against each broadcast of x: a broadcast made once per row
      // and four bytes, and 2 R accumulators, the four weight registers and the broadcasts held in 16 registers
      __m256i acc[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c)),
                      v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c + 32));
        const __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble),
                      lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xq + r * ldx + k0 + 8 * c;
          const __m256i xlo = _mm256_set1_epi32(quad(x)), xhi = _mm256_set1_epi32(quad(x + 4));
          acc[r][0] = dot8(acc[r][0], lo0, xlo, hi0, xhi);
          acc[r][1] = dot8(acc[r][1], lo1, xlo, hi1, xhi);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(u[r] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(d[r * ldb + b]),
                                                          _mm256_loadu_ps(u[r] + 8 * h)));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + 8 * h))),
                   m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + kPanel + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_fmadd_ps(m, _mm256_set1_ps(msum[r * ldg + g]), _mm256_loadu_ps(t[r] + 8 * h));
        _mm256_storeu_ps(t[r] + 8 * h, _mm256_fmadd_ps(_mm256_loadu_ps(u[r] + 8 * h), s, sum));
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out[r], t[r], sizeof t[r]);
}
#endif

}  // namespace GPTLAB_NS::int4_tiles
