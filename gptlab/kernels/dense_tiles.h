// The bf16 and fp32 micro-kernels of linear_avx2.cpp: rows of x against one panel of 16 output rows, summed in fp32.
// `tile<R>(x, ldx, xb, panel, K, out)`: out[r][0..16) = x[r] . the panel's columns, for R rows of x (fp32, row
// stride ldx; xb: the same rows in bf16 where x came in bf16, else null).
//
// Panel layouts (linear_avx2.cpp's `pack`), the same for both builds:
// * fp32: column k is 16 consecutive floats (outputs 0-15).
// * bf16: column pairs: pair j holds (W[n][2j], W[n][2j + 1]) for n = 0..15, one 32-bit lane per output, so a
//   shift (the low halves: column 2j) and a mask (the high halves: column 2j + 1) turn a load into fp32 columns,
//   and AVX-512 BF16's vdpbf16ps multiplies the pairs by (x[2j], x[2j + 1]) and adds both products in one go. With
//   K odd the last column is 16 plain values, outputs 0-15.
//
// AVX2 (two 8-float registers per column): per k the panel's 16 weights in fp32, x[r, k] broadcast, 2 FMAs per row
// into 12 fp32 accumulators (the classic 6x16 sgemm tile), so each weight converted serves 6 rows; one row (batch
// 1) unrolls k to keep 8 FMA chains in flight. AVX-512 (one 16-float register per column): bf16 x against bf16
// weights goes through vdpbf16ps (32 products per instruction, each exact in fp32, summed in fp32), fp32 x through
// shift/mask and FMAs; one row keeps 4 chains; several rows of bf16 x go through `tile2`, two panels per call.
// The accumulators are named variables, not an array: GCC keeps an array of them on the stack, storing all of them
// every k (3x slower).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "linear_avx2.h"

namespace GPTLAB_NS::dense_tiles {

#if !defined(GPTLAB_AVX512)
#define GPTLAB_ROW(r, k)                                               \
  if constexpr (R > r) {                                               \
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + (k));          \
    a##r##0 = _mm256_fmadd_ps(w0, xv, a##r##0);                        \
    a##r##1 = _mm256_fmadd_ps(w1, xv, a##r##1);                        \
  }
#define GPTLAB_ROWS(k) GPTLAB_ROW(0, k) GPTLAB_ROW(1, k) GPTLAB_ROW(2, k) GPTLAB_ROW(3, k) GPTLAB_ROW(4, k) \
  GPTLAB_ROW(5, k)
#define GPTLAB_STORE(r)                                                \
  if constexpr (R > r) {                                               \
    _mm256_storeu_ps(out[r], a##r##0);                                 \
    _mm256_storeu_ps(out[r] + 8, a##r##1);                             \
  }
#define GPTLAB_ACCUMULATORS                                                                                    \
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00, \
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define GPTLAB_STORES GPTLAB_STORE(0) GPTLAB_STORE(1) GPTLAB_STORE(2) GPTLAB_STORE(3) GPTLAB_STORE(4) GPTLAB_STORE(5)

inline __m256 bf16_low(const at::BFloat16* p) {  // lanes' low halves (column 2j) in fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
inline __m256 bf16_high(const at::BFloat16* p) {  // lanes' high halves (column 2j + 1)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m256 bf16_high_shifted(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16));
}
inline __m256 bf16_plain(const at::BFloat16* p) {  // 8 consecutive bf16 (the odd tail column)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <int R>
inline void tile(const float* x, int64_t ldx, const at::BFloat16*, const float* panel, int64_t K,
                 float out[][kPanel]) {
  GPTLAB_ACCUMULATORS
  for (int64_t k = 0; k < K; ++k) {
    prefetch_ahead(panel + k * kPanel, 64);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    GPTLAB_ROWS(k)
  }
  GPTLAB_STORES
}

template <int R>
inline void tile(const float* x, int64_t ldx, const at::BFloat16*, const at::BFloat16* panel, int64_t K,
                 float out[][kPanel]) {
  GPTLAB_ACCUMULATORS
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const at::BFloat16* p = panel + k * kPanel;
    prefetch_ahead(p, 64);
    {
      const __m256 w0 = bf16_low(p), w1 = bf16_low(p + kPanel);
      GPTLAB_ROWS(k)
    }
    // the high halves by two shifts, not a mask: 12 accumulators, 2 columns and x fill 15 of the 16 registers
    const __m256 w0 = bf16_high_shifted(p), w1 = bf16_high_shifted(p + kPanel);
    GPTLAB_ROWS(k + 1)
  }
  if (k < K) {
    const __m256 w0 = bf16_plain(panel + k * kPanel), w1 = bf16_plain(panel + k * kPanel + 8);
    GPTLAB_ROWS(k)
  }
  GPTLAB_STORES
}

// one row: 4 columns per step into separate accumulators, so the FMAs do not wait on each other
inline void tile1(const float* x, const at::BFloat16* xb, const float* panel, int64_t K, float out[][kPanel]) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* p = panel + k * kPanel;
    prefetch_ahead(p, 4 * kPanel * 4);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p), _mm256_broadcast_ss(x + k), a0);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8), _mm256_broadcast_ss(x + k), b0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 16), _mm256_broadcast_ss(x + k + 1), a1);
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 24), _mm256_broadcast_ss(x + k + 1), b1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 32), _mm256_broadcast_ss(x + k + 2), a2);
    b2 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 40), _mm256_broadcast_ss(x + k + 2), b2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 48), _mm256_broadcast_ss(x + k + 3), a3);
    b3 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 56), _mm256_broadcast_ss(x + k + 3), b3);
  }
  float rest[1][kPanel];
  tile<1>(x + k, 0, xb, panel + k * kPanel, K - k, rest);
  a0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  b0 = _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3));
  _mm256_storeu_ps(out[0], _mm256_add_ps(a0, _mm256_loadu_ps(rest[0])));
  _mm256_storeu_ps(out[0] + 8, _mm256_add_ps(b0, _mm256_loadu_ps(rest[0] + 8)));
}

inline void tile1(const float* x, const at::BFloat16* xb, const at::BFloat16* panel, int64_t K,
                  float out[][kPanel]) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const at::BFloat16* p = panel + k * kPanel;
    prefetch_ahead(p, 4 * kPanel * 2);
    a0 = _mm256_fmadd_ps(bf16_low(p), _mm256_broadcast_ss(x + k), a0);
    b0 = _mm256_fmadd_ps(bf16_low(p + 16), _mm256_broadcast_ss(x + k), b0);
    a1 = _mm256_fmadd_ps(bf16_high(p), _mm256_broadcast_ss(x + k + 1), a1);
    b1 = _mm256_fmadd_ps(bf16_high(p + 16), _mm256_broadcast_ss(x + k + 1), b1);
    a2 = _mm256_fmadd_ps(bf16_low(p + 32), _mm256_broadcast_ss(x + k + 2), a2);
    b2 = _mm256_fmadd_ps(bf16_low(p + 48), _mm256_broadcast_ss(x + k + 2), b2);
    a3 = _mm256_fmadd_ps(bf16_high(p + 32), _mm256_broadcast_ss(x + k + 3), a3);
    b3 = _mm256_fmadd_ps(bf16_high(p + 48), _mm256_broadcast_ss(x + k + 3), b3);
  }
  float rest[1][kPanel];
  tile<1>(x + k, 0, xb, panel + k * kPanel, K - k, rest);  // up to 3 columns: a pair and the odd one
  a0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  b0 = _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3));
  _mm256_storeu_ps(out[0], _mm256_add_ps(a0, _mm256_loadu_ps(rest[0])));
  _mm256_storeu_ps(out[0] + 8, _mm256_add_ps(b0, _mm256_loadu_ps(rest[0] + 8)));
}
#undef GPTLAB_ROW
#undef GPTLAB_ROWS
#undef GPTLAB_STORE
#undef GPTLAB_ACCUMULATORS
#undef GPTLAB_STORES

#else  // AVX-512: one register per panel column; accumulators a<row><chain>
#define GPTLAB_ZACC                                                                                            \
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00, \
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define GPTLAB_ZFMA(r, c, w, k) \
  if constexpr (R > r) a##r##c = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + (k)]), a##r##c);
#define GPTLAB_ZFMAS(c, w, k) GPTLAB_ZFMA(0, c, w, k) GPTLAB_ZFMA(1, c, w, k) GPTLAB_ZFMA(2, c, w, k) \
  GPTLAB_ZFMA(3, c, w, k) GPTLAB_ZFMA(4, c, w, k) GPTLAB_ZFMA(5, c, w, k)
#define GPTLAB_ZDOT(r, c, w, k)                                                                    \
  if constexpr (R > r) {                                                                           \
    int32_t pair;                                                                                  \
    std::memcpy(&pair, xb + r * ldx + (k), sizeof pair);                                           \
    a##r##c = _mm512_dpbf16_ps(a##r##c, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));           \
  }
#define GPTLAB_ZDOTS(c, w, k) GPTLAB_ZDOT(0, c, w, k) GPTLAB_ZDOT(1, c, w, k) GPTLAB_ZDOT(2, c, w, k) \
  GPTLAB_ZDOT(3, c, w, k) GPTLAB_ZDOT(4, c, w, k) GPTLAB_ZDOT(5, c, w, k)
#define GPTLAB_ZSTORE(r) \
  if constexpr (R > r) _mm512_storeu_ps(out[r], _mm512_add_ps(a##r##0, a##r##1));
#define GPTLAB_ZSTORES GPTLAB_ZSTORE(0) GPTLAB_ZSTORE(1) GPTLAB_ZSTORE(2) GPTLAB_ZSTORE(3) GPTLAB_ZSTORE(4) \
  GPTLAB_ZSTORE(5)

inline __m512i zload(const void* p) { return _mm512_loadu_si512(p); }
inline __m512 bf16_low(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 bf16_high(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// fp32 weights: per column one load, one FMA per row; columns alternate between two accumulator chains
template <int R>
inline void tile(const float* x, int64_t ldx, const at::BFloat16*, const float* panel, int64_t K,
                 float out[][kPanel]) {
  GPTLAB_ZACC
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel), w1 = _mm512_loadu_ps(panel + (k + 1) * kPanel);
    GPTLAB_ZFMAS(0, w0, k)
    GPTLAB_ZFMAS(1, w1, k + 1)
  }
  if (k < K) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    GPTLAB_ZFMAS(0, w0, k)
  }
  GPTLAB_ZSTORES
}

// bf16 weights: with bf16 x (xb) one vdpbf16ps per row and column pair, else shift/mask to fp32 and 2 FMAs
template <int R>
inline void tile(const float* x, int64_t ldx, const at::BFloat16* xb, const at::BFloat16* panel, int64_t K,
                 float out[][kPanel]) {
  GPTLAB_ZACC
  int64_t k = 0;
  if (xb != nullptr) {
    for (; k + 4 <= K; k += 4) {
      const __m512i w0 = zload(panel + k * kPanel), w1 = zload(panel + (k + 2) * kPanel);
      GPTLAB_ZDOTS(0, w0, k)
      GPTLAB_ZDOTS(1, w1, k + 2)
    }
    for (; k + 2 <= K; k += 2) {
      const __m512i w0 = zload(panel + k * kPanel);
      GPTLAB_ZDOTS(0, w0, k)
    }
  } else {
    for (; k + 2 <= K; k += 2) {
      const __m512i v = zload(panel + k * kPanel);
      const __m512 w0 = bf16_low(v), w1 = bf16_high(v);
      GPTLAB_ZFMAS(0, w0, k)
      GPTLAB_ZFMAS(1, w1, k + 1)
    }
  }
  if (k < K) {  // K odd: the last column, 16 plain values
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel))), 16));
    GPTLAB_ZFMAS(0, w0, k)
  }
  GPTLAB_ZSTORES
}

// one row: 4 chains (2 per tile<1> step, two steps per iteration)
inline void tile1(const float* x, const at::BFloat16* xb, const float* panel, int64_t K, float out[][kPanel]) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* p = panel + k * kPanel;
    c0 = _mm512_fmadd_ps(_mm512_loadu_ps(p), _mm512_set1_ps(x[k]), c0);
    c1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 16), _mm512_set1_ps(x[k + 1]), c1);
    c2 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 32), _mm512_set1_ps(x[k + 2]), c2);
    c3 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 48), _mm512_set1_ps(x[k + 3]), c3);
  }
  float rest[1][kPanel];
  tile<1>(x + k, 0, xb, panel + k * kPanel, K - k, rest);
  _mm512_storeu_ps(out[0], _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                                         _mm512_loadu_ps(rest[0])));
}

inline void tile1(const float* x, const at::BFloat16* xb, const at::BFloat16* panel, int64_t K,
                  float out[][kPanel]) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  int64_t k = 0;
  if (xb != nullptr) {
    const auto dot = [&](__m512 acc, int64_t kk) {
      int32_t pair;
      std::memcpy(&pair, xb + kk, sizeof pair);
      return _mm512_dpbf16_ps(acc, (__m512bh)zload(panel + kk * kPanel), (__m512bh)_mm512_set1_epi32(pair));
    };
    for (; k + 8 <= K; k += 8) {
      prefetch_ahead(panel + k * kPanel, 8 * kPanel * 2);
      c0 = dot(c0, k);
      c1 = dot(c1, k + 2);
      c2 = dot(c2, k + 4);
      c3 = dot(c3, k + 6);
    }
  } else {
    for (; k + 4 <= K; k += 4) {
      const __m512i v0 = zload(panel + k * kPanel), v1 = zload(panel + (k + 2) * kPanel);
      c0 = _mm512_fmadd_ps(bf16_low(v0), _mm512_set1_ps(x[k]), c0);
      c1 = _mm512_fmadd_ps(bf16_high(v0), _mm512_set1_ps(x[k + 1]), c1);
      c2 = _mm512_fmadd_ps(bf16_low(v1), _mm512_set1_ps(x[k + 2]), c2);
      c3 = _mm512_fmadd_ps(bf16_high(v1), _mm512_set1_ps(x[k + 3]), c3);
    }
  }
  float rest[1][kPanel];
  tile<1>(x + k, 0, xb == nullptr ? nullptr : xb + k, panel + k * kPanel, K - k, rest);
  _mm512_storeu_ps(out[0], _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                                         _mm512_loadu_ps(rest[0])));
}
// bf16 x against two panels at once: each broadcast pair of x serves both panels' vdpbf16ps, so per column pair a
// row costs one broadcast for two dot products (one per panel) instead of one; R <= 8 rows, one accumulator per row
// and panel (16 chains: enough to cover vdpbf16ps's latency at two per cycle). out[2 r + j]: row r, panel j.
// `next` (or null): the two panels after these, prefetched on the way, as the weights come from memory once.
#define GPTLAB_Z2ACC(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = c##r##0;
#define GPTLAB_Z2DOT(r)                                                                       \
  if constexpr (R > r) {                                                                      \
    int32_t pair;                                                                             \
    std::memcpy(&pair, xb + r * ldx + k, sizeof pair);                                        \
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                    \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, (__m512bh)w0, xv);                                    \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, (__m512bh)w1, xv);                                    \
  }
#define GPTLAB_Z2TAIL(r)                                                                      \
  if constexpr (R > r) {                                                                      \
    const __m512 xv = _mm512_set1_ps(static_cast<float>(xb[r * ldx + k]));                   \
    c##r##0 = _mm512_fmadd_ps(t0, xv, c##r##0);                                               \
    c##r##1 = _mm512_fmadd_ps(t1, xv, c##r##1);                                               \
  }
#define GPTLAB_Z2STORE(r)                                                                     \
  if constexpr (R > r) {                                                                      \
    _mm512_storeu_ps(out[2 * r], c##r##0);                                                    \
    _mm512_storeu_ps(out[2 * r + 1], c##r##1);                                                \
  }
#define GPTLAB_Z2ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)

template <int R>
inline void tile2(const at::BFloat16* xb, int64_t ldx, const at::BFloat16* panel0, const at::BFloat16* panel1,
                  int64_t K, const at::BFloat16* next, float out[][kPanel]) {
  static_assert(R >= 1 && R <= 8, "tile2 takes 1 to 8 rows");
  GPTLAB_Z2ALL(GPTLAB_Z2ACC)
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (next != nullptr) {  // the next two panels, a line of each per column pair: in cache when their turn comes
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + (K + k) * kPanel), _MM_HINT_T0);
    }
    const __m512i w0 = zload(panel0 + k * kPanel), w1 = zload(panel1 + k * kPanel);
    GPTLAB_Z2ALL(GPTLAB_Z2DOT)
  }
  if (k < K) {  // K odd: the last column, 16 plain values per panel; x's bf16 values are exact in fp32
    const auto plain = [&](const at::BFloat16* p) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * kPanel))), 16));
    };
    const __m512 t0 = plain(panel0), t1 = plain(panel1);
    GPTLAB_Z2ALL(GPTLAB_Z2TAIL)
  }
  GPTLAB_Z2ALL(GPTLAB_Z2STORE)
}
#undef GPTLAB_Z2ACC
#undef GPTLAB_Z2DOT
#undef GPTLAB_Z2TAIL
#undef GPTLAB_Z2STORE
#undef GPTLAB_Z2ALL
#undef GPTLAB_ZACC
#undef GPTLAB_ZFMA
#undef GPTLAB_ZFMAS
#undef GPTLAB_ZDOT
#undef GPTLAB_ZDOTS
#undef GPTLAB_ZSTORE
#undef GPTLAB_ZSTORES
#endif

}  // namespace GPTLAB_NS::dense_tiles
