// Small dense products on the CPU's bf16 dot products, for the AVX-512 builds' training kernels
// (attention_backward.cpp, newton_schulz.cpp): C (M x N, fp32) (+)= A (M x K, bf16 rows) times B, where B is given
// as bf16 pairs along K (the dot-product instructions' layout). The AMX build runs them on the tile unit (16 x 16
// fp32 blocks, 32 inputs a step); the AVX-512 build with AVX512-BF16's vdpbf16ps (8 rows by 32 columns in
// registers). Both accumulate in fp32. The packing helpers make B from bf16 or fp32 rows.
#pragma once

#include "linear_avx2.h"  // which build this is (GPTLAB_AVX512, GPTLAB_AMX)

#if defined(GPTLAB_AVX512)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace GPTLAB_NS::bf16_products {

using Pair = uint32_t;  // two bf16 values, the first in the low half: one step of a bf16 dot product

using simd::bf16_bits;

// C (M x N fp32, ldc apart) (+)= A (M x K bf16, lda apart) times B given as pairs: b[p * ldb + n] holds B's rows
// 2p and 2p + 1 at column n. M, N and K are multiples of 32 (the callers' blocks and zero-padded matrices).
#if defined(GPTLAB_AMX)
// C tile t (t = 2 i + j: 16 rows by i, 16 columns by j) loaded or zeroed, and stored (tile numbers are immediates)
#define GPTLAB_C_TILE(t, i, j)                                          \
  if (accumulate) _tile_loadd(t, c + 16 * (i) * ldc + 16 * (j), ldc * 4); \
  else _tile_zero(t);
#define GPTLAB_C_STORE(t, i, j) _tile_stored(t, c + 16 * (i) * ldc + 16 * (j), ldc * 4);

// 32 rows by 32 columns of C: tiles 0-3, A 4-5 (16 rows each), B 6-7 (16 columns each)
inline void tiles(const uint16_t* a, int64_t lda, const Pair* b, int64_t ldb, float* c, int64_t ldc, int64_t K,
                  bool accumulate) {
  GPTLAB_C_TILE(0, 0, 0) GPTLAB_C_TILE(1, 0, 1) GPTLAB_C_TILE(2, 1, 0) GPTLAB_C_TILE(3, 1, 1)
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(5, a + 16 * lda + k, lda * 2);
    _tile_loadd(6, b + (k / 2) * ldb, ldb * 4);
    _tile_loadd(7, b + (k / 2) * ldb + 16, ldb * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  GPTLAB_C_STORE(0, 0, 0) GPTLAB_C_STORE(1, 0, 1) GPTLAB_C_STORE(2, 1, 0) GPTLAB_C_STORE(3, 1, 1)
}
#undef GPTLAB_C_TILE
#undef GPTLAB_C_STORE

inline void gemm(const uint16_t* a, int64_t lda, const Pair* b, int64_t ldb, float* c, int64_t ldc, int64_t M,
                 int64_t N, int64_t K, bool accumulate) {
  for (int64_t m = 0; m < M; m += 32)
    for (int64_t n = 0; n < N; n += 32) tiles(a + m * lda, lda, b + n, ldb, c + m * ldc + n, ldc, K, accumulate);
}
#else
template <int R>  // R rows of C by 32 columns in registers
inline void rows(const uint16_t* a, int64_t lda, const Pair* b, int64_t ldb, float* c, int64_t ldc, int64_t K,
                 bool accumulate) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * ldb), b1 = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16);
    for (int r = 0; r < R; ++r) {
      Pair pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}

inline void gemm(const uint16_t* a, int64_t lda, const Pair* b, int64_t ldb, float* c, int64_t ldc, int64_t M,
                 int64_t N, int64_t K, bool accumulate) {
  for (int64_t m = 0; m < M; m += 8)
    for (int64_t n = 0; n < N; n += 32) rows<8>(a + m * lda, lda, b + n, ldb, c + m * ldc + n, ldc, K, accumulate);
}
#endif

// rows x[r] (n rows of d values, ld apart) as pairs along the values: out[i * n + r] = (x[r][2i], x[r][2i + 1]):
// the B operand of a product over d (S = Q K^T: B = K^T)
inline void pairs_across(const uint16_t* x, int64_t ld, int64_t n, int64_t d, Pair* out) {
  for (int64_t r = 0; r < n; ++r) {
    const Pair* row = reinterpret_cast<const Pair*>(x + r * ld);
    for (int64_t i = 0; i < d / 2; ++i) out[i * n + r] = row[i];
  }
}

// rows x[r] (n rows of d values, ld apart; fp32 ones rounded to bf16) as pairs of rows: out[p * d + j] =
// (x[2p][j], x[2p + 1][j]): the B operand of a product over the rows (dQ = dS K: B = K; dV^T = dO^T P: B = P)
inline uint16_t bits(uint16_t v) { return v; }
inline uint16_t bits(float v) { return bf16_bits(v); }

template <typename T>
inline void pairs_down(const T* x, int64_t ld, int64_t n, int64_t d, Pair* out) {
  for (int64_t p = 0; p < n / 2; ++p) {
    const T* r0 = x + 2 * p * ld;
    const T* r1 = r0 + ld;
    Pair* o = out + p * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) o[j] = static_cast<Pair>(bits(r0[j])) | (static_cast<Pair>(bits(r1[j])) << 16);
  }
}

}  // namespace GPTLAB_NS::bf16_products

#endif  // GPTLAB_AVX512
